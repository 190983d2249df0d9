"""Reduced precision on CPU: the int8 linear method, and the int8 and bfloat16 passes over a loaded model."""
from __future__ import annotations

import importlib
from typing import Any

# Public names load lazily: ``encdec.models.layers`` imports ``quantization.int8``,
# and ``quantization.passes`` imports ``encdec.models.layers``, so this package's
# own import must import neither.
_EXPORTS = {
    "INT8_PATHS": "encdec.quantization.int8",
    "Int8LinearMethod": "encdec.quantization.int8",
    "int8_path": "encdec.quantization.int8",
    "reduce_range": "encdec.quantization.int8",
    "check_quantization": "encdec.quantization.passes",
    "quantize": "encdec.quantization.passes",
    "fused_step_linears": "encdec.quantization.passes",
    "decode_panel_linears": "encdec.quantization.passes",
    "place_decode_panels": "encdec.quantization.passes",
    "float32_logits": "encdec.quantization.bfloat16",
    "kv_cache_dtype": "encdec.quantization.bfloat16",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'encdec.quantization' has no attribute {name!r}")
