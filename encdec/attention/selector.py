"""Backends by name, imported only when chosen, so ``import encdec`` needs no xFormers."""
from __future__ import annotations

import importlib
import logging

from encdec.attention.backends.abstract import AttentionBackend

logger = logging.getLogger(__name__)

_BACKENDS = {
    "torch_sdpa": "encdec.attention.backends.torch_sdpa:TorchSDPABackend",
    "torch_native": "encdec.attention.backends.torch_native:TorchNativeBackend",
    "xformers": "encdec.attention.backends.xformers:XFormersBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _xformers_kernels_run() -> bool:
    """xFormers can import yet have no working CUDA kernels (a wheel built for
    another torch); try one tiny call before choosing it by default."""
    try:
        import torch
        import xformers.ops as xops

        q = torch.zeros(1, 2, 1, 64, device="cuda", dtype=torch.float16)
        xops.memory_efficient_attention(q, q, q)
        return True
    except Exception as e:  # any failure means: do not pick it silently
        logger.warning("xFormers imports but its CUDA kernels do not run (%s); using torch_sdpa", e)
        return False


def get_attn_backend(name: str | None, device: str) -> type[AttentionBackend]:
    """``None`` picks xFormers on CUDA when it imports and its kernels run, else torch SDPA."""
    if name is None:
        if device.startswith("cuda"):
            try:
                backend = _load("xformers")
            except ImportError:
                backend = None
            if backend is not None and _xformers_kernels_run():
                return backend
        return _load("torch_sdpa")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    try:
        return _load(name)
    except ImportError as e:
        raise ValueError(f"attention_backend={name!r} cannot run here: {e}") from e
