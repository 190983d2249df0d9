"""Backend parity: XFormersBackend (its CPU reference path), TorchSDPABackend and a
naive per-sequence softmax(QK^T * scale)V agree on random packed batches, for all
three attention types, in prefill, decode (through the paged cache), mixed steps
and after a swap round trip. CUDA tests compare xFormers' kernels with the CPU path."""
from __future__ import annotations

import copy
import dataclasses
import random
import subprocess
import sys

import pytest
import torch
pytest.importorskip("xformers", reason="xFormers backend tests need the [cuda] extra: "
                                       "pip install 'encdec[cuda]'")
from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask, BlockDiagonalMask  # noqa: E402

import encdec.attention.backends.xformers as xf
from encdec.attention import AttentionBackend, AttentionType, get_attn_backend
from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.attention.backends.xformers import XFormersBackend
from encdec.attention.selector import xformers_problem

from .conftest import BlockPool, SeqSpec, make_attn_metadata

TOL = 1e-5
BACKENDS = (XFormersBackend, TorchSDPABackend)
TYPES = (AttentionType.ENCODER, AttentionType.DECODER, AttentionType.ENCODER_DECODER)
# xFormers' CUDA kernels: the PyTorch-index wheels have them, the PyPI wheel does not.
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or xformers_problem("cuda", torch.float16) is not None,
    reason="needs CUDA and an xFormers with CUDA kernels")


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q (Lq, H, D), k/v (Lk, Hk, D) -> (Lq, H, D), in float64."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale  # (H, Lq, Lk)
    if causal:
        s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class Sim:
    """Drives every backend through the same steps, each with its own self and cross
    caches, and keeps each sequence's logical K/V history for the naive reference."""

    def __init__(self, *, block_size: int, heads: tuple[int, int] = (4, 2), head_size: int = 8,
                 scattered: bool = False, seed: int = 0, num_blocks: int = 2048,
                 backends=BACKENDS, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.bs, (self.H, self.Hk), self.D = block_size, heads, head_size
        self.scale = head_size ** -0.5
        self.device, self.dtype, self.backends = device, dtype, backends
        self.pool = BlockPool(num_blocks, scattered=scattered, rng=random.Random(seed))
        shape = AttentionBackend.get_kv_cache_shape(num_blocks, block_size, self.Hk, head_size)
        self.caches = {b: {kind: torch.zeros(shape, dtype=dtype, device=device) for kind in ("self", "cross")}
                       for b in backends}
        self.impls = {(b, t): b.get_impl_cls()(self.H, head_size, self.scale, self.Hk, t)
                      for b in backends for t in TYPES}
        self.seqs: list[SeqSpec] = []
        self.hist: list[dict[str, torch.Tensor]] = []  # per sequence: k, v, xk, xv (float32, CPU)

    def step(self, new: list[tuple[int, int]] = (), decode=(), *, seed: int) -> dict:
        """Prefill ``new`` (dec_len, enc_len) sequences and decode one token of the
        sequences at indices ``decode``. Returns {backend name or "naive": {type: out}}."""
        g = torch.Generator().manual_seed(seed)
        H, Hk, D = self.H, self.Hk, self.D
        pre = []
        for dec_len, enc_len in new:
            pre.append(SeqSpec(dec_len, enc_len))
            pre[-1].grow(self.pool, self.bs)
        dec = [self.seqs[i] for i in decode]
        for s in dec:
            s.dec_len += 1
            s.grow(self.pool, self.bs)
        self.seqs += pre
        P, E = sum(s.dec_len for s in pre), sum(s.enc_len for s in pre)
        N = P + len(dec)

        def rand(n: int, h: int) -> torch.Tensor:  # rounded to the run's dtype, kept in float32
            return torch.randn(n, h, D, generator=g).to(self.dtype).float()
        q, k, v, qx = rand(N, H), rand(N, Hk), rand(N, Hk), rand(N, H)  # decoder self / cross queries
        eq, ek, ev, xk, xv = rand(E, H), rand(E, Hk), rand(E, Hk), rand(E, Hk), rand(E, Hk)

        ref = {t: torch.empty(n, H, D, dtype=torch.float64) for t, n in zip(TYPES, (E, N, N))}
        qs = es = 0
        for s in pre:
            qe, ee = qs + s.dec_len, es + s.enc_len
            self.hist.append({"k": k[qs:qe], "v": v[qs:qe], "xk": xk[es:ee], "xv": xv[es:ee]})
            ref[AttentionType.ENCODER][es:ee] = naive(eq[es:ee], ek[es:ee], ev[es:ee], self.scale, False)
            ref[AttentionType.DECODER][qs:qe] = naive(q[qs:qe], k[qs:qe], v[qs:qe], self.scale, True)
            ref[AttentionType.ENCODER_DECODER][qs:qe] = naive(qx[qs:qe], xk[es:ee], xv[es:ee], self.scale, False)
            qs, es = qe, ee
        for j, i in enumerate(decode):
            h, t = self.hist[i], P + j
            h["k"], h["v"] = torch.cat([h["k"], k[t:t + 1]]), torch.cat([h["v"], v[t:t + 1]])
            ref[AttentionType.DECODER][t] = naive(q[t:t + 1], h["k"], h["v"], self.scale, False)[0]
            ref[AttentionType.ENCODER_DECODER][t] = naive(qx[t:t + 1], h["xk"], h["xv"], self.scale, False)[0]
        outs = {"naive": {t: r.float() for t, r in ref.items()}}

        dev = lambda x: x.to(self.device, self.dtype).flatten(1)  # noqa: E731  (tokens, heads * D)
        for b in self.backends:
            md = make_attn_metadata(b, prefills=pre, decodes=dec, block_size=self.bs, device=self.device)
            c = self.caches[b]
            run = {
                AttentionType.ENCODER: (dev(eq), dev(ek), dev(ev), None),
                AttentionType.DECODER: (dev(q), dev(k), dev(v), c["self"]),
                AttentionType.ENCODER_DECODER: (dev(qx), dev(xk) if E else None, dev(xv) if E else None, c["cross"]),
            }
            outs[b.get_name()] = {t: self.impls[b, t].forward(*args, md, t).view(-1, H, D).float().cpu()
                                  for t, args in run.items()}
        return outs

    def swap_roundtrip(self) -> None:
        """Every block out to a CPU cache and back in to new block numbers (old ones
        poisoned with NaN), rewriting the tables, as a preempt-by-swap does."""
        old = [b for s in self.seqs for b in s.self_blocks + s.cross_blocks]
        new = self.pool.allocate(len(old))  # disjoint from ``old``, still held
        cpu = list(range(len(old)))[::-1]
        out_map, in_map = torch.tensor(list(zip(old, cpu))), torch.tensor(list(zip(cpu, new)))
        for b in self.backends:
            for cache in self.caches[b].values():
                host = torch.empty((2, len(old)) + cache.shape[2:], dtype=cache.dtype)
                b.swap_blocks(cache, host, out_map)
                cache[:, old] = float("nan")
                b.swap_blocks(host, cache, in_map)
        moved = dict(zip(old, new))
        for s in self.seqs:
            s.self_blocks = [moved[x] for x in s.self_blocks]
            s.cross_blocks = [moved[x] for x in s.cross_blocks]
        self.pool.release(old)


def assert_matches_naive(outs: dict, tol: float = TOL) -> None:
    ref = outs["naive"]
    for name, got in outs.items():
        for t in TYPES:
            assert got[t].shape == ref[t].shape, (name, t)
            assert torch.isfinite(got[t]).all(), (name, t)
            err = (got[t] - ref[t]).abs().max().item() if ref[t].numel() else 0.0
            assert err <= tol, f"{name} {t.value}: max error {err:.3g}"


def random_lens(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(n)]


def edge_lens(bs: int) -> list[tuple[int, int]]:
    """Lengths at block boundaries: the next decode token opens a new block or not."""
    return [(1, 1), (bs, bs), (bs - 1, bs + 1), (bs + 1, 2 * bs)]


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_matches_naive(block_size, seed):
    rng = random.Random(seed)
    sim = Sim(block_size=block_size, heads=[(4, 4), (4, 2)][seed % 2], scattered=bool(seed % 2), seed=seed)
    assert_matches_naive(sim.step(random_lens(rng, rng.randint(1, 8)), seed=seed))


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_decode_matches_naive(block_size, scattered):
    rng = random.Random(block_size + scattered)
    sim = Sim(block_size=block_size, scattered=scattered, seed=block_size)
    lens = random_lens(rng, rng.randint(1, 4)) + edge_lens(block_size)
    assert_matches_naive(sim.step(lens, seed=0))
    for step in range(1, 4):
        assert_matches_naive(sim.step(decode=range(len(lens)), seed=step))


def test_mixed_steps_match_naive():
    rng = random.Random(7)
    sim = Sim(block_size=5, heads=(6, 3), scattered=True, seed=7)
    assert_matches_naive(sim.step(random_lens(rng, 3), seed=0))
    assert_matches_naive(sim.step(random_lens(rng, 2), decode=[0, 1, 2], seed=1))  # 2 prefills + 3 decodes
    assert_matches_naive(sim.step(random_lens(rng, 1), decode=[4, 1, 3], seed=2))  # decodes in any order
    assert_matches_naive(sim.step(decode=range(6), seed=3))


@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_after_swap_is_identical(block_size):
    rng = random.Random(11)
    sim = Sim(block_size=block_size, scattered=False, seed=11)
    lens = random_lens(rng, 4) + edge_lens(block_size)
    sim.step(lens, seed=0)
    sim.step(decode=range(len(lens)), seed=1)
    stay, swapped = copy.deepcopy(sim), copy.deepcopy(sim)
    swapped.swap_roundtrip()
    assert all(a.self_blocks != b.self_blocks for a, b in zip(stay.seqs, swapped.seqs))
    for seed in (2, 3):
        a, b = stay.step(decode=range(len(lens)), seed=seed), swapped.step(decode=range(len(lens)), seed=seed)
        assert_matches_naive(b)
        for backend in BACKENDS:
            for t in TYPES:
                assert torch.equal(a[backend.get_name()][t], b[backend.get_name()][t]), (backend, t)


def test_biases_have_the_seed_shapes_and_are_built_once(monkeypatch):
    pre, dec = [SeqSpec(3, 7), SeqSpec(2, 4)], [SeqSpec(9, 5), SeqSpec(1, 2)]
    pool = BlockPool(64, scattered=True, rng=random.Random(0))
    for s in pre + dec:
        s.grow(pool, 4)
    md = make_attn_metadata(XFormersBackend, prefills=pre, decodes=dec, block_size=4)
    pmd, dmd = md.prefill_metadata, md.decode_metadata
    assert type(pmd.encoder_bias) is BlockDiagonalMask
    assert pmd.encoder_bias.q_seqinfo.seqstart_py == pmd.encoder_bias.k_seqinfo.seqstart_py == [0, 7, 11]
    assert type(pmd.cross_prefill_bias) is BlockDiagonalMask  # rectangular: decoder x encoder
    assert pmd.cross_prefill_bias.q_seqinfo.seqstart_py == [0, 3, 5]
    assert pmd.cross_prefill_bias.k_seqinfo.seqstart_py == [0, 7, 11]
    assert type(pmd.causal_prefill_bias) is BlockDiagonalCausalMask
    assert pmd.causal_prefill_bias.q_seqinfo.seqstart_py == [0, 3, 5]
    slots, bias = dmd.decode_self
    assert bias.q_seqinfo.seqstart_py == [0, 1, 2] and bias.k_seqinfo.seqstart_py == [0, 9, 10]
    expected = [dec[0].self_blocks[p // 4] * 4 + p % 4 for p in range(9)] + [dec[1].self_blocks[0] * 4]
    assert slots.tolist() == expected
    chunked = dataclasses.replace(md, seq_lens=[4] + md.seq_lens[1:])  # a prefill with a cached token
    with pytest.raises(NotImplementedError, match="cached context"):
        chunked.prefill_metadata.causal_prefill_bias

    # Two layers of each type over this step: five biases, each materialised once.
    calls = []
    real = BlockDiagonalMask.materialize
    monkeypatch.setattr(BlockDiagonalMask, "materialize",
                        lambda self, *a, **kw: calls.append(self) or real(self, *a, **kw))
    H, Hk, D = 4, 2, 8
    cache = torch.zeros(XFormersBackend.get_kv_cache_shape(64, 4, Hk, D))
    enc, tok = 11, 5 + 2
    for _layer in range(2):
        for t, n, c in ((AttentionType.ENCODER, enc, None), (AttentionType.DECODER, tok, cache),
                        (AttentionType.ENCODER_DECODER, tok, cache)):
            impl = XFormersBackend.get_impl_cls()(H, D, D ** -0.5, Hk, t)
            kv_n = enc if t != AttentionType.DECODER else tok
            out = impl.forward(torch.randn(n, H * D), torch.randn(kv_n, Hk * D), torch.randn(kv_n, Hk * D),
                               c, md, t)
            assert out.shape == (n, H * D) and torch.isfinite(out).all()
    assert len(calls) == 5 and len({id(b) for b in calls}) == 5


def test_kernel_path_passes_xformers_layouts(monkeypatch):
    """The CUDA branch (BMHK, and BMGHK with broadcast K/V for GQA) run through a
    stand-in for memory_efficient_attention that checks the layout and applies the bias."""
    seen = []

    def fake_mea(q, k, v, attn_bias=None, p=0.0, scale=None):
        assert q.ndim in (4, 5) and q.shape[0] == 1 and q.stride(-1) == 1 and p == 0.0
        assert k.shape == v.shape and k.shape[2:] == q.shape[2:]  # heads broadcast by the caller
        assert isinstance(attn_bias, BlockDiagonalMask)
        seen.append((q.ndim, type(attn_bias)))
        Mq, Mk, D = q.shape[1], k.shape[1], q.shape[-1]
        qq, kk, vv = (x.reshape(x.shape[1], -1, D).transpose(0, 1) for x in (q, k, v))  # (H, M, D)
        s = qq @ kk.transpose(1, 2) * scale + attn_bias.materialize((Mq, Mk))
        return (s.softmax(-1) @ vv).transpose(0, 1).reshape(q.shape)

    monkeypatch.setattr(xf, "_use_kernel", lambda device: True)
    monkeypatch.setattr(xf.xops, "memory_efficient_attention", fake_mea)
    for heads in ((4, 4), (4, 2)):
        rng = random.Random(3)
        sim = Sim(block_size=5, heads=heads, scattered=True, seed=3, backends=(XFormersBackend,))
        assert_matches_naive(sim.step(random_lens(rng, 3), seed=0))
        assert_matches_naive(sim.step(random_lens(rng, 2), decode=[0, 1, 2], seed=1))
    assert {n for n, _ in seen} == {4, 5}
    assert {b for _, b in seen} == {BlockDiagonalMask, BlockDiagonalCausalMask}


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_cuda_kernels_match_cpu_reference(block_size, heads, dtype, tol):
    """Prefill, mixed and (after a swap round trip) decode steps through xFormers'
    kernels against the CPU path on the same inputs (rounded to ``dtype``), and both
    against the naive reference."""
    rng = random.Random(block_size)
    lens = random_lens(rng, 6) + edge_lens(block_size)
    sims = {dev: Sim(block_size=block_size, heads=heads, head_size=64, scattered=True, seed=1,
                     backends=(XFormersBackend,), device=dev, dtype=dtype) for dev in ("cuda", "cpu")}
    plan = [dict(new=lens[:5]), dict(new=lens[5:], decode=range(5)), dict(decode=range(len(lens)))]
    for seed, kwargs in enumerate(plan):
        if seed == 2:  # device -> host -> device through swap_blocks, as a preemption does
            sims["cuda"].swap_roundtrip()
        got = {dev: sim.step(**kwargs, seed=seed) for dev, sim in sims.items()}
        assert_matches_naive(got["cuda"], tol)
        assert_matches_naive(got["cpu"], tol)
        for t in TYPES:
            ours, ref = got["cuda"]["xformers"][t], got["cpu"]["xformers"][t]
            if ref.numel():
                assert (ours - ref).abs().max().item() <= tol, t


def test_selector_picks_and_rejects_by_name():
    assert get_attn_backend(None, "cpu") is TorchSDPABackend
    assert get_attn_backend("torch_sdpa", "cpu") is TorchSDPABackend
    assert get_attn_backend("xformers", "cpu") is XFormersBackend  # runs its reference path here
    assert XFormersBackend.get_name() == "xformers"
    assert XFormersBackend.get_kv_cache_shape(7, 5, 2, 8) == TorchSDPABackend.get_kv_cache_shape(7, 5, 2, 8)
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend("flash_attn", "cpu")


def test_encdec_imports_without_xformers():
    code = """
import sys
import encdec, encdec.attention
assert "xformers" not in sys.modules, "import encdec must not import xformers"
sys.modules["xformers"] = None  # as if it were not installed
from encdec.attention import get_attn_backend
assert get_attn_backend(None, "cuda").get_name() == "torch_native"  # no xFormers: nothing extra needed
try:
    get_attn_backend("xformers", "cpu")
except ValueError as e:
    assert "pip install xformers" in str(e), e
else:
    raise AssertionError("no error without xformers")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cache_slots_follow_the_paged_layout():
    from encdec.attention.backends.abstract import cache_slots, cache_slots_list, packed_slots

    bs, rng = 4, random.Random(0)
    tables = [rng.sample(range(50), 5) for _ in range(3)]
    lens = [7, 20, 1]
    t = torch.tensor(tables)
    want = [tables[i][p // bs] * bs + p % bs for i, n in enumerate(lens) for p in range(n)]
    assert packed_slots(t, lens, bs).tolist() == want
    rows = torch.tensor([1, 0, 2])
    pos = torch.tensor([19, 6, 0])
    assert cache_slots(t, rows, pos, bs).tolist() == [tables[1][4] * bs + 3, tables[0][1] * bs + 2,
                                                      tables[2][0] * bs]
    # the host-list version (a decode step's prepare) gives the same slots
    assert cache_slots_list(tables, rows.tolist(), pos.tolist(), bs) == cache_slots(t, rows, pos, bs).tolist()
    many_rows = [rng.randrange(3) for _ in range(40)]
    many_pos = [rng.randrange(20) for _ in range(40)]
    assert (cache_slots_list(tables, many_rows, many_pos, bs)
            == cache_slots(t, torch.tensor(many_rows), torch.tensor(many_pos), bs).tolist())
