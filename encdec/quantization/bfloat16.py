"""bfloat16 on CPU (``dtype="bfloat16"``) and the KV cache's dtype.

bf16 weights and activations run oneDNN's bf16 matmuls (float32 accumulation) and
torch's bf16 softmax and layer norms (float32 inside); the float32 C kernels
decline bf16 tensors and their callers take torch's path. Rules that must hold:
the logits are float32 sums (``float32_logits``), never rounded to bfloat16; a
CPU where bfloat16 runs slower than float32 refuses it (measured:
``encdec.platform.precision``); the KV cache holds the model's dtype, or
bfloat16 under float32 weights where the C decode kernels widen it
(``kv_cache_dtype``).
"""
from __future__ import annotations

import torch
from torch import nn

from encdec.models.layers import Linear


def float32_logits(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """bfloat16 on CPU: the LM head (the ``Linear`` with ``model.vocab_size``
    outputs) widened to float32 (``Linear.widen_to_float32``: the same bf16
    values), so the logits are its float32 sums, not those rounded to bfloat16;
    returns how many heads. Why: a bf16 logit near 20 is a multiple of 0.125, and
    Whisper's two best tokens are often closer than that, so rounding makes ties
    that greedy and beam search break by token id. Costs the head's float32 weight
    (the embedding keeps its bf16 one) and twice the bytes read per step. torch's
    CPU matmuls have no bf16 x bf16 -> float32 output (``torch.mm(out_dtype=)``
    is CUDA-only)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return 0
    heads = [m for m in model.modules() if isinstance(m, Linear) and m.out_features == model.vocab_size]
    for m in heads:
        m.widen_to_float32()
    return len(heads)


def kv_cache_dtype(cache_dtype: str, dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """The dtype the KV cache holds: the model's ("auto" or its name), or
    bfloat16 under float32 weights on CPU with the torch_sdpa backend, whose C
    decode kernels read it widened to float32 (half the bytes a decode step
    streams: Whisper's cross K/V is most of them). ValueError for anything else:
    the other backends attend in the dtype they are given."""
    name = str(dtype).removeprefix("torch.")
    if cache_dtype in ("auto", name):
        return dtype
    if cache_dtype == "bfloat16" and dtype == torch.float32:
        if device.type != "cpu" or backend != "torch_sdpa":
            raise ValueError(f"kv_cache_dtype='bfloat16' with dtype='float32' runs on CPU with the torch_sdpa "
                             f"attention backend only (here: {device.type}, {backend}); on CUDA use "
                             "dtype='bfloat16'")
        return torch.bfloat16
    raise ValueError(f"kv_cache_dtype={cache_dtype!r} with dtype={name!r} is not supported: the KV cache "
                     f"holds the model's dtype (kv_cache_dtype='auto' or {name!r}), or bfloat16 under "
                     "float32 weights on CPU")
