"""The torch_native backend (the CUDA default) on CPU: flex_attention prefill in
eager mode, decode through the Triton paged kernel under ``TRITON_INTERPRET=1``
(path "triton-interpreter" in the ids) or its torch fallback where the kernel
declines (blocks of 5 keys: path "torch-fallback"). Checked against the naive
float64 reference and the torch_sdpa backend on the same steps; the masks and
groups ``make_metadata`` builds; the attention calls of a prefill and a decode
step counted through a real model; end to end against torch_sdpa."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

from encdec.attention import AttentionType  # noqa: E402
from encdec.attention.backends import packed_prefill as pp  # noqa: E402
from encdec.attention.backends import torch_native as tn  # noqa: E402
from encdec.attention.backends.torch_native import TorchNativeBackend, doc_block_mask, shared_table_groups  # noqa: E402
from encdec.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from encdec.kernels.triton import paged_attention as pa  # noqa: E402

from .conftest import BlockPool, SeqSpec, make_attn_metadata  # noqa: E402
from .test_backends import Sim, assert_matches_naive, edge_lens, random_lens  # noqa: E402

BACKENDS = (TorchNativeBackend, TorchSDPABackend)
PATHS = [pytest.param(16, id="triton-interpreter-bs16"), pytest.param(5, id="torch-fallback-bs5")]


def _path(block_size: int) -> None:
    want = "interpreter" if pa.runs_block_size(block_size) else "torch"
    assert pa.path("cpu") == "interpreter", "tests/conftest.py sets TRITON_INTERPRET=1 on CPU hosts"
    assert want == ("interpreter" if block_size == 16 else "torch")


@pytest.mark.parametrize("block_size", PATHS)
def test_mixed_steps_match_naive_and_torch_sdpa(block_size):
    _path(block_size)
    rng = random.Random(7)
    sim = Sim(block_size=block_size, heads=(6, 3), head_size=16, scattered=True, seed=7, backends=BACKENDS)
    lens = random_lens(rng, 3) + edge_lens(block_size)
    steps = [dict(new=lens), dict(new=random_lens(rng, 2), decode=[0, 1, 2]),
             dict(new=random_lens(rng, 1), decode=[4, 1, 3, 8]), dict(decode=range(len(lens) + 3))]
    for seed, kw in enumerate(steps):
        outs = sim.step(**kw, seed=seed)
        assert_matches_naive(outs)
        for t in outs["naive"]:
            a, b = outs["torch_native"][t], outs["torch_sdpa"][t]
            assert (a - b).abs().max().item() <= 2e-6 if a.numel() else True, t


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"])
def test_half_precision_matches_naive(dtype, tol):
    rng = random.Random(3)
    sim = Sim(block_size=16, heads=(4, 4), head_size=16, seed=3, backends=(TorchNativeBackend,), dtype=dtype)
    assert_matches_naive(sim.step(random_lens(rng, 3), seed=0), tol)
    assert_matches_naive(sim.step(decode=range(3), seed=1), tol)


def _fields(md) -> dict:
    return {f.name: getattr(md, f.name) for f in dataclasses.fields(md)
            if f.name in {g.name for g in dataclasses.fields(TorchSDPABackend.get_metadata_cls())}}


@pytest.mark.parametrize("block_size", PATHS)
def test_prefill_reading_a_cached_cross_table(block_size):
    """The encoder cache: a prefill whose cross table another request filled
    brings no encoder tokens; its cross-attention reads the cache (Triton
    launch over every prefill's table) and matches torch_sdpa's."""
    H, D, bs = 4, 16, block_size
    pool = BlockPool(256, scattered=True, rng=random.Random(0))
    first = SeqSpec(5, 23)
    first.grow(pool, bs)
    g = torch.Generator().manual_seed(0)
    caches = {b: torch.zeros(b.get_kv_cache_shape(256, bs, H, D)) for b in BACKENDS}
    xk, xv = torch.randn(23, H * D, generator=g), torch.randn(23, H * D, generator=g)
    for b in BACKENDS:  # request 0's prefill writes its cross table
        md = make_attn_metadata(b, prefills=[first], decodes=[], block_size=bs)
        impl = b.get_impl_cls()(H, D, D ** -0.5, H, AttentionType.ENCODER_DECODER)
        impl.forward(torch.randn(5, H * D, generator=g), xk, xv, caches[b], md)
    reuse, fresh = SeqSpec(3, 23), SeqSpec(4, 9)
    fresh.grow(pool, bs)
    reuse.cross_blocks = list(first.cross_blocks)
    reuse.grow(pool, bs)
    q = torch.randn(7, H * D, generator=g)
    fk, fv = torch.randn(9, H * D, generator=g), torch.randn(9, H * D, generator=g)
    outs = {}
    for b in BACKENDS:
        base = _fields(make_attn_metadata(b, prefills=[reuse, fresh], decodes=[], block_size=bs))
        base.update(num_encoder_tokens=9, encoder_seq_start_loc=torch.tensor([0, 0, 9], dtype=torch.int32),
                    cross_slot_mapping=base["cross_slot_mapping"][23:], prefill_cross_cached=[True, False])
        md = b.make_metadata(**base)
        impl = b.get_impl_cls()(H, D, D ** -0.5, H, AttentionType.ENCODER_DECODER)
        outs[b] = impl.forward(q, fk, fv, caches[b], md)
    assert (outs[TorchNativeBackend] - outs[TorchSDPABackend]).abs().max().item() < 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["block-diagonal", "block-diagonal-causal"])
def test_block_mask_covers_exactly_the_sequences(causal):
    """Built from sequence boundaries: every (query, key) pair of a sequence lies
    in a listed tile, and a query tile lists only its sequences' key tiles."""
    rng = random.Random(1)
    q_lens = [rng.randint(1, 300) for _ in range(9)]
    kv_lens = q_lens if causal else [rng.randint(1, 300) for _ in range(9)]
    bm = doc_block_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
    Q, KV = sum(q_lens), sum(kv_lens)
    q_doc = torch.repeat_interleave(torch.arange(9), torch.tensor(q_lens))
    kv_doc = torch.repeat_interleave(torch.arange(9), torch.tensor(kv_lens))
    dense = q_doc[:, None] == kv_doc[None, :]
    if causal:
        dense &= torch.arange(Q)[:, None] >= torch.arange(KV)[None, :]
    B = tn.FLEX_BLOCK
    nq, nkv = -(-Q // B), -(-KV // B)
    need = torch.zeros(nq, nkv, dtype=torch.bool)
    for i in range(nq):
        for j in range(nkv):
            need[i, j] = dense[i * B:(i + 1) * B, j * B:(j + 1) * B].any()
    listed = bm.to_dense()[0, 0].bool()
    assert torch.equal(listed, need)
    mask_mod = bm.mask_mod
    qi, ki = torch.arange(Q)[:, None], torch.arange(KV)[None, :]
    assert torch.equal(mask_mod(0, 0, qi, ki), dense)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True], ids=["compiled-block-diagonal-causal"])
