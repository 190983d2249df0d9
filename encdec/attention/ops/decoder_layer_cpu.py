"""Builds and calls ``decoder_layer_cpu.c``: a pre-LayerNorm decoder layer
(Whisper's) over the few rows of a decode step, in one call.

The C file includes the decode-step matmul and paged attention kernels, so
its vector path is theirs (``path(isa)``: "avx512", "avx2" or "none"), built
by ``build.load`` for ``build.cpu_isa()``. Where no compiler works,
``available()`` is False and the model runs its layers op by op (logged once).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from encdec.attention.ops import build, small_linear_cpu
from encdec.cpu_threads import BANDWIDTH_MIN_SEQS, bandwidth_threads

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_ROWS = small_linear_cpu.MAX_ROWS  # rows the matmul kernel serves (see small_linear_cpu)
_ARGS = [_P, _P, _I64, _I64, _I64, _I64, _F, _F, *[_P] * 18, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _P,
         ctypes.c_int]


@cache
def _kernel(isa: str):
    return build.load_function("decoder_layer_cpu.c", "decoder_layer_f32", _ARGS, None,
                               "decoder layers of decode steps run op by op (slower)", isa=isa)


def available(isa: str | None = None) -> bool:
    return _kernel(isa or build.cpu_isa()) is not None


def path(isa: str | None = None) -> str | None:
    """The vector path the build for ``isa`` runs, or None if unbuilt."""
    return build.vector_path("decoder_layer_cpu.c", "decoder_layer_path", isa)


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer's fixed kernel arguments, taken once: its sizes and the
    pointers of its 18 weights and biases (``tensors`` holds them, so the
    pointers stay valid). A step then costs one call, not ~40 module lookups."""
    d: int
    num_heads: int
    ffn: int
    eps: float
    scale: float
    tensors: tuple[torch.Tensor, ...]
    ptrs: tuple[int, ...]


def layer_weights(layer) -> LayerWeights | None:
    """``layer``'s (a ``WhisperDecoderLayer``) arguments for ``decode_step``, or
    None where the kernel cannot run it (no build; not float32, CPU, contiguous;
    a bias missing; self and cross attention shaped differently)."""
    sa, ca = layer.self_attn, layer.encoder_attn
    norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
    mods = (norms[0], sa.qkv_proj, sa.out_proj, norms[1], ca.q_proj, ca.out_proj, norms[2], layer.fc1, layer.fc2)
    tensors = tuple(t for m in mods for t in (m.weight, m.bias))
    if not (available() and all(t is not None and t.dtype == torch.float32 and t.device.type == "cpu"
                                and t.is_contiguous() for t in tensors)
            and sa.scale == ca.scale and sa.num_heads == ca.num_heads and len({n.eps for n in norms}) == 1):
        return None
    return LayerWeights(layer.fc2.out_features, sa.num_heads, layer.fc1.out_features, norms[0].eps, sa.scale,
                        tensors, tuple(t.data_ptr() for t in tensors))


def decode_step(h: torch.Tensor, layers: list[LayerWeights], kv_caches: list[torch.Tensor],
                slots: torch.Tensor, self_tables: torch.Tensor, self_lens: torch.Tensor,
                cross_tables: torch.Tensor, cross_lens: torch.Tensor, *, isa: str | None = None) -> bool:
    """Run ``layers`` (one per decoder layer, with its cache in ``kv_caches``) on
    ``h`` (M, d), in place, for M decode rows: the new K/V go to ``slots`` (int64)
    of each cache (2, blocks, block_size, H, D); self and cross tables (int32,
    row-major) and lengths (int32) are the attention metadata's. False, having
    done nothing, where the step does not qualify: no layers, more than
    ``MAX_ROWS`` rows, a cache or metadata tensor of another layout."""
    m = h.shape[0]
    index = (slots, self_tables, self_lens, cross_tables, cross_lens)
    if not (layers and 0 < m <= MAX_ROWS and h.is_contiguous() and _index_ok(m, *index)
            and all(_cache_ok(c, w.num_heads) for w, c in zip(layers, kv_caches))):
        return False
    kernel = _kernel(isa or build.cpu_isa())
    work = torch.empty(m * max(7 * w.d + w.ffn for w in layers), dtype=torch.float32)  # reused by each layer
    threads = bandwidth_threads() if m >= BANDWIDTH_MIN_SEQS else torch.get_num_threads()
    for w, kv_cache in zip(layers, kv_caches):
        decoder_layer(kernel, h, w, kv_cache, work, threads, *index)
    return True


def decoder_layer(kernel, h: torch.Tensor, w: LayerWeights, kv_cache: torch.Tensor, work: torch.Tensor,
                  threads: int, slots: torch.Tensor, self_tables: torch.Tensor, self_lens: torch.Tensor,
                  cross_tables: torch.Tensor, cross_lens: torch.Tensor) -> None:
    """One layer's call (``decode_step`` checks and prepares what the layers share)."""
    kernel(h.data_ptr(), work.data_ptr(), h.shape[0], w.d, w.num_heads, w.ffn, w.eps, w.scale, *w.ptrs,
           kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache.shape[2], slots.data_ptr(),
           self_tables.data_ptr(), self_tables.stride(0), self_lens.data_ptr(),
           cross_tables.data_ptr(), cross_tables.stride(0), cross_lens.data_ptr(), threads)


def _cache_ok(kv_cache: torch.Tensor, num_heads: int) -> bool:
    return (kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
            and kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == num_heads)


def _index_ok(num_rows: int, slots: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Slots int64, one per row; tables and lengths int32; all contiguous on CPU."""
    return (slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == num_rows
            and all(t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous() for t in rest))
