"""``encdec serve``'s command line, importable without the serve extra (``encdec --help``)."""
from __future__ import annotations

import argparse

from encdec.engine.arg_utils import EngineArgs
from encdec.entrypoints.cli_options import add_engine_args, engine_options


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``encdec serve``'s options: MODEL, the server's own, then every ``EngineArgs``
    field (the options ``LLM`` takes), named as on ``encdec generate``."""
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
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine options (as LLM takes them)")
    add_engine_args(engine)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**engine_options(args))