def test_compiled_flex_matches_dense_attention(causal):
    """The CUDA path compiles flex_attention (tn.flex does on CUDA tensors); inductor
    compiles it for the CPU too: same masks, against one dense masked SDPA call.
    Causal only: torch 2.13's CPU flex template emitted C++ that does not compile
    (``cur_kvSplitSize7`` undeclared) for the rectangular 4-sequence case here; CUDA
    compiles flex through its Triton template, and eager covers the masks on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    q_lens = [100, 17, 3, 140]
    kv_lens = q_lens if causal else [40, 7, 260, 1]
    bm = doc_block_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
    q = torch.randn(1, 4, sum(q_lens), 16, generator=g)
    k, v = (torch.randn(1, 4, sum(kv_lens), 16, generator=g) for _ in range(2))
    q_doc = torch.repeat_interleave(torch.arange(4), torch.tensor(q_lens))
    kv_doc = torch.repeat_interleave(torch.arange(4), torch.tensor(kv_lens))
    mask = q_doc[:, None] == kv_doc[None, :]
    if causal:
        mask &= torch.arange(sum(q_lens))[:, None] >= torch.arange(sum(kv_lens))[None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(compiled(q, k, v, block_mask=bm, scale=0.25), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_flex_compiles_once_per_mask_kind():
    """The CUDA path's compiled call (inductor compiles it for the CPU too) over
    prefill steps of 1 to 8 query and key tiles: one graph per mask kind, not one
    per tile count of 1 (dynamo's size specialization: 6 graphs here before), and
    each result equal to the per-sequence SDPA reference."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(4)
    steps = [([300, 200], [300, 200], False), ([50, 40], [50, 40], True), ([7], [7], True),
             ([500, 300, 100], [500, 300, 100], True), ([3, 4], [300, 200], False), ([1000], [1000], False),
             ([20, 30, 40], [20, 30, 40], False)]
    for q_lens, kv_lens, causal in steps:
        mask = tn.flex_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
        q = torch.randn(sum(q_lens), 4, 64, generator=g)
        k, v = (torch.randn(sum(kv_lens), 4, 64, generator=g) for _ in range(2))
        torch.testing.assert_close(pp.compiled_flex(q, k, v, mask, 0.125), tn.per_sequence(q, k, v, mask, 0.125),
                                   rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"] - before
    print(f"{len(steps)} prefill steps compiled {graphs} graph(s)")
    assert graphs <= 3


@pytest.mark.parametrize("causal", [False, True], ids=["rectangular", "causal"])
def test_per_sequence_fallback_equals_flex(causal):
    """Where compiled flex_attention fails on CUDA, prefill loops over sequences: same result."""
    g = torch.Generator().manual_seed(2)
    q_lens = [5, 130, 1, 17]
    kv_lens = q_lens if causal else [9, 2, 140, 33]
    mask = tn.flex_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    k, v = (torch.randn(sum(kv_lens), 2, 16, generator=g) for _ in range(2))
    torch.testing.assert_close(tn.per_sequence(q, k, v, mask, 0.25), tn.flex(q, k, v, mask, 0.25),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len,kv_len,causal", [(1500, 1500, False), (2, 2, True), (3, 1500, False), (1, 7, False)],
                         ids=["whisper_encoder", "decoder_prompts", "cross", "cross_one_query"])
def test_equal_lengths_run_one_batched_sdpa(q_len, kv_len, causal):
    """Sequences of one length (Whisper's 1500-frame windows) skip flex for one
    batched SDPA call (FlashAttention on CUDA): the same result as one call per
    sequence, with 2 KV heads under 4 query heads."""
    g = torch.Generator().manual_seed(3)
    q_lens, kv_lens = [q_len] * 3, [kv_len] * 3
    mask = tn.flex_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    k, v = (torch.randn(sum(kv_lens), 2, 16, generator=g) for _ in range(2))
    batched = tn.uniform_batch(q, k, v, mask, 0.25)
    assert batched is not None and batched.shape == q.shape
    torch.testing.assert_close(batched, tn.per_sequence(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tn.flex(q, k, v, mask, 0.25), batched)


@pytest.mark.parametrize("q_lens,kv_lens,causal", [([4, 5], [4, 5], True), ([3, 3], [7, 8], False),
                                                   ([2, 3], [9, 9], False)], ids=["causal", "keys", "queries"])
def test_unequal_lengths_go_to_flex(q_lens, kv_lens, causal):
    mask = tn.flex_mask(q_lens, kv_lens, causal=causal, device=torch.device("cpu"))
    q, k, v = torch.randn(sum(q_lens), 2, 8), torch.randn(sum(kv_lens), 2, 8), torch.randn(sum(kv_lens), 2, 8)
    assert tn.uniform_batch(q, k, v, mask, 0.25) is None


def test_shared_table_groups():
    a, b = [4, 5, 6], [7, 8]
    tables = [a, list(a), a, b, a, b, b]
    lens = [40, 40, 40, 20, 40, 20, 20]
    assert shared_table_groups(tables, lens) == [0, 3, 4, 5, 7]
    assert shared_table_groups([a] * 5, [40] * 5, max_rows=2) == [0, 2, 4, 5]
    assert shared_table_groups([a, a], [40, 39]) == [0, 1, 2]  # same table, other length


def test_decode_groups_share_cross_tables_and_read_them_once():
    pool = BlockPool(64, scattered=True, rng=random.Random(0))
    beams = [SeqSpec(3, 20) for _ in range(4)]
    for s in beams:
        s.grow(pool, 4)
    for s in beams[1:]:
        s.cross_blocks = beams[0].cross_blocks
    other = SeqSpec(2, 9)
    other.grow(pool, 4)
    md = make_attn_metadata(TorchNativeBackend, prefills=[], decodes=beams + [other], block_size=4)
    g = md.decode_cross
    assert g.q_start_loc.tolist() == [0, 4, 5] and g.kv_lens.tolist() == [20, 9] and g.max_q_len == 4
    assert g.tables[0, :5].tolist() == beams[0].cross_blocks
    assert md.decode_self.q_start_loc.tolist() == list(range(6))


@pytest.mark.parametrize("decode_path", ["torch-fallback", "triton-interpreter"])
def test_t5_position_bias_matches_torch_sdpa(tmp_path, decode_path, monkeypatch):
    """T5's relative position bias reaches this backend: a flex score_mod in the
    encoder and decoder prefills, the kernel's bias operand (or the fallback's
    mask) in decode; greedy tokens equal torch_sdpa's."""
    from encdec import LLM, SamplingParams
    from encdec.testing import make_random_t5

    monkeypatch.setenv("TRITON_INTERPRET", "1" if decode_path == "triton-interpreter" else "0")
    path = make_random_t5(str(tmp_path / "t5"), seed=0, d_kv=16)  # head size 16: one tl.dot tile
    rng = random.Random(4)
    prompts = [" ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 30))) for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = {}
    for name in ("torch_sdpa", "torch_native"):
        llm = LLM(path, device="cpu", attention_backend=name, kv_cache_memory=32 << 20)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["torch_native"] == outs["torch_sdpa"]
    assert sum(map(len, outs["torch_sdpa"])) > 12


# -- launches per step, through a real model --------------------------------------------


def _count_launches(tiny_bart: str, batch: int, monkeypatch) -> list[tuple[int, int]]:
    """(flex calls, paged launches) of each model forward of a 2-token generate."""
    from encdec import LLM, SamplingParams

    calls = {"flex": 0, "paged": 0}
    real_flex, real_paged = tn.flex, tn.paged_attention

    def flex(*a, **kw):
        calls["flex"] += 1
        return real_flex(*a, **kw)

    def paged(*a, **kw):
        calls["paged"] += 1
        return real_paged(*a, **kw)

    monkeypatch.setattr(tn, "flex", flex)
    monkeypatch.setattr(tn, "paged_attention", paged)
    llm = LLM(tiny_bart, device="cpu", attention_backend="torch_native", kv_cache_memory=64 << 20,
              max_num_seqs=64)
    per_step = []
    model = llm.llm_engine.worker.model
    model.fused_decode = False  # count the backend's decode launches, not the fused CPU step's one call
    real_forward = model.forward

    def forward(*a, **kw):
        before = dict(calls)
        out = real_forward(*a, **kw)
        per_step.append((calls["flex"] - before["flex"], calls["paged"] - before["paged"]))
        return out

    monkeypatch.setattr(model, "forward", forward)
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0), use_tqdm=False)
    return per_step


@pytest.mark.parametrize("batch", [1, 64])
def test_one_launch_per_layer_and_attention_type(tiny_bart, batch, monkeypatch):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_bart)
    enc, dec = cfg.encoder_layers, cfg.decoder_layers
    per_step = _count_launches(tiny_bart, batch, monkeypatch)
    # Prefill: encoder self, decoder self and cross per layer, each one flex call;
    # decode: decoder self and cross per layer, each one paged launch.
    assert per_step == [(enc + 2 * dec, 0), (0, 2 * dec)], per_step


@pytest.mark.parametrize("decode_path", [
    "torch-fallback", pytest.param("triton-interpreter", marks=pytest.mark.slow)])
def test_greedy_matches_torch_sdpa_end_to_end(tiny_bart, decode_path, monkeypatch):
    from encdec import LLM, SamplingParams

    monkeypatch.setenv("TRITON_INTERPRET", "1" if decode_path == "triton-interpreter" else "0")
    assert pa.path("cpu") == ("interpreter" if decode_path == "triton-interpreter" else "torch")
    rng = random.Random(0)
    words = "the rain in spain falls mainly on plain while a quick brown fox jumps over lazy dogs".split()
    # Interpreted, every kernel launch runs in Python: fewer rows and steps there.
    num, steps = (8, 12) if decode_path == "triton-interpreter" else (24, 24)
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 40))) for _ in range(num)]
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    outs = {}
    for name in ("torch_sdpa", "torch_native"):
        llm = LLM(tiny_bart, device="cpu", attention_backend=name, kv_cache_memory=64 << 20)
        assert llm.llm_engine.worker.backend.get_name() == name
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["torch_native"] == outs["torch_sdpa"]
    assert sum(map(len, outs["torch_sdpa"])) > num * 4  # real generations, not all empty


