"""encdec/kernels/triton/paged_attention against a float64 torch reference, run
on CPU under ``TRITON_INTERPRET=1`` (path "interpreter" in the test ids; on a
CUDA host the ``cuda``-marked case runs the compiled kernel, path "cuda").

Cases: decode (one row per group) and prefill (a prompt's rows over its own
cached keys, causal) mixed in one launch for self-attention; cross-attention
groups of several rows sharing one table and groups reading the same table
(the encoder cache); block sizes 16 and 32, heads 1-20 (and a GQA split),
head sizes 64 and 80, query and key lengths 1, 2, 15, 16, 17, 448, 1500; fp32,
fp16 and bf16. The interpreter runs programs one by one, so the default set is
lean; the long lengths are ``slow``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")

from encdec.kernels.triton import paged_attention as pa  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # rows per group
    kv_lens: tuple[int, ...]  # keys per group
    causal: bool
    block_size: int = 16
    heads: tuple[int, int] = (4, 4)  # (query heads, kv heads)
    head_size: int = 64
    dtype: torch.dtype = torch.float32
    shared: tuple[int, ...] = ()  # groups reading group 0's table (the encoder cache)

    @property
    def id(self) -> str:
        h, hk = self.heads
        heads = f"h{h}" if h == hk else f"h{h}kv{hk}"
        return (f"{self.name}-bs{self.block_size}-{heads}-d{self.head_size}-"
                f"{str(self.dtype).removeprefix('torch.').replace('float', 'fp')}")


LEAN = [
    Case("self-decode", (1,) * 5, (1, 2, 15, 16, 17), causal=True),
    Case("self-mixed", (15, 1, 16, 1, 17, 2), (15, 40, 16, 2, 17, 33), causal=True,
         block_size=32, heads=(3, 3), head_size=80, dtype=torch.float16),
    Case("cross-prefill", (2, 17), (15, 448), causal=False, block_size=32, heads=(1, 1), head_size=80),
    Case("cross-decode-shared", (3, 1, 2, 1), (17, 17, 16, 17), causal=False,
         heads=(4, 2), dtype=torch.float16, shared=(1, 3)),
    Case("self-decode", (1, 1), (16, 17), causal=True, heads=(20, 20)),
    Case("cross-decode", (1, 1), (2, 33), causal=False, dtype=torch.bfloat16),
]
SLOW = [
    Case("self-prefill", (448, 1), (448, 1500), causal=True, heads=(2, 2)),
    Case("cross-prefill", (448, 15), (1500, 1500), causal=False, block_size=32, heads=(2, 2),
         head_size=80, dtype=torch.float16, shared=(1,)),
    Case("cross-decode-shared", (16, 2, 1), (1500, 1500, 448), causal=False, block_size=32,
         heads=(20, 20), head_size=80, shared=(1,)),
    Case("self-mixed", (17, 1, 1, 2), (17, 1500, 448, 2), causal=True, heads=(8, 8), head_size=80),
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_inputs(case: Case, seed: int = 0, device: str = "cpu"):
    """Random queries and a cache whose blocks are scattered; group g's table
    holds its keys (shared groups point at group 0's table)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    H, Hk = case.heads
    bs, D = case.block_size, case.head_size
    need = [-(-n // bs) for n in case.kv_lens]
    num_blocks = sum(need) + 3
    pool = rng.sample(range(num_blocks), num_blocks)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    for g in case.shared:
        assert case.kv_lens[g] <= case.kv_lens[0]
        tables[g] = tables[0][: need[g]]
    width = max(need)
    rand = lambda *s: torch.randn(*s, generator=gen).to(case.dtype)  # noqa: E731
    k_cache, v_cache = rand(num_blocks, bs, Hk, D), rand(num_blocks, bs, Hk, D)
    q = rand(sum(case.q_lens), H, D)
    starts = [0]
    for n in case.q_lens:
        starts.append(starts[-1] + n)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return dict(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=i32([t + [0] * (width - len(t)) for t in tables]),
        q_start_loc=i32(starts), kv_lens=i32(list(case.kv_lens)),
    ), tables


def reference(case: Case, inputs: dict, tables: list[list[int]]) -> torch.Tensor:
    """Each group's rows over its keys, gathered slot by slot, in float64."""
    H, Hk = case.heads
    bs, D = case.block_size, case.head_size
    q = inputs["q"].cpu().double()
    kf = inputs["k_cache"].cpu().double().reshape(-1, Hk, D)
    vf = inputs["v_cache"].cpu().double().reshape(-1, Hk, D)
    out = torch.empty_like(q)
    start = 0
    for n_q, n_kv, table in zip(case.q_lens, case.kv_lens, tables):
        slots = [table[j // bs] * bs + j % bs for j in range(n_kv)]
        k = kf[slots].repeat_interleave(H // Hk, 1)
        v = vf[slots].repeat_interleave(H // Hk, 1)
        s = torch.einsum("qhd,khd->hqk", q[start: start + n_q], k) * D ** -0.5
        if case.causal:  # row i sits at key position n_kv - n_q + i
            pos = torch.arange(n_kv - n_q, n_kv)
            s = s.masked_fill(torch.arange(n_kv)[None, None, :] > pos[None, :, None], float("-inf"))
        out[start: start + n_q] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += n_q
    return out


def run(case: Case, device: str = "cpu", **kw) -> tuple[torch.Tensor | None, torch.Tensor]:
    inputs, tables = make_inputs(case, device=device)
    got = pa.paged_attention(**inputs, scale=case.head_size ** -0.5, causal=case.causal,
                             max_q_len=max(case.q_lens), **kw)
    return got, reference(case, inputs, tables)


@pytest.fixture
def interpreter(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pa.path("cpu") == "interpreter"
    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it "
                    "on hosts without CUDA): its own jitted helpers cannot run in the interpreter")
    return "interpreter"


def assert_matches_reference(case: Case, got: torch.Tensor | None, ref: torch.Tensor) -> None:
    assert got is not None, "the kernel declined"
    assert got.dtype == case.dtype and got.shape == ref.shape
    err = (got.cpu().double() - ref).abs().max().item()
    assert err <= TOL[case.dtype], f"{case.id}: max error {err:.3g}"


@pytest.mark.parametrize("case", LEAN, ids=lambda c: f"interpreter-{c.id}")
def test_matches_float64_reference(interpreter, case):
    assert_matches_reference(case, *run(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"interpreter-{c.id}")
def test_long_lengths_match_float64_reference(interpreter, case):
    assert_matches_reference(case, *run(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["interpreter-bias-fp32", "interpreter-bias-fp16"])
def test_position_bias_is_added_to_the_scores(interpreter, dtype):
    """T5's decode: a (rows, heads, keys) bias added to each row's scaled scores."""
    case = Case("self-decode", (1, 1, 1), (17, 1, 40), causal=True, heads=(3, 3), dtype=dtype)
    inputs, tables = make_inputs(case)
    bias = torch.randn(3, 3, 48, generator=torch.Generator().manual_seed(5)) * 3  # wider than the longest row
    got = pa.paged_attention(**inputs, scale=case.head_size ** -0.5, causal=True, max_q_len=1, bias=bias)
    H, D, bs = 3, case.head_size, case.block_size
    kf = inputs["k_cache"].double().reshape(-1, H, D)
    vf = inputs["v_cache"].double().reshape(-1, H, D)
    want = torch.empty(3, H, D, dtype=torch.float64)
    for r, (n, table) in enumerate(zip(case.kv_lens, tables)):
        slots = [table[j // bs] * bs + j % bs for j in range(n)]
        s = torch.einsum("hd,khd->hk", inputs["q"][r].double(), kf[slots]) * D ** -0.5 + bias[r, :, :n].double()
        want[r] = torch.einsum("hk,khd->hd", s.softmax(-1), vf[slots])
    assert_matches_reference(case, got, want)


def test_writes_into_an_out_view(interpreter):
    """The backend passes a slice of the step's output: rows outside it stay put."""
    case = LEAN[0]
    inputs, tables = make_inputs(case)
    buf = torch.full((len(case.q_lens) + 3, *inputs["q"].shape[1:]), 7.0)
    got = pa.paged_attention(**inputs, scale=case.head_size ** -0.5, causal=True,
                             max_q_len=1, out=buf[2:-1])
    assert got.data_ptr() == buf[2].data_ptr()
    assert (buf[:2] == 7).all() and (buf[-1] == 7).all()
    assert_matches_reference(case, buf[2:-1], reference(case, inputs, tables))


def test_declines_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pa.path("cpu") == "torch" and not pa.available("cpu")
    case = LEAN[0]
    inputs, _ = make_inputs(case)
    kw = dict(scale=1.0, causal=True, max_q_len=1)
    assert pa.paged_attention(**inputs, **kw) is None  # a CPU tensor without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = Case("self-decode", (1,), (5,), causal=True, block_size=5)
    inputs, _ = make_inputs(odd)
    assert pa.paged_attention(**inputs, **kw) is None  # blocks of 5 keys: not one tl.dot tile
    inputs, _ = make_inputs(case)
    assert pa.paged_attention(**{**inputs, "q": inputs["q"].double()}, **kw) is None


def test_interpreter_failures_surface(interpreter, monkeypatch):
    """On CUDA a failing kernel is logged once and declined (the backend gathers);
    under the interpreter a failure is a kernel bug and is raised."""
    def broken(*a, **k):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(pa, "_launch", broken)
    inputs, _ = make_inputs(LEAN[0])
    with pytest.raises(RuntimeError, match="kernel bug"):
        pa.paged_attention(**inputs, scale=1.0, causal=True, max_q_len=1)
    assert not pa._failure


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", LEAN + SLOW, ids=lambda c: f"cuda-{c.id}")
def test_cuda_matches_float64_reference(monkeypatch, case):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pa.path("cuda") == "cuda"
    assert_matches_reference(case, *run(case, device="cuda"))
