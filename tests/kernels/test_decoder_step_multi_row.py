"""The fused C decode step (``decoder_step_cpu``) with several query rows per
sequence (speculative decoding's verification: 1 + k rows, its newest
positions, causal among themselves), per ISA build in the ids, for BART's
post-norm layers and Whisper's pre-norm ones: it matches the same layers run op
by op through torch_sdpa with the same metadata, and matches running the rows
one by one as one-row steps; per-sequence tables beside more rows are declined
(the explicit fallback: the model then runs its layers op by op)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from encdec.testing import jitter_layer_norms
from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.kernels.cpu import build, decoder_step_cpu

pytestmark = pytest.mark.skipif(not decoder_step_cpu.available(), reason="no C compiler here")

D_MODEL, HEADS, FFN, BS, ENC, BLOCKS = 64, 4, 128, 16, 23, 64


def _layers(family: str, n: int = 2):
    torch.manual_seed(0)
    cfg = SimpleNamespace(d_model=D_MODEL, decoder_attention_heads=HEADS, decoder_ffn_dim=FFN,
                          activation_function="gelu")
    if family == "bart":
        from encdec.models.bart import BartDecoderLayer
        layers = [BartDecoderLayer(cfg, TorchSDPABackend) for _ in range(n)]
    else:
        from encdec.models.whisper import WhisperDecoderLayer
        layers = [WhisperDecoderLayer(cfg, TorchSDPABackend) for _ in range(n)]
    jitter_layer_norms(layers)
    return layers


def _metadata(seq_lens: list[int], q_lens: list[int] | None, tables: list[list[int]],
              cross: list[list[int]]):
    q = q_lens or [1] * len(seq_lens)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    slots = [tables[i][p // BS] * BS + p % BS for i, (s, n) in enumerate(zip(seq_lens, q)) for p in range(s - n, s)]
    width, cwidth = max(map(len, tables)), max(map(len, cross))
    return TorchSDPABackend.make_metadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=sum(q),
        slot_mapping=torch.tensor(slots, dtype=torch.long), seq_lens=seq_lens, seq_lens_tensor=i32(seq_lens),
        max_prefill_seq_len=0, max_decode_seq_len=max(seq_lens), max_query_len=1, query_start_loc=i32([0]),
        seq_start_loc=i32([0]), context_lens_tensor=i32([s - n for s, n in zip(seq_lens, q)]),
        block_tables=i32([t + [0] * (width - len(t)) for t in tables]),
        encoder_seq_lens=[ENC] * len(seq_lens), encoder_seq_lens_tensor=i32([ENC] * len(seq_lens)),
        encoder_seq_start_loc=i32([0]), max_encoder_seq_len=ENC, num_encoder_tokens=0,
        cross_slot_mapping=torch.zeros(0, dtype=torch.long),
        cross_block_tables=i32([t + [0] * (cwidth - len(t)) for t in cross]), block_size=BS,
        block_tables_list=tables, cross_block_tables_list=cross, decode_query_lens=q_lens)


class Case:
    """Three sequences: a one-row decode, one verifying 3 drafts across a block
    boundary (positions 14..17), one verifying 5 (or 18: more rows than one
    pass over a cross table takes, GROUP_MAX); caches hold random history."""

    seq_lens = [5, BS + 2, 30]

    def __init__(self, num_layers: int = 2, last_rows: int = 6):
        self.q_lens = [1, 4, last_rows]
        g = torch.Generator().manual_seed(3)
        perm = torch.randperm(BLOCKS, generator=g).tolist()
        self.tables = [[perm.pop() for _ in range(-(-s // BS))] for s in self.seq_lens]
        self.cross = [[perm.pop() for _ in range(-(-ENC // BS))] for _ in self.seq_lens]
        self.caches = [torch.randn(2, BLOCKS, BS, HEADS, D_MODEL // HEADS, generator=g) * 0.5
                       for _ in range(num_layers)]
        self.h = torch.randn(sum(self.q_lens), D_MODEL, generator=g)
        self.md = _metadata(self.seq_lens, self.q_lens, self.tables, self.cross)

    def fused(self, weights, h: torch.Tensor, caches, md, isa: str, *, per_row: bool = True):
        rows = md.decode_rows
        index = ((rows.self_tables, rows.self_lens, rows.cross_tables, rows.cross_lens) if per_row else
                 (md.block_tables, md.seq_lens_tensor, md.cross_block_tables, md.encoder_seq_lens_tensor))
        return decoder_step_cpu.decode_step(h, weights, caches, md.slot_mapping, *index, isa=isa)


@pytest.mark.parametrize("last_rows", [6, 19], ids=["6-rows", "19-rows"])
@pytest.mark.parametrize("family", ["bart", "whisper"])
@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@torch.inference_mode()
def test_multi_row_step_matches_op_by_op_and_one_row_steps(family, isa, last_rows, monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert decoder_step_cpu.path(isa) == isa
    layers = _layers(family)
    weights = decoder_step_cpu.decoder_weights(layers, post_norm=family == "bart")
    assert weights is not None
    case = Case(len(layers), last_rows)

    caches = [c.clone() for c in case.caches]
    h = case.h.clone()
    assert case.fused(weights, h, caches, case.md, isa) is h

    by_op, op_caches = case.h.clone(), [c.clone() for c in case.caches]
    for layer, cache in zip(layers, op_caches):
        by_op = layer(by_op, cache, case.md, None)
    torch.testing.assert_close(h, by_op, atol=1e-4, rtol=1e-4)
    for a, b in zip(caches, op_caches):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    # Row by row: each row a one-row step of its sequence at its position, in order.
    one_caches = [c.clone() for c in case.caches]
    row = 0
    for i, (s, q) in enumerate(zip(case.seq_lens, case.q_lens)):
        for j in range(q):
            md = _metadata([s - q + 1 + j], None, [case.tables[i]], [case.cross[i]])
            one = case.h[row:row + 1].clone()
            assert case.fused(weights, one, one_caches, md, isa) is one
            # Equal bits on the avx2 and portable builds; the avx512 matmuls block rows by
            # the step's row count, so a row's sums may round differently (as between
            # one-row steps of different batch sizes without speculation).
            torch.testing.assert_close(one[0], h[row], atol=1e-5, rtol=1e-5)
            row += 1
    for a, b in zip(caches, one_caches):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", build.host_isas())
@torch.inference_mode()
def test_per_sequence_tables_beside_more_rows_are_declined(isa):
    """The fallback made explicit: tables and lengths per sequence with more rows
    than sequences (a caller that forgot ``decode_rows``) are declined, nothing
    written, so the model runs op by op; never read past the tables."""
    layers = _layers("bart")
    weights = decoder_step_cpu.decoder_weights(layers, post_norm=True)
    case = Case(len(layers))
    h, caches = case.h.clone(), [c.clone() for c in case.caches]
    assert case.fused(weights, h, caches, case.md, isa, per_row=False) is None
    assert torch.equal(h, case.h) and all(torch.equal(a, b) for a, b in zip(caches, case.caches))
