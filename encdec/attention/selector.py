"""Backends by name, imported only when chosen, so ``import encdec`` needs no xFormers."""
from __future__ import annotations

import importlib

from encdec.attention.backends.abstract import AttentionBackend

_BACKENDS = {
    "torch_sdpa": "encdec.attention.backends.torch_sdpa:TorchSDPABackend",
    "xformers": "encdec.attention.backends.xformers:XFormersBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_attn_backend(name: str | None, device: str) -> type[AttentionBackend]:
    """``None`` picks xFormers on CUDA when it imports, else torch SDPA."""
    if name is None:
        if device.startswith("cuda"):
            try:
                return _load("xformers")
            except ImportError:
                pass
        return _load("torch_sdpa")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    try:
        return _load(name)
    except ImportError as e:
        raise ValueError(f"attention_backend={name!r} cannot run here: {e}") from e
