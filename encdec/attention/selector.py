"""Backends by name, imported only when chosen, so ``import encdec`` needs no xFormers.

The default (``attention_backend=None``):

    CPU   torch_sdpa (the per-sequence loop and the C kernels; fastest there)
    CUDA  torch_native (flex_attention + the Triton paged kernel, no extra package);
          one warning when xFormers is installed without CUDA kernels, saying how
          to get the ones ``attention_backend="xformers"`` needs

``attention_backend="xformers"`` on CUDA is checked first: its kernels must run
the calls the backend makes (BlockDiagonalMask and BlockDiagonalCausalMask, the
model's dtype), else a ValueError. The PyPI xFormers wheel is built without CUDA
(its ``memory_efficient_attention`` raises "No operator found" on every call):
the PyTorch-index wheels carry the kernels. On CPU it runs its reference path.
"""
from __future__ import annotations

import importlib
import logging

import torch

from encdec.attention.backends.abstract import AttentionBackend

logger = logging.getLogger(__name__)

_BACKENDS = {
    "torch_sdpa": "encdec.attention.backends.torch_sdpa:TorchSDPABackend",
    "torch_native": "encdec.attention.backends.torch_native:TorchNativeBackend",
    "xformers": "encdec.attention.backends.xformers:XFormersBackend",
}

CUDA_XFORMERS_HINT = (
    "for xFormers' CUDA kernels install the wheel built for your torch and CUDA from the "
    "PyTorch index, e.g. pip install xformers --index-url https://download.pytorch.org/whl/cu128 "
    "(match cu128 to torch.version.cuda); the PyPI wheel has no CUDA kernels")

_warned: set[str] = set()


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _probe_device(device: str) -> str:
    """Where the kernel probe's tensors live (a seam for the CPU tests)."""
    return device


def xformers_problem(device: str, dtype: torch.dtype) -> str | None:
    """None when xFormers runs, on ``device`` in ``dtype``, the calls its backend
    makes (prefill with BlockDiagonalMask and BlockDiagonalCausalMask, decode's
    BlockDiagonalMask of one query per sequence); else why not, in a sentence."""
    try:
        import xformers.ops as xops
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask, BlockDiagonalMask
    except ImportError as e:
        return f"xformers does not import ({e})"
    dev = torch.device(_probe_device(device))
    try:
        biases = [BlockDiagonalMask.from_seqlens([2, 1], [1, 2], device=dev),
                  BlockDiagonalCausalMask.from_seqlens([2, 1], device=dev),
                  BlockDiagonalMask.from_seqlens([1, 1, 1], [1, 1, 1], device=dev)]
        q = torch.zeros(1, 3, 2, 64, device=dev, dtype=dtype)  # (B, M, H, D), packed
        for bias in biases:
            xops.memory_efficient_attention(q, q, q, attn_bias=bias)
    except Exception as e:  # any failure means: the backend's forward would fail the same way
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"xformers imports but its kernels do not run in {dtype} ({type(e).__name__}: {first})"
    return None


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def get_attn_backend(name: str | None, device: str, *,
                     dtype: torch.dtype = torch.float16) -> type[AttentionBackend]:
    """The backend ``name`` (a ValueError if it cannot run here), or the default
    for ``device`` (see the module docstring). ``dtype``: the model's, which the
    xFormers kernel probe runs in."""
    on_cuda = device.startswith("cuda")
    if name is None:
        if not on_cuda:
            return _load("torch_sdpa")
        problem = xformers_problem(device, dtype)
        if problem is not None and not problem.startswith("xformers does not import"):
            _warn_once(f"{problem}; using the torch_native attention backend (the CUDA default). "
                       f"For attention_backend='xformers': {CUDA_XFORMERS_HINT}")
        return _load("torch_native")
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    if name == "xformers" and on_cuda:
        problem = xformers_problem(device, dtype)
        if problem is not None:
            raise ValueError(f"attention_backend='xformers' cannot run here: {problem}; "
                             f"{CUDA_XFORMERS_HINT}, or use attention_backend='torch_native'")
    try:
        return _load(name)
    except ImportError as e:
        raise ValueError(f"attention_backend={name!r} cannot run here: {e}") from e
