"""Builds and calls ``decoder_step_cpu.c``: every pre-LayerNorm decoder layer
(Whisper's; mBART's, M2M100's and NLLB's are the same layer with a GELU or ReLU
FFN), or every post-LayerNorm one (BART's), of a decode-only step, in one call
whose threads share each phase (team.h).

The C file includes the panel matmul and paged attention kernels, so its
vector path is theirs (``path(isa)``: "avx512", "avx2" or "none"), built by
``build.load`` for ``build.cpu_isa()``. Where no compiler works,
``available()`` is False, ``decoder_weights`` and ``decode_step`` return None
and the model runs its layers op by op (logged once).

int8 decoder weights (``quantization="int8"``) run in the same step on CPUs with
AVX512-VNNI (``small_linear_int8_cpu.vnni_available``): the matmuls read a
quarter of the bytes. Measured on tiny.en, a 6-minute file sequentially (Xeon
AVX-512 VNNI, 2 threads, 840 steps of one row): the steps 1.26 -> 0.76 s, the
run 5.0 -> 4.3 s (float32 decoder weights in the step before). Elsewhere int8 decoder weights would
run op by op, slower than float32 in this step, so ``quantization.quantize``
keeps them float32 there.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from encdec.kernels.cpu import build, paged_attention_cpu, small_linear_cpu, small_linear_int8_cpu
from encdec.platform.cpu_threads import bandwidth_threads

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Rows a step may have: the matmuls run as fast as oneDNN's at any count (within 5%
# from 32 to 256 rows, Whisper's shapes), and the attention reads a shared cross
# table once; past this the work buffers grow and the step runs op by op.
MAX_ROWS = 256
_ARGS = [_P, _P, _I64, _I64, _I64, _I64, _F, _F, _P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _P, ctypes.c_int,
         ctypes.c_int, _P, ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.c_int]
ACTIVATIONS = {act: small_linear_cpu.POST[act] for act in ("gelu", "relu")}  # the FFN activations the kernel runs
_KERNEL = build.Kernel("decoder_step_cpu.c", "decoder_step_f32", _ARGS, ctypes.c_int,
                       "decoder layers of decode steps run op by op (slower)", path_symbol="decoder_step_path")
available, path = _KERNEL.available, _KERNEL.path


@dataclass
class DecoderWeights:
    """A decoder's fixed kernel arguments, taken once: its sizes, and per layer
    the pointers of its 18 weights and biases (matmul weights packed in
    panels; ``tensors`` holds them, so the pointers stay valid), in the C
    ``layer_t`` order; the two cache pointers are filled in per cache."""
    d: int
    num_heads: int
    ffn: int
    eps: float
    scale: float
    activation: str  # a key of ACTIVATIONS
    tensors: list[torch.Tensor]
    weight_ptrs: list[list[int]]  # per layer, 18 addresses
    int8_table: torch.Tensor | None = None  # (layers, 18) int64: the C qlayer_t array, or None (float32)
    rms_norm: bool = False  # T5's RMSNorm (no mean, no bias) in place of LayerNorm
    post_norm: bool = False  # BART's layers: each norm after its residual add
    _table: tuple[tuple[int, ...], torch.Tensor] | None = field(default=None, repr=False)

    def table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The (layers, 20) int64 ``layer_t`` array for these caches (kept while they stay)."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._table is None or self._table[0] != key:
            rows = [p + [c[0].data_ptr(), c[1].data_ptr()] for p, c in zip(self.weight_ptrs, kv_caches)]
            self._table = (key, torch.tensor(rows, dtype=torch.int64))
        return self._table[1]


def decoder_weights(layers, activation: str = "gelu", *, post_norm: bool = False) -> DecoderWeights | None:
    """The arguments of ``decode_step`` for ``layers`` (pre-norm decoder layers:
    ``WhisperDecoderLayer``s, ``BartDecoderLayer``s of a pre-norm family, or
    ``T5DecoderLayer``s with a non-gated FFN: RMSNorm, no biases; ``post_norm``:
    BART's post-norm ``BartDecoderLayer``s) whose FFN
    applies ``activation`` (exact "gelu" or "relu"), or None where the kernel
    cannot run them (another activation; a gated FFN; no build; a weight not
    float32 (or int8 from ``Linear.quantize_int8`` on a CPU with VNNI), CPU,
    contiguous; layers shaped differently; self and cross attention shaped
    differently; heads x head size other than d_model, as in flan-t5-small)."""
    if not layers or activation not in ACTIVATIONS or not available():
        return None
    linears = [decoder_linears(ly) for ly in layers]
    if any(lin is None for lin in linears):
        return None
    int8 = {getattr(m, "int8", None) is not None for lin in linears for m in lin}
    if int8 == {True} and not small_linear_int8_cpu.vnni_available():
        return None
    if len(int8) != 1:  # some int8, some not
        return None
    int8_rows = [] if int8 == {True} else None
    tensors, ptrs, shapes, rms = [], [], set(), set()
    for layer, lin in zip(layers, linears):
        sa, ca = layer.self_attn, layer.encoder_attn
        norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
        fc1, fc2 = lin[4:]
        mods = (norms[0], sa.qkv_proj, sa.out_proj, norms[1], ca.q_proj, ca.out_proj, norms[2], fc1, fc2)
        rms.update(not isinstance(n, torch.nn.LayerNorm) for n in norms)
        plain = [t for m in mods for t in ((m.bias,) if int8_rows is not None and m in lin
                                           else (m.weight, getattr(m, "bias", None))) if t is not None]
        if not (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in plain)
                and sa.scale == ca.scale and sa.num_heads == ca.num_heads and len({n.eps for n in norms}) == 1
                and len(rms) == 1 and sa.qkv_proj.out_features == 3 * fc2.out_features == 3 * ca.q_proj.out_features):
            return None
        row = []
        for m in mods:
            if m in norms:
                w = m.weight
            elif int8_rows is not None:
                w = None  # the C step reads the int8 panels (int8_table) instead
            else:
                w = m.panel_weight()  # shared with op by op
            b = getattr(m, "bias", None)  # None: T5's (no biases; RMSNorm)
            tensors += [t for t in (w, b) if t is not None]
            row += [0 if w is None else w.data_ptr(), 0 if b is None else b.data_ptr()]
        ptrs.append(row)
        if int8_rows is not None:
            packed = [m.int8_panel_weight() for m in lin]
            tensors += [t for pk in packed for t in (pk.wq, pk.ws, pk.comp)]
            int8_rows.append([a for pk in packed for a in pk.ptrs()])
        shapes.add((fc2.out_features, sa.num_heads, fc1.out_features, norms[0].eps, sa.scale))
    if len(shapes) != 1 or (post_norm and rms == {True}):
        return None
    d, heads, ffn, eps, scale = shapes.pop()
    table = None if int8_rows is None else torch.tensor(int8_rows, dtype=torch.int64)
    return DecoderWeights(d, heads, ffn, eps, scale, activation, tensors, ptrs, table, rms.pop(), post_norm)


def _ffn(layer) -> tuple | None:
    """A layer's two FFN matmuls (fc1, fc2; T5's wi, wo), or None for a gated FFN (T5 v1.1)."""
    if hasattr(layer, "fc1"):
        return layer.fc1, layer.fc2
    ffn = layer.ffn
    return None if ffn.gated else (ffn.wi, ffn.wo)


def decoder_linears(layer) -> tuple | None:
    """A layer's six matmuls, in the C qlayer_t order; None for a layer the step
    cannot run (a gated FFN). Also what ``quantization`` keeps float32 without VNNI."""
    sa, ca, ffn = layer.self_attn, layer.encoder_attn, _ffn(layer)
    return None if ffn is None else (sa.qkv_proj, sa.out_proj, ca.q_proj, ca.out_proj, *ffn)


def decode_step(h: torch.Tensor, weights: DecoderWeights, kv_caches: list[torch.Tensor],
                slots: torch.Tensor, self_tables: torch.Tensor, self_lens: torch.Tensor,
                cross_tables: torch.Tensor, cross_lens: torch.Tensor, *, isa: str | None = None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run every layer of ``weights`` (with its cache in ``kv_caches``) on ``h``
    (M, d), in place, for M decode rows: the new K/V go to ``slots`` (int64) of
    each cache (2, blocks, block_size, H, D; float32, or bfloat16: written
    rounded as torch rounds, read widened); self and cross tables (int32,
    row-major) and lengths (int32), one per row, are the attention metadata's
    ``decode_rows``: every row's K/V are written before any row attends, so a
    sequence's 1 + k rows of a speculative step (its newest positions, self
    length = position + 1) attend causally, each exactly as a one-row step
    at its length would; ``position_bias``
    (T5): self-attention's (H, >= longest self length) float32 distance table
    (``bias_tables.distance_table``). Returns ``h``;
    None, having done nothing, where the step does not qualify: no build for
    ``isa``, more than ``MAX_ROWS`` rows, a cache or metadata tensor of another
    layout."""
    m = h.shape[0]
    index = (slots, self_tables, self_lens, cross_tables, cross_lens)
    if not (0 < m <= MAX_ROWS and h.is_contiguous() and len(kv_caches) == len(weights.weight_ptrs)
            and _index_ok(m, *index) and _caches_ok(kv_caches, weights.num_heads)
            and (position_bias is None or (position_bias.dtype == torch.float32 and position_bias.is_contiguous()
                                           and position_bias.shape[0] == weights.num_heads
                                           and position_bias.shape[1] >= int(self_lens.max())))):
        return None
    kernel = _KERNEL.function(isa)
    if kernel is None:
        return None
    w, threads = weights, bandwidth_threads()
    work = torch.empty(m * (6 * w.d + w.ffn), dtype=torch.float32)
    table = w.table(kv_caches)
    rc = kernel(
        h.data_ptr(), work.data_ptr(), m, w.d, w.num_heads, w.ffn, w.eps, w.scale, table.data_ptr(),
        table.shape[0], kv_caches[0].shape[2], slots.data_ptr(), self_tables.data_ptr(), self_tables.stride(0),
        self_lens.data_ptr(), cross_tables.data_ptr(), cross_tables.stride(0), cross_lens.data_ptr(), threads,
        ACTIVATIONS[w.activation], None if w.int8_table is None else w.int8_table.data_ptr(), int(w.rms_norm),
        None if position_bias is None else position_bias.data_ptr(),
        0 if position_bias is None else position_bias.shape[1], int(kv_caches[0].dtype == torch.bfloat16),
        int(w.post_norm))
    if rc != 0:
        raise MemoryError("decoder step kernel could not allocate its scratch")
    return h


def _caches_ok(kv_caches: list[torch.Tensor], num_heads: int) -> bool:
    """(2, blocks, block_size, H, D) each, of one dtype the kernel reads (float32 or bfloat16)."""
    return (paged_attention_cpu.cache_ok(*kv_caches)
            and all(c.dim() == 5 and c.shape[0] == 2 and c.shape[3] == num_heads for c in kv_caches))


def _index_ok(num_rows: int, slots: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Slots int64; tables and lengths int32, all contiguous on CPU, one entry per
    row each: a step verifying drafts (several query rows per sequence) passes
    its tables and lengths per row (``AttentionMetadata.decode_rows``), and
    per-sequence ones beside more rows are declined, never read past."""
    return (slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == num_rows
            and all(t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()
                    and t.shape[0] == num_rows for t in rest))
