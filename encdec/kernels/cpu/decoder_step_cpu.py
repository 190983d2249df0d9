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

import numpy as np
import torch

from encdec.kernels.cpu import build, paged_attention_cpu, small_linear_cpu, small_linear_int8_cpu
from encdec.kernels.cpu.cross_i8 import fits as cross_i8_fits
from encdec.kernels.cpu.small_linear_int4 import PackedInt4
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


# -- a draft model's whole greedy step (draft_step.h) -----------------------------
_DRAFT = build.Kernel("decoder_step_cpu.c", "draft_step_f32", [_P, _I64], ctypes.c_int,
                      "a draft's steps run the model's forward", path_symbol="decoder_step_path")


class _DraftArgs(ctypes.Structure):
    """draft_step.h's ``draft_t``, field for field."""
    _fields_ = [(n, _I64) for n in ("d", "H", "ffn", "num_layers", "block_size")] + [
        ("eps", _F), ("scale", _F), ("layers", _P), ("qlayers", _P), ("ffn_post", ctypes.c_int),
        ("kv_bf16", ctypes.c_int), ("num_threads", ctypes.c_int), ("cross_i8", ctypes.c_int), ("tok_embed", _P),
        ("pos_embed", _P),
        ("norm_w", _P), ("norm_b", _P), ("norm_eps", _F), ("head_w", _P), ("head_q", _P), ("head_b", _P),
        ("N", _I64), ("ids", _P), ("banned", _P), ("n_banned", _I64), ("tokens", _P), ("positions", _P),
        ("slots", _P), ("self_tables", _P), ("self_stride", _I64), ("self_lens", _P), ("cross_tables", _P),
        ("cross_stride", _I64), ("cross_lens", _P), ("h", _P), ("work", _P), ("logits", _P), ("out", _P),
        ("head_q4", _P), ("head_rows", _P)]


@dataclass
class DraftHeadWeights:
    """A draft's LM head as its step runs it: float32 panels
    (``small_linear_cpu.pack``) beside float32 layers, int8 ones
    (``small_linear_int8_cpu.PackedInt8``) beside int8 layers; with ``packed4``
    (an int8 head's int4 copy) the two-stage head (draft_head4.h): an int4
    pass over every column, its best candidates scored exactly in int8."""
    n: int  # its columns
    panels: torch.Tensor | None = None
    packed: small_linear_int8_cpu.PackedInt8 | None = None
    packed4: PackedInt4 | None = None
    rows8: torch.Tensor | None = None  # with packed4: the int8 weight (n, d) row-major (its candidates' scores)
    bias: torch.Tensor | None = None  # (n,) float32
    ids: torch.Tensor | None = None  # (n,) int64: column -> token id (a reduced head), None: the column is the id