@pytest.mark.parametrize("decode_path", ["torch-fallback", "triton-interpreter"])
def test_unwritten_cache_slots_never_reach_the_result(decode_path, monkeypatch):
    """The cache is never zeroed: slots past a group's length (its last block's
    tail, padding to the longest group, blocks no group owns) may hold NaN, and
    neither path may let them through (a masked score does not: -inf + NaN is NaN,
    and a 0 weight times a NaN value is NaN)."""
    from tests.kernels.test_triton_paged_attention import Case, make_inputs, reference

    monkeypatch.setenv("TRITON_INTERPRET", "1" if decode_path == "triton-interpreter" else "0")
    for case in (Case("self-mixed", (1, 3, 1), (5, 17, 40), causal=True),
                 Case("cross-decode", (2, 1), (3, 33), causal=False)):
        inputs, tables = make_inputs(case)
        bs = case.block_size
        written = torch.zeros(inputs["k_cache"].shape[:2], dtype=torch.bool)  # (blocks, block_size)
        for table, n in zip(tables, case.kv_lens):
            for j in range(n):
                written[table[j // bs], j % bs] = True
        for c in (inputs["k_cache"], inputs["v_cache"]):
            c[~written] = float("nan")
        want = reference(case, inputs, tables)
        groups = tn.PagedGroups(inputs["block_tables"], inputs["q_start_loc"], inputs["kv_lens"],
                                max(case.q_lens), max(case.kv_lens))
        kv_cache = torch.stack([inputs["k_cache"], inputs["v_cache"]])  # (2, blocks, bs, H, D)
        scale = case.head_size ** -0.5
        if decode_path == "triton-interpreter":
            got = pa.paged_attention(**inputs, scale=scale, causal=case.causal, max_q_len=max(case.q_lens))
        else:
            got = torch.full_like(inputs["q"], float("nan"))
            tn.paged_torch(inputs["q"], kv_cache, groups, scale, causal=case.causal, out=got)
        assert torch.isfinite(got).all(), f"{case.id}: NaN from slots no group has written"
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_a_torch_without_the_size_option_compiles_as_before(monkeypatch):
    """No ``backed_size_oblivious`` in torch's config: a null context, not a patch
    that would raise on entering and send every prefill to the fallback."""
    import contextlib
    import types

    import torch.fx.experimental

    assert not isinstance(pp._size_generic(), contextlib.nullcontext)  # this torch has it
    monkeypatch.setattr(torch.fx.experimental, "_config", types.SimpleNamespace(), raising=False)
    with pp._size_generic() as entered:
        assert entered is None
    assert isinstance(pp._size_generic(), contextlib.nullcontext)
