"""``encdec serve``'s command line, importable without the serve extra (``encdec --help``)."""
from __future__ import annotations

import argparse

from encdec.engine.arg_utils import EngineArgs
from encdec.entrypoints.cli_options import add_engine_args, engine_options


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``encdec serve``'s options: MODEL, the server's own, then every ``EngineArgs``
    field (the options ``LLM`` takes), named as on ``encdec generate``.

    One default differs from ``LLM``'s: a server schedules by priority. Its realtime
    sessions rank a turn's final pass ahead of partial passes and uploads, which
    is what holds final text within a second of the end of speech when several
    streams share the engine; with every priority at 0 (requests that name none)
    the priority policy admits and preempts exactly as fcfs does, so nothing else
    changes. An explicit ``--scheduling-policy fcfs`` is kept: the sessions then
    send priority 0 and passes run in arrival order."""
    p.add_argument("model", metavar="MODEL", help="HF hub id or local checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--max-audio-mb", type=float, default=25.0, help="largest audio upload, MiB")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--header-read-timeout", type=float, default=15.0,
                   help="seconds a client has to send a request's line and headers; then it is dropped")
    p.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="longest wait, seconds, for the next piece of a request body; then 408")
    p.add_argument("--body-timeout", type=float, default=300.0,
                   help="longest time, seconds, a whole request body may take after its headers; then 408 "
                        "(a 25 MiB upload needs about 90 KB/s)")
    p.add_argument("--realtime-max-turn-seconds", type=float, default=30.0,
                   help="a realtime turn that reaches this length (>= 10 s) is committed and transcribed there, "
                        "at its quietest 100 ms of the last 5 s, and the next turn goes on (default 30: one "
                        "Whisper window)")
    p.add_argument("--realtime-idle-timeout", type=float, default=300.0,
                   help="seconds without a client event after which a realtime session gets an error event "
                        "(session_idle_timeout) and is closed")
    p.add_argument("--realtime-max-session-seconds", type=float, default=3600.0,
                   help="age at which a realtime session gets an error event (session_expired) and is closed")
    p.add_argument("--no-ui", action="store_true",
                   help="serve no web page at / (the page: upload, live microphone and text panels)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    scale = p.add_argument_group("scale-out on Ray Serve (the serve-ray extra)")
    scale.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: --replicas engine replicas, each running the whole OpenAI "
                            "app, Serve's HTTP proxy spreading requests over them (joins the cluster at "
                            "RAY_ADDRESS, or starts a local one)")
    scale.add_argument("--ingress", choices=["serve", "haproxy"], default="serve",
                       help="the front door (with --ray): Serve's Python HTTP proxy, or Serve's HAProxy ingress "
                            "(Ray >= 2.60 and an HAProxy binary; each replica then serves HTTP itself and "
                            "HAProxy forwards to it, no Ray call on the request path)")
    scale.add_argument("--replicas", type=int, default=1,
                       help="engine replicas behind Serve's proxy (with --ray); each is one engine")
    scale.add_argument("--replica-cpus", type=float, default=1.0,
                       help="CPUs Ray reserves for each engine replica (with --ray)")
    scale.add_argument("--replica-gpus", type=float, default=0.0,
                       help="GPUs Ray reserves for each engine replica (with --ray)")
    scale.add_argument("--disaggregate", default=None, metavar="encoders=E,decoders=D",
                       help="encoder passes on E encoder workers, decoding on D engine replicas fed their "
                            "encoder outputs in the workers' replies (with --ray, instead of --replicas; "
                            "each worker and replica reserves --replica-cpus/--replica-gpus)")
    engine = p.add_argument_group("engine options (as LLM takes them)")
    add_engine_args(engine)
    p.set_defaults(scheduling_policy="priority")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**engine_options(args))