class DraftSteps:
    """A draft model's greedy decode steps of one token a row, one C call a
    step (draft_step.h: the embedding ``tok_embed[t] + pos_embed[p]``, the
    decoder layers of ``weights``, the final LayerNorm ``norm``, ``head`` and
    the argmax). ``start`` takes a proposal's rows; ``step`` gives each row's
    token and advances the rows in place (that token their next input, one
    position further); ``keep`` drops rows. Every index the C call reads is
    checked in ``start``, for as many steps as it allows."""

    def __init__(self, weights: DecoderWeights, tok_embed: torch.Tensor, pos_embed: torch.Tensor,
                 norm: torch.nn.LayerNorm, head: DraftHeadWeights):
        if not self.fits(weights, tok_embed, pos_embed, norm, head):
            raise ValueError("DraftSteps: the kernel does not run these weights (DraftSteps.fits)")
        self.weights, self.head = weights, head
        self._keep = [tok_embed, pos_embed, norm.weight, norm.bias]  # held: the struct holds their addresses
        a = self._base = _DraftArgs()
        a.d, a.H, a.ffn, a.num_layers = weights.d, weights.num_heads, weights.ffn, len(weights.weight_ptrs)
        a.eps, a.scale, a.ffn_post, a.norm_eps = weights.eps, weights.scale, ACTIVATIONS[weights.activation], norm.eps
        a.qlayers = None if weights.int8_table is None else weights.int8_table.data_ptr()
        a.tok_embed, a.pos_embed = tok_embed.data_ptr(), pos_embed.data_ptr()
        a.norm_w, a.norm_b = norm.weight.data_ptr(), norm.bias.data_ptr()
        a.N, a.head_b = head.n, None if head.bias is None else head.bias.data_ptr()
        a.ids = None if head.ids is None else head.ids.data_ptr()
        if head.packed is not None:
            self._head_q = (_P * 3)(*head.packed.ptrs())
            a.head_q = ctypes.addressof(self._head_q)
        else:
            a.head_w = head.panels.data_ptr()
        if head.packed4 is not None:
            self._head_q4 = (_P * 2)(*head.packed4.ptrs())
            a.head_q4, a.head_rows = ctypes.addressof(self._head_q4), head.rows8.data_ptr()
        self._vocab, self._positions = tok_embed.shape[0], pos_embed.shape[0]
        self._args, self._m = None, 0

    @staticmethod
    def fits(weights: DecoderWeights | None, tok_embed: torch.Tensor, pos_embed: torch.Tensor,
             norm: torch.nn.LayerNorm, head: DraftHeadWeights) -> bool:
        """Whether the kernel runs these: fused layers (pre-norm LayerNorm ones),
        float32 contiguous CPU embeddings and norm of their width, a head of the
        layers' kind (int8 with int8 layers) and width, and a build here."""
        if weights is None or weights.rms_norm or weights.post_norm or not _DRAFT.available():
            return False
        extra = [t for t in (head.bias, head.panels) if t is not None]
        plain = [tok_embed, pos_embed, norm.weight, norm.bias, *extra]
        return (all(t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                    for t in plain)
                and tok_embed.dim() == pos_embed.dim() == 2 and tok_embed.shape[1] == pos_embed.shape[1] == weights.d
                and tuple(norm.weight.shape) == (weights.d,)
                and (head.packed is not None) == (weights.int8_table is not None)
                and (head.packed is None or (head.packed.k == weights.d and head.packed.n == head.n))
                and (head.packed4 is None or (head.packed is not None and head.packed4.k == weights.d
                                              and head.packed4.n == head.n and head.rows8 is not None
                                              and head.rows8.dtype == torch.int8 and head.rows8.is_contiguous()
                                              and tuple(head.rows8.shape) == (head.n, weights.d)))
                and (head.packed is not None
                     or (head.panels is not None
                         and tuple(head.panels.shape[1:]) == (weights.d, small_linear_cpu.PANEL)
                         and head.panels.shape[0] * small_linear_cpu.PANEL >= head.n))
                and (head.bias is None or tuple(head.bias.shape) == (head.n,))
                and (head.ids is None or (head.ids.dtype == torch.int64 and tuple(head.ids.shape) == (head.n,)
                                          and 0 <= int(head.ids.min()) and int(head.ids.max()) < tok_embed.shape[0]))
                and head.n <= tok_embed.shape[0])

    def start(self, kv_caches: list[torch.Tensor], tokens: list[int], positions: list[int],
              self_tables: list[list[int]], cross_tables: list[list[int]], cross_lens: list[int],
              banned: list[int], steps: list[int], *, cross_i8: bool = False, isa: str | None = None) -> bool:
        """Take a proposal's rows (each's input token, at its position, its
        self and cross tables in ``kv_caches``, encoder length and the most
        steps it runs), ``banned`` head columns never chosen; ``cross_i8``: the
        cross blocks hold int8 records (``cross_i8.write_blocks``); False, nothing
        taken, where the kernel cannot run them: no build for ``isa``, more
        than ``MAX_ROWS`` rows, caches of another layout, an index out of range
        (a position past its tables or the embedding within its steps)."""
        m, w = len(tokens), self.weights
        kernel = _DRAFT.function(isa)
        if not (kernel is not None and 0 < m <= MAX_ROWS and len(kv_caches) == len(w.weight_ptrs)
                and _caches_ok(kv_caches, w.num_heads) and (not cross_i8 or cross_i8_fits(kv_caches[0]))):
            return False
        bs, blocks = kv_caches[0].shape[2], kv_caches[0].shape[1]
        last = [p + n - 1 for p, n in zip(positions, steps)]
        if not (len(positions) == len(self_tables) == len(cross_tables) == len(cross_lens) == len(steps) == m
                and 0 <= min(tokens) and max(tokens) < self._vocab and min(positions) >= 0 and min(steps) >= 1
                and max(last) < self._positions and all(p // bs < len(t) for p, t in zip(last, self_tables))
                and all(0 < n <= len(t) * bs for n, t in zip(cross_lens, cross_tables))
                and all(0 <= b < blocks for t in (*self_tables, *cross_tables) for b in t)
                and all(0 <= b < self.head.n for b in banned)):
            return False
        self._kernel, self._m, self._left = kernel, m, np.array(steps, np.int64)
        self._table = w.table(kv_caches)
        st, ct = _padded(self_tables), _padded(cross_tables)
        b = self._bufs = dict(
            tokens=np.array(tokens, np.int64), positions=np.array(positions, np.int64), slots=np.zeros(m, np.int64),
            self_tables=st, self_lens=np.zeros(m, np.int32), cross_tables=ct,
            cross_lens=np.array(cross_lens, np.int32),
            h=np.empty((m, w.d), np.float32), work=np.empty(m * (6 * w.d + w.ffn), np.float32),
            logits=np.empty((m, self.head.n), np.float32), out=np.zeros(m, np.int64),
            banned=np.array(banned, np.int64))
        a = self._args = _DraftArgs.from_buffer_copy(self._base)
        for name, arr in b.items():
            setattr(a, name, arr.ctypes.data)
        a.layers, a.block_size, a.kv_bf16 = self._table.data_ptr(), bs, int(kv_caches[0].dtype == torch.bfloat16)
        a.num_threads, a.n_banned, a.cross_i8 = bandwidth_threads(), len(banned), int(cross_i8)
        a.self_stride, a.cross_stride = st.shape[1], ct.shape[1]
        return True

    def step(self) -> list[int]:
        """Each row's greedy token; the rows then hold it as their input, one position further."""
        m = self._m
        if not m or self._left[:m].min() < 1:
            raise RuntimeError("DraftSteps.step: no rows started, or a row past the steps it was started for")
        if self._kernel(ctypes.byref(self._args), m) != 0:
            raise MemoryError("draft step kernel could not allocate its scratch")
        b, self._m_last = self._bufs, m
        self._left[:m] -= 1
        out = b["out"][:m]
        b["tokens"][:m] = out
        b["positions"][:m] += 1
        return out.tolist()

    def last_logits(self) -> np.ndarray:
        """The last step's logits of its rows (m, n), banned columns -inf (tests
        compare them); a two-stage head's are int4 scores but at its candidates."""
        return self._bufs["logits"][:self._m_last]

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` (indices among the live rows, ascending) step on; none: the proposal ends."""
        if rows and (rows[0] < 0 or rows[-1] >= self._m or any(x >= y for x, y in zip(rows, rows[1:]))):
            raise ValueError(f"DraftSteps.keep: rows must be ascending indices below {self._m}, got {rows}")
        idx, b = np.array(rows, np.int64), self._bufs
        for arr in (b["tokens"], b["positions"], b["self_tables"], b["cross_tables"], b["cross_lens"], self._left):
            arr[:len(rows)] = arr[idx]
        self._m = len(rows)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """(rows, longest) int32, rows zero-padded."""
    out = np.zeros((len(tables), max(map(len, tables))), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out
