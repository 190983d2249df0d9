"""Batch-level logits processors (vLLM V1's programming model, seeds 000/001)."""
from __future__ import annotations

from encdec.sample.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from encdec.sample.logits_processor.builtin import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from encdec.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    MoveDirectionality,
    RemovedRequest,
)
from encdec.sample.logits_processor.loading import (
    ENTRY_POINT_GROUP,
    build_logitsprocs,
    default_processor_config,
    resolve_logitsproc_class,
)
from encdec.sample.logits_processor.state import (
    BatchUpdateBuilder,
    LogitsProcessors,
    process_dict_updates,
)

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "ENTRY_POINT_GROUP",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "build_logitsprocs",
    "default_processor_config",
    "process_dict_updates",
    "resolve_logitsproc_class",
]
