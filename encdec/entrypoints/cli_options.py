"""Command-line flags built from the option dataclasses (``EngineArgs``,
``TranscribeOptions``), so each option is written once: its field gives the
name (``max_num_seqs`` -> ``--max-num-seqs``), default and type, its comment the
``--help`` text, its metadata ``choices``, ``aliases`` and ``unit``.

Types map to flags as follows: ``bool`` -> ``--x / --no-x``; ``int``, ``float``,
``str``; ``list[...]`` -> any number of values; ``tuple[float, ...]`` -> comma-separated
numbers; ``unit="bytes"`` -> a memory size (``parse_memory_size``). An optional
(``X | None``) field whose default is not None also takes ``none``. A field of any
other type must be listed in ``no_flag`` with the reason it has no flag.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

# EngineArgs fields with no flag, and why (tests/test_cli.py holds every other
# field to a flag on generate, transcribe and serve).
ENGINE_NO_FLAG = {"model": "each command takes it its own way: MODEL on serve, --model on generate "
                           "and transcribe (optional there: the bundled Whisper tiny.en)"}

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}


def parse_memory_size(text: str) -> int:
    """Bytes from ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or a plain byte count (units
    are case-insensitive; KiB/MiB/GiB/TiB are powers of 2, kB/MB/GB/TB of 10)."""
    low = text.strip().lower()
    number, scale = low, 1
    for unit, unit_scale in _UNITS.items():
        if low.endswith(unit):
            number, scale = low[: -len(unit)].strip(), unit_scale
            break
    if number.isdigit():
        return int(number) * scale
    if scale > 1 and number.replace(".", "", 1).isdigit():
        return int(float(number) * scale)
    raise argparse.ArgumentTypeError(f"expected a size like 512MiB, 2GiB or a byte count, got {text!r}")


def parse_floats(text: str) -> tuple[float, ...]:
    """``"0,0.2,0.4"`` -> ``(0.0, 0.2, 0.4)``."""
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def add_engine_args(parser: Any) -> None:
    """A flag for every ``EngineArgs`` field but ``model`` (``ENGINE_NO_FLAG``)."""
    from encdec.engine.arg_utils import EngineArgs

    add_dataclass_args(parser, EngineArgs, no_flag=ENGINE_NO_FLAG)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineArgs``'s fields from parsed ``args`` (``args.model`` included), as
    ``LLM(**engine_options(args))`` takes them."""
    from encdec.engine.arg_utils import EngineArgs

    return dataclass_values(args, EngineArgs)


def add_dataclass_args(parser: Any, cls: type, *, no_flag: Mapping[str, str]) -> None:
    """One flag per field of ``cls`` not in ``no_flag`` (field name -> why it has none)."""
    docs = field_comments(cls)
    for f in fields(cls):
        if f.name in no_flag:
            continue
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: give it one or list it in no_flag")
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kwargs = _flag_kwargs(cls, f)
        help_text = docs.get(f.name, "").rstrip(".").replace("%", "%%")
        action = parser.add_argument(*flags, dest=f.name, default=f.default, help=help_text, **kwargs)
        if f.default is not None and "%(default)" not in action.help:  # (3.10's BooleanOptionalAction adds it)
            off = "; 'none' turns it off" if getattr(action.type, "takes_none", False) else ""
            action.help += f" (default: %(default)s{off})"


def dataclass_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of ``cls``'s fields that ``args`` holds (fields without a flag are left out)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def _flag_kwargs(cls: type, f: Field) -> dict[str, Any]:
    hint = str(f.type)
    optional = hint.endswith(" | None")
    base = hint.removesuffix(" | None")
    kwargs: dict[str, Any] = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
    if f.metadata.get("unit") == "bytes":
        convert: Callable[[str], Any] = parse_memory_size
    elif f.metadata.get("form") == "json":  # the field takes the JSON text itself and parses it
        return {**kwargs, "type": str, "metavar": "JSON"}
    elif base == "bool":
        return {"action": argparse.BooleanOptionalAction}
    elif base.startswith("list["):
        return {**kwargs, "nargs": "*"}
    elif base.startswith("tuple[float"):
        convert = parse_floats
    elif base in ("int", "float", "str"):
        convert = {"int": int, "float": float, "str": str}[base]
    else:
        raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for type {hint!r}; "
                        f"give it one here or list it in no_flag with the reason")
    if optional and f.default is not None:
        convert = _or_none(convert)
    return {**kwargs, "type": convert}


def _or_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert``, or None for ``none`` (an option on by default, turned off)."""
    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else convert(text)

    parse.__name__ = f"{convert.__name__} or 'none'"  # argparse: "invalid float or 'none' value: 'x'"
    parse.takes_none = True
    return parse




def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the comment lines just above the
    field, then the comment on its line. Empty where the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    whole_line = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n in whole_line:
            above.insert(0, comments[n])
            n -= 1
        after = [comments[node.lineno]] if node.lineno in comments and node.lineno not in whole_line else []
        docs[node.target.id] = " ".join(above + after)
    return docs
