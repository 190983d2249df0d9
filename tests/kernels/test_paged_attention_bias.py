"""T5's relative position bias in the C paged decode kernel (causal decoder
self-attention), per ISA, against a float64 reference; and the backend's
hand-off: self-attention decode passes the bias, cross-attention never does."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, paged_attention_cpu
from encdec.models.t5 import RelativePositionBias

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler here")


def _t5_bias(heads: int, seed: int) -> RelativePositionBias:
    """T5's decoder bias: 32 causal buckets, the last one from 128 positions on."""
    table = torch.randn(32, heads, generator=torch.Generator().manual_seed(seed))
    return RelativePositionBias(table, bidirectional=False, max_distance=128)


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@pytest.mark.parametrize("block_size, heads, kv_heads, D", [(16, 4, 4, 64), (5, 6, 2, 64), (16, 2, 2, 40)])
def test_biased_kernel_matches_float64_reference(block_size, heads, kv_heads, D, isa, monkeypatch):
    """Rows of 1..300 tokens (queries and keys past the largest bucket, 128),
    keys in shuffled blocks; scale 1 as T5's and 0.125."""
    from encdec.attention.bias_tables import distance_table

    monkeypatch.setenv(build.ISA_ENV, isa)
    assert paged_attention_cpu.path(isa) == isa
    g = torch.Generator().manual_seed(1)
    num_blocks = 1000
    cache = torch.randn(2, num_blocks, block_size, kv_heads, D, generator=g) * 0.3
    lens = torch.tensor([1, 2, 9, 17, 129, 200, 257, 300], dtype=torch.int32)
    B = len(lens)
    width = (int(lens.max()) + block_size - 1) // block_size
    tables = torch.randperm(num_blocks, generator=g)[: B * width].view(B, width).to(torch.int32)
    q = torch.randn(B, heads, D, generator=g) * 0.3
    pb = _t5_bias(heads, seed=2)
    table = distance_table(pb, int(lens.max()))  # (H, 300)
    flat = cache.view(2, -1, kv_heads, D).double()
    for scale in (1.0, 0.125):
        out = paged_attention_cpu.paged_decode_attention(q, cache[0], cache[1], tables, lens, scale,
                                                         position_bias=table)
        plain = paged_attention_cpu.paged_decode_attention(q, cache[0], cache[1], tables, lens, scale)
        for i in range(B):
            n = int(lens[i])
            pos = torch.arange(n)
            slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
            k = flat[0][slots].repeat_interleave(heads // kv_heads, dim=1)  # (L, H, D)
            v = flat[1][slots].repeat_interleave(heads // kv_heads, dim=1)
            # The bias straight from T5's buckets at (query n - 1, keys 0..n-1), in float64.
            bias = pb.compute(torch.tensor([n - 1]), pos)[:, 0].double()  # (H, L)
            scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
            expect = torch.einsum("hl,lhd->hd", torch.softmax(scores + bias, -1), v)
            torch.testing.assert_close(out[i].double(), expect, atol=2e-5, rtol=1e-5)
            if n > 1:  # the bias changes the result (it is not ignored)
                assert (out[i] - plain[i]).abs().max() > 1e-3


def test_a_table_narrower_than_a_row_is_refused():
    q = torch.zeros(2, 2, 8)
    cache = torch.zeros(4, 16, 2, 8)
    tables = torch.arange(4, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not cover"):
        paged_attention_cpu.paged_decode_attention(q, cache, cache, tables, lens, 1.0,
                                                   position_bias=torch.zeros(2, 19))


def test_backend_passes_the_bias_to_self_decode_only(monkeypatch):
    """Through ``TorchSDPAImpl.forward`` at decode: self-attention hands the
    kernel the distance table (and equals the torch gather path with the bias as
    a mask); cross-attention hands it none."""
    from encdec.attention.backends import torch_sdpa
    from encdec.attention.backends.abstract import AttentionType

    H, D, bs = 4, 16, 16
    g = torch.Generator().manual_seed(3)
    lens = [140, 7, 260]
    enc_lens = [30, 150, 5]
    B = len(lens)
    cache = torch.randn(2, 2 * 3 * 17, bs, H, D, generator=g)  # self blocks, then cross blocks
    self_tables = torch.arange(B * 17, dtype=torch.int32).view(B, 17)
    cross_tables = torch.arange(B * 17, 2 * B * 17, dtype=torch.int32).view(B, 17)[:, :10].contiguous()
    md = torch_sdpa.TorchSDPAMetadata(**_decode_metadata_fields(lens, enc_lens, self_tables,
                                                                cross_tables, bs))
    q = torch.randn(B, H * D, generator=g)
    pb = _t5_bias(H, seed=4)
    calls = []
    real = paged_attention_cpu.paged_decode_attention

    def spy(*args, position_bias=None, **kw):
        calls.append(position_bias)
        return real(*args, position_bias=position_bias, **kw)

    monkeypatch.setattr(paged_attention_cpu, "paged_decode_attention", spy)
    impl = torch_sdpa.TorchSDPAImpl(H, D, 1.0)
    k = torch.randn(B, H * D, generator=g)
    out = impl.forward(q, k, k.clone(), cache, md, AttentionType.DECODER, position_bias=pb)
    assert len(calls) == 1 and calls[0] is not None
    cross = impl.forward(q, None, None, cache, md, AttentionType.ENCODER_DECODER)
    assert len(calls) == 2 and calls[1] is None  # cross-attention carries no bias
    assert cross.shape == out.shape

    # The torch gather path (kernel off) with the bias as SDPA's mask: the same.
    md2 = torch_sdpa.TorchSDPAMetadata(**_decode_metadata_fields(lens, enc_lens, self_tables,
                                                                 cross_tables, bs))
    monkeypatch.setattr(paged_attention_cpu, "available", lambda: False)
    ref = impl.forward(q, k, k.clone(), cache, md2, AttentionType.DECODER, position_bias=_t5_bias(H, seed=4))
    assert len(calls) == 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _decode_metadata_fields(lens, enc_lens, self_tables, cross_tables, block_size) -> dict:
    """A decode-only step's metadata fields, as the model runner fills them."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    zero = i32([0])
    slots = [int(self_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for i, n in enumerate(lens)]
    return dict(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=len(lens),
        slot_mapping=torch.tensor(slots, dtype=torch.long), seq_lens=list(lens), seq_lens_tensor=i32(lens),
        max_prefill_seq_len=0, max_decode_seq_len=max(lens), max_query_len=1, query_start_loc=zero,
        seq_start_loc=zero, context_lens_tensor=i32([n - 1 for n in lens]), block_tables=self_tables,
        encoder_seq_lens=list(enc_lens), encoder_seq_lens_tensor=i32(enc_lens), encoder_seq_start_loc=zero,
        max_encoder_seq_len=max(enc_lens), num_encoder_tokens=0, cross_slot_mapping=torch.zeros(0, dtype=torch.long),
        cross_block_tables=cross_tables, block_size=block_size, block_tables_list=self_tables.tolist(),
        cross_block_tables_list=cross_tables.tolist())


@pytest.mark.parametrize("n", [31, 32, 200])  # below the dense kernel's minimum: torch's SDPA with the matrix
def test_encoder_bias_by_offset_equals_the_bias_matrix(n, monkeypatch):
    """T5's bidirectional encoder bias, read by offset in the C dense kernel
    (``offset_table``), equals torch's SDPA given ``prefill``'s (H, n, n) matrix
    (queries and keys past the largest bucket at 200); the dense kernel takes
    every call of 32 queries or more."""
    from encdec.attention import bias_tables
    from encdec.attention.backends import torch_sdpa
    from encdec.kernels.cpu import dense_attention_cpu

    if not dense_attention_cpu.available():
        pytest.skip("no vector ISA for the dense kernel here")
    table = torch.randn(32, 6, generator=torch.Generator().manual_seed(5))
    pb = RelativePositionBias(table, bidirectional=True, max_distance=128)
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, 6, 64, generator=g) for _ in range(3))
    calls = []
    real = torch_sdpa.dense_attention
    monkeypatch.setattr(torch_sdpa, "dense_attention",
                        lambda *a, **kw: calls.append(kw.get("offset_bias") is not None) or real(*a, **kw))
    out = torch_sdpa._encoder_sdpa(q, k, v, 1.0, pb)
    assert calls == ([True] if n >= 32 else [])
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.double().transpose(0, 1) for x in (q, k, v)), attn_mask=pb.prefill(n).double(), scale=1.0)
    torch.testing.assert_close(out.double(), ref.transpose(0, 1), atol=2e-5, rtol=1e-5)
    offsets = bias_tables.offset_table(pb, n)
    i = torch.arange(n)
    assert torch.equal(offsets[:, i[None, :] - i[:, None] + n - 1], pb.prefill(n))  # the same bias, by offset
