"""encdec: an encoder/decoder (seq2seq) inference engine with vLLM's names.

Public names load lazily, so bookkeeping modules (``encdec.sequence``,
``encdec.block_manager``, ``encdec.core``) import without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "encdec.entrypoints.llm",
    "SamplingParams": "encdec.sampling_params",
    "BeamSearchParams": "encdec.sampling_params",
    "StructuredOutputsParams": "encdec.sampling_params",
    "RequestOutput": "encdec.outputs",
    "CompletionOutput": "encdec.outputs",
    "TextPrompt": "encdec.inputs",
    "TokensPrompt": "encdec.inputs",
    "ExplicitEncoderDecoderPrompt": "encdec.inputs",
    "build_explicit_enc_dec_prompt": "encdec.inputs",
    "zip_enc_dec_prompts": "encdec.inputs",
    "to_enc_dec_tuple_list": "encdec.inputs",
    "configure_cpu_runtime": "encdec.platform.cpu_runtime",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'encdec' has no attribute {name!r}")
