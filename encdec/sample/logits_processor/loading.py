"""Loading processors once, at engine start: the built-ins, then custom ones given
by class object or fully-qualified class name, then every installed entry point
in the ``encdec.logits_processors`` group (seed 001).
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from encdec.sample.logits_processor.builtin import BUILTIN_LOGITS_PROCESSORS
from encdec.sample.logits_processor.interface import LogitsProcessor
from encdec.sample.logits_processor.state import LogitsProcessors

ENTRY_POINT_GROUP = "encdec.logits_processors"
DEFAULT_MAX_NUM_SEQS = 256  # LLM's default max_num_seqs


@dataclass(frozen=True)
class _SchedulerLimits:
    max_num_seqs: int


@dataclass(frozen=True)
class ProcessorConfig:
    """Stand-in for the engine config when none is given: processors only rely
    on ``config.scheduler_config.max_num_seqs``."""

    scheduler_config: _SchedulerLimits


def default_processor_config(max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> ProcessorConfig:
    return ProcessorConfig(_SchedulerLimits(max_num_seqs))


def _check_class(obj: Any, where: str) -> type[LogitsProcessor]:
    if not isinstance(obj, type):
        raise TypeError(
            f"{where} is a {type(obj).__name__}, not a class; pass the LogitsProcessor "
            "subclass itself (the engine builds the instance)"
        )
    if not issubclass(obj, LogitsProcessor):
        raise TypeError(f"{where} ({obj.__qualname__}) is not a subclass of LogitsProcessor")
    return obj


def resolve_logitsproc_class(spec: str | type) -> type[LogitsProcessor]:
    """``"pkg.module:Class"``, ``"pkg.module.Class"`` or the class itself."""
    if not isinstance(spec, str):
        return _check_class(spec, f"logits processor {spec!r}")
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"logits processor {spec!r} is not a fully-qualified class name; "
            "expected 'pkg.module:Class' or 'pkg.module.Class'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"logits processor {spec!r}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"logits processor {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    return _check_class(obj, f"logits processor {spec!r}")


def entry_point_logitsproc_classes(group: str = ENTRY_POINT_GROUP) -> list[type[LogitsProcessor]]:
    """Every installed entry point of ``group``; all are always loaded (as vLLM does)."""
    classes = []
    for ep in importlib.metadata.entry_points(group=group):
        try:
            obj = ep.load()
        except Exception as e:
            raise ValueError(f"entry point {ep.name!r} ({ep.value}) of {group!r} failed to load: {e}") from e
        classes.append(_check_class(obj, f"entry point {ep.name!r} ({ep.value})"))
    return classes


def build_logitsprocs(
    config: Any | None,
    device: torch.device | str,
    is_pin_memory: bool = False,
    custom_logitsprocs: Iterable[str | type] = (),
    *,
    include_builtins: bool = True,
    include_entry_points: bool = True,
) -> LogitsProcessors:
    """Instantiate the engine's processors: built-ins, ``custom_logitsprocs`` (the
    ``LLM(logits_processors=...)`` list), then entry points; a class appearing
    twice is built once. ``config=None`` uses ``default_processor_config()``."""
    config = default_processor_config() if config is None else config
    if not hasattr(getattr(config, "scheduler_config", None), "max_num_seqs"):
        raise TypeError("config must expose config.scheduler_config.max_num_seqs")
    if isinstance(custom_logitsprocs, (str, type)):
        custom_logitsprocs = [custom_logitsprocs]
    classes = list(BUILTIN_LOGITS_PROCESSORS) if include_builtins else []
    classes += [resolve_logitsproc_class(spec) for spec in custom_logitsprocs]
    if include_entry_points:
        classes += entry_point_logitsproc_classes()
    device = torch.device(device)
    unique = list(dict.fromkeys(classes))
    return LogitsProcessors(cls(config, device, is_pin_memory) for cls in unique)
