"""The C paged decode kernel against the torch gather path it replaces."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, paged_attention_cpu

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler here")


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@pytest.mark.parametrize("block_size, heads, kv_heads, D", [(16, 4, 4, 64), (5, 6, 2, 64), (16, 6, 6, 64),
                                                         (16, 2, 2, 40)])  # 40: not a multiple of the lanes
def test_kernel_matches_reference(block_size, heads, kv_heads, D, isa, monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert build.cpu_isa() == isa
    assert paged_attention_cpu.path(isa) == isa  # the build runs its ISA's lanes (or plain C for "none")
    g = torch.Generator().manual_seed(0)
    B, num_blocks = 7, 1000
    cache = torch.randn(2, num_blocks, block_size, kv_heads, D, generator=g)
    lens = torch.randint(1, 400, (B,), generator=g, dtype=torch.int32)
    width = (int(lens.max()) + block_size - 1) // block_size
    tables = torch.randperm(num_blocks, generator=g)[: B * width].view(B, width).to(torch.int32)
    q = torch.randn(B, heads, D, generator=g)
    out = paged_attention_cpu.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125)
    flat = cache.view(2, -1, kv_heads, D)
    for i in range(B):
        pos = torch.arange(int(lens[i]))
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = flat[0][slots].repeat_interleave(heads // kv_heads, dim=1)  # (L, H, D)
        v = flat[1][slots].repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k) * 0.125, -1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhd->hd", p, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_torch_fallback_matches_kernel(tiny_bart, monkeypatch, kv_cache_dtype):
    """Greedy outputs are the same with the C kernels (paged decode, dense
    prefill) and with the torch paths they replace; with a bfloat16 cache under
    float32 weights too (the torch paths widen what they gather)."""
    from encdec import LLM, SamplingParams
    from encdec.attention.backends import torch_sdpa

    prompts = ["The rain in spain falls", "A quick brown fox " * 12, "x"]  # one prompt of 32+ tokens
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01, kv_cache_dtype=kv_cache_dtype)
    caches = llm.llm_engine.worker.cache_engine.gpu_cache
    assert {c.dtype for c in caches} == {torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32}
    fast = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(paged_attention_cpu, "available", lambda: False)
    monkeypatch.setattr(torch_sdpa, "dense_attention", lambda *a: None)
    slow = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


def test_a_kernel_is_keyed_by_what_its_includes_include():
    """decoder_step_cpu.c includes paged_attention_cpu.c, which includes
    vector_math.h: a change to the header must rebuild the step kernel too."""
    import os

    folder = os.path.dirname(build.__file__)
    with open(os.path.join(folder, "decoder_step_cpu.c"), "rb") as f:
        texts = build._local_includes(f.read())
    with open(os.path.join(folder, "vector_math.h"), "rb") as f:
        assert f.read() in texts


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("D", [64, 40])  # 40: lanes and a scalar tail
def test_bfloat16_cache_reads_as_its_float32_values(D, isa, monkeypatch):
    """kv_cache_dtype="bfloat16" under float32 weights: the kernel widens each
    cached value exactly, so a bfloat16 cache attends as the float32 cache of the
    same (rounded) values does, and a wrong reading (raw halves, a float32 stride)
    would be far off; caches of two dtypes, or of float16, are declined."""
    monkeypatch.setenv(build.ISA_ENV, isa)
    g = torch.Generator().manual_seed(1)
    B, num_blocks, block_size, heads = 5, 200, 16, 3
    cache = torch.randn(2, num_blocks, block_size, heads, D, generator=g).bfloat16()
    lens = torch.tensor([1, 15, 16, 17, 448], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[: B * 28].view(B, 28).to(torch.int32)
    q = torch.randn(B, heads, D, generator=g)
    out = paged_attention_cpu.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125, isa=isa)
    wide = cache.float()
    same = paged_attention_cpu.paged_decode_attention(q, wide[0], wide[1], tables, lens, 0.125, isa=isa)
    torch.testing.assert_close(out, same, atol=2e-7, rtol=0)  # the lanes' FMA order may differ in a tail
    flat = wide.double().view(2, -1, heads, D)
    for i in range(B):
        pos = torch.arange(int(lens[i]))
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), flat[0][slots]) * 0.125, -1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hl,lhd->hd", p, flat[1][slots]),
                                   atol=1e-5, rtol=1e-5)
    assert paged_attention_cpu.paged_decode_attention(q, cache[0], wide[1], tables, lens, 0.125, isa=isa) is None
    half = cache.half()
    assert paged_attention_cpu.paged_decode_attention(q, half[0], half[1], tables, lens, 0.125, isa=isa) is None


@pytest.mark.parametrize("isa", build.host_isas())
def test_bfloat16_cache_write_equals_torchs(isa, monkeypatch):
    """The one-pass write to a bfloat16 cache (``write_bf16``; prefill K/V, a
    strided view of a fused projection) leaves the cache bit for bit as torch's
    ``write_to_cache`` does (ties to even, infinities, NaN, the largest finite
    value, subnormals) and returns the same widened values; other dtypes are declined."""
    from encdec.attention.backends import torch_sdpa
    from encdec.attention.backends.abstract import write_to_cache

    monkeypatch.setenv(build.ISA_ENV, isa)
    g = torch.Generator().manual_seed(2)
    n = 300
    fused = torch.randn(n, 3, 4, 64, generator=g) * 3  # q, k, v of each row side by side
    fused[7, 1, 0, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3895e38, 1.0000001,
                                       2.0 ** -130, 1 + 2.0 ** -8])  # 1 + 2^-8: a tie, to even (1.0)
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(40 * 16, generator=g)[:n]
    ours, theirs = (torch.zeros(2, 40, 16, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    got = torch_sdpa._write_cache(k, v, ours, slots)
    want = write_to_cache(k, v, theirs, slots)
    assert paged_attention_cpu.write_bf16(k, ours[0], slots) is not None  # the kernel ran
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    assert ours.view(2, -1, 4, 64)[0][slots[7], 0, 6].item() == 1.0
    assert paged_attention_cpu.write_bf16(k, ours[0].half(), slots) is None
    assert paged_attention_cpu.write_bf16(k.double(), ours[0], slots) is None
