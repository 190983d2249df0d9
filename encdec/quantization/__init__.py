"""Reduced precision on CPU: the int8 linear method, and the int8 and bfloat16 passes over a loaded model."""
from __future__ import annotations

import importlib
from typing import Any

# Public names load lazily: ``encdec.models.layers`` imports ``quantization.int8``,
# and ``quantization.passes`` imports ``encdec.models.layers``, so this package's
# own import must import neither.
_MODULES = {
    "encdec.quantization.int8": ("INT8_PATHS", "Int8LinearMethod", "int8_path", "reduce_range"),
    "encdec.quantization.passes": ("check_quantization", "quantize", "fused_step_linears",
                                   "decode_panel_linears", "place_decode_panels"),
    "encdec.quantization.bfloat16": ("float32_logits", "kv_cache_dtype"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'encdec.quantization' has no attribute {name!r}")
