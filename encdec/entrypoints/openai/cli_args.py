"""``encdec serve``'s command line, importable without the serve extra (``encdec --help``)."""
from __future__ import annotations

import argparse
import dataclasses

from encdec.engine.arg_utils import EngineArgs

_NOT_OPTIONS = ("model", "extra")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``encdec serve``'s options: MODEL, the server's own, then every ``EngineArgs``
    field (the options ``LLM`` takes), named as on ``encdec generate``."""
    p.add_argument("model", metavar="MODEL", help="HF hub id or local checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--max-audio-mb", type=float, default=25.0, help="largest audio upload, MiB")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine options (as LLM takes them)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in _NOT_OPTIONS:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type)
        if kind == "bool":
            # --x / --no-x with the engine's own default (enable_encoder_cache is True)
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif kind.startswith("list"):
            engine.add_argument(flag, nargs="*", default=f.default)
        else:
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            engine.add_argument(flag, type=conv, default=f.default)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name not in _NOT_OPTIONS]
    return EngineArgs(model=args.model, **{n: getattr(args, n) for n in names})
