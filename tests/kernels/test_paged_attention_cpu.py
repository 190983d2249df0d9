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


def test_torch_fallback_matches_kernel(tiny_bart, monkeypatch):
    """Greedy outputs are the same with the C kernels (paged decode, dense
    prefill) and with the torch paths they replace."""
    from encdec import LLM, SamplingParams
    from encdec.attention.backends import torch_sdpa

    prompts = ["The rain in spain falls", "A quick brown fox " * 12, "x"]  # one prompt of 32+ tokens
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01)
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
