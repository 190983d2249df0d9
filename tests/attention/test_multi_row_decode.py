"""Multi-row decode (speculative decoding's verification step): a decode sequence
may bring 1 + k query rows, its newest positions, causal among themselves,
beside one-row decodes and prefills in the same call
(``AttentionMetadata.decode_query_lens``). Every backend that runs decode is
checked against a float64 reference, self and cross, with a block boundary
inside a sequence's rows; the path is in the test id: the C paged kernel per
ISA build ("c-avx512", "c-avx2", "c-none"), torch_sdpa's gather without it,
torch_native's Triton kernel under ``TRITON_INTERPRET=1`` and its torch
fallback, xFormers' reference path. One-row steps stay what they were: the
field left None and [1, 1, ...] give the same bits, and each row of a
multi-row call equals, bit for bit, a one-row step at that row's length."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import pytest
import torch

from encdec.attention import AttentionBackend, AttentionType
from encdec.attention.backends.abstract import PositionBias
from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.kernels.cpu import build, paged_attention_cpu

torch.set_num_threads(1)

H, HK, D = 4, 2, 16
ENC = 37  # encoder tokens of every request: crosses two 16-slot blocks


@dataclass
class Seq:
    seq_len: int  # decoder keys after this step
    q_len: int  # query rows this step (a prefill: seq_len)
    prefill: bool = False


def _backend(name: str) -> type[AttentionBackend]:
    if name == "torch_native":
        pytest.importorskip("triton")
        from encdec.attention.backends.torch_native import TorchNativeBackend
        return TorchNativeBackend
    if name == "xformers":
        pytest.importorskip("xformers")
        from encdec.attention.backends.xformers import XFormersBackend
        return XFormersBackend
    return TorchSDPABackend


class Step:
    """One step's caches, queries, new K/V and metadata for ``seqs`` (prefills
    first), with every sequence's logical K/V history kept for the reference."""

    def __init__(self, seqs: list[Seq], *, block_size: int, seed: int, num_blocks: int = 96):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        free = list(range(num_blocks))
        rng.shuffle(free)  # scattered tables
        self.seqs, self.bs = seqs, block_size
        self.cache = {t: torch.randn(2, num_blocks, block_size, HK, D, generator=g) for t in ("self", "cross")}
        self.k = [torch.randn(s.seq_len, HK, D, generator=g) for s in seqs]
        self.v = [torch.randn(s.seq_len, HK, D, generator=g) for s in seqs]
        self.xk = [torch.randn(ENC, HK, D, generator=g) for _ in seqs]
        self.xv = [torch.randn(ENC, HK, D, generator=g) for _ in seqs]
        self.q = torch.randn(sum(s.q_len for s in seqs), H, D, generator=g)
        self.tables = [[free.pop() for _ in range(-(-s.seq_len // block_size))] for s in seqs]
        self.cross_tables = [[free.pop() for _ in range(-(-ENC // block_size))] for _ in seqs]
        for s, t, ct, k, v, xk, xv in zip(seqs, self.tables, self.cross_tables, self.k, self.v, self.xk, self.xv):
            old = s.seq_len - s.q_len  # cached before this step
            self._write("self", t, range(old), k[:old], v[:old])
            if not s.prefill:  # a prefill brings its encoder K/V as key/value
                self._write("cross", ct, range(ENC), xk, xv)

    def slots(self, table: list[int], positions) -> list[int]:
        return [table[p // self.bs] * self.bs + p % self.bs for p in positions]

    def _write(self, kind: str, table: list[int], positions, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = self.cache[kind].view(2, -1, HK, D)
        idx = torch.tensor(self.slots(table, positions), dtype=torch.long)
        flat[0][idx], flat[1][idx] = k, v

    def metadata(self, backend: type[AttentionBackend], query_lens: bool = True, device: str = "cpu"):
        seqs, P = self.seqs, [s for s in self.seqs if s.prefill]
        dec = [s for s in seqs if not s.prefill]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        prefix = lambda xs: i32([sum(xs[:i]) for i in range(len(xs) + 1)])  # noqa: E731
        width = max(len(t) for t in self.tables)
        cwidth = max(len(t) for t in self.cross_tables)
        slot_mapping = [x for s, t in zip(seqs, self.tables) for x in self.slots(t, range(s.seq_len - s.q_len,
                                                                                          s.seq_len))]
        cross_slots = [x for s, t in zip(seqs, self.cross_tables) if s.prefill for x in self.slots(t, range(ENC))]
        return backend.make_metadata(
            num_prefills=len(P), num_prefill_tokens=sum(s.q_len for s in P),
            num_decode_tokens=sum(s.q_len for s in dec),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            seq_lens=[s.seq_len for s in seqs], seq_lens_tensor=i32([s.seq_len for s in seqs]),
            max_prefill_seq_len=max((s.seq_len for s in P), default=0),
            max_decode_seq_len=max((s.seq_len for s in dec), default=0),
            max_query_len=max((s.q_len for s in P), default=1), query_start_loc=prefix([s.q_len for s in P]),
            seq_start_loc=prefix([s.seq_len for s in P]),
            context_lens_tensor=i32([s.seq_len - s.q_len for s in seqs]),
            block_tables=i32([t + [0] * (width - len(t)) for t in self.tables]),
            encoder_seq_lens=[ENC] * len(seqs), encoder_seq_lens_tensor=i32([ENC] * len(seqs)),
            encoder_seq_start_loc=prefix([ENC] * len(P)), max_encoder_seq_len=ENC, num_encoder_tokens=ENC * len(P),
            cross_slot_mapping=torch.tensor(cross_slots, dtype=torch.long, device=device),
            cross_block_tables=i32([t + [0] * (cwidth - len(t)) for t in self.cross_tables]),
            block_size=self.bs, block_tables_list=[list(t) for t in self.tables],
            cross_block_tables_list=[list(t) for t in self.cross_tables],
            decode_query_lens=[s.q_len for s in dec] if query_lens else None)

    def run(self, backend: type[AttentionBackend], attn_type: AttentionType, *, query_lens: bool = True,
            bias: PositionBias | None = None, device: str = "cpu") -> torch.Tensor:
        impl = backend.get_impl_cls()(H, D, D ** -0.5, HK, attn_type)
        md = self.metadata(backend, query_lens, device)
        cache = self.cache["self" if attn_type == AttentionType.DECODER else "cross"].to(device, copy=True)
        if attn_type == AttentionType.DECODER:
            k = torch.cat([k[s.seq_len - s.q_len:] for s, k in zip(self.seqs, self.k)])
            v = torch.cat([v[s.seq_len - s.q_len:] for s, v in zip(self.seqs, self.v)])
        else:
            pre = [i for i, s in enumerate(self.seqs) if s.prefill]
            k = torch.cat([self.xk[i] for i in pre]) if pre else None
            v = torch.cat([self.xv[i] for i in pre]) if pre else None
        kw = {} if bias is None else {"position_bias": bias}
        flat = lambda x: None if x is None else x.reshape(x.shape[0], -1).to(device)  # noqa: E731
        out = impl.forward(flat(self.q), flat(k), flat(v), cache, md, attn_type, **kw)
        return out.view(-1, H, D).cpu()

    def reference(self, attn_type: AttentionType, bias: PositionBias | None = None) -> torch.Tensor:
        """float64: row j of a sequence at position seq_len - q_len + j over its keys
        0..that position (self) or all its encoder keys (cross)."""
        out, row = [], 0
        for i, s in enumerate(self.seqs):
            for j in range(s.q_len):
                pos = s.seq_len - s.q_len + j
                if attn_type == AttentionType.DECODER:
                    k, v = self.k[i][: pos + 1], self.v[i][: pos + 1]
                else:
                    k, v = self.xk[i], self.xv[i]
                k, v = (x.double().repeat_interleave(H // HK, 1) for x in (k, v))
                sc = torch.einsum("hd,lhd->hl", self.q[row].double(), k) * D ** -0.5
                if bias is not None and attn_type == AttentionType.DECODER:
                    sc = sc + bias.compute(torch.tensor([pos]), torch.arange(pos + 1))[:, 0].double()
                out.append(torch.einsum("hl,lhd->hd", sc.softmax(-1), v))
                row += 1
        return torch.stack(out).float()


class DistanceBias(PositionBias):
    """A bias of ``key - query`` per head, as T5's: any table of distances."""

    num_heads = H

    def __init__(self, seed: int = 0):
        self.table = torch.randn(H, 128, generator=torch.Generator().manual_seed(seed))

    def compute(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        d = (key_positions[None, :] - query_positions[:, None]).clamp(-127, 0).neg()  # (Lq, Lk)
        return self.table[:, d]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def _no_c_kernel(monkeypatch) -> None:
    monkeypatch.setattr(paged_attention_cpu, "available", lambda *a: False)


# (backend, block size, path setup); the path names the ids. Block sizes of 16
# (Triton's tile) and 8 (torch_native's torch fallback: the kernel takes 16+).
PATHS = (
    [pytest.param("torch_sdpa", 16, isa, id=f"torch_sdpa-c-{isa}") for isa in build.host_isas()]
    + [pytest.param("torch_sdpa", 8, "torch", id="torch_sdpa-torch-gather"),
       pytest.param("torch_native", 16, "interpreter", id="torch_native-triton-interpreter"),
       pytest.param("torch_native", 8, "torch", id="torch_native-torch-fallback"),
       pytest.param("xformers", 16, "reference", id="xformers-reference")])


@contextlib.contextmanager
def _path(name: str, block_size: int, path: str, monkeypatch):
    with monkeypatch.context() as m:
        if name == "torch_sdpa" and path == "torch":
            _no_c_kernel(m)
        elif name == "torch_sdpa":
            if not paged_attention_cpu.available(path):
                pytest.skip(f"no {path} build of the C kernel here")
            m.setenv(build.ISA_ENV, path)
            assert build.cpu_isa() == path and paged_attention_cpu.path(path) == path
        elif name == "torch_native":
            from encdec.kernels.triton import paged_attention as pa
            assert pa.path("cpu") == "interpreter", "tests/conftest.py sets TRITON_INTERPRET=1 on CPU hosts"
            assert pa.runs_block_size(block_size) == (path == "interpreter")
        yield _backend(name)


def _mixed(block_size: int) -> list[Seq]:
    """A prefill, one-row decodes and speculating ones (k = 1, 3, 5), one with its
    rows across a block boundary (positions bs - 2 .. bs + 1)."""
    return [Seq(7, 7, prefill=True), Seq(5, 1), Seq(block_size + 2, 4), Seq(30, 1), Seq(41, 6), Seq(2, 2),
            Seq(3 * block_size, 1)]


@pytest.mark.parametrize("attn_type", [AttentionType.DECODER, AttentionType.ENCODER_DECODER],
                         ids=["self", "cross"])
@pytest.mark.parametrize("name, block_size, path", PATHS)
def test_multi_row_decode_matches_float64(name, block_size, path, attn_type, monkeypatch):
    step = Step(_mixed(block_size), block_size=block_size, seed=1)
    with _path(name, block_size, path, monkeypatch) as backend:
        out = step.run(backend, attn_type)
    torch.testing.assert_close(out, step.reference(attn_type), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name, block_size, path", PATHS)
def test_multi_row_decode_with_position_bias(name, block_size, path, monkeypatch):
    """T5's bias: each speculating row at its own position (the C kernel's
    distance table, the gathers' per-row bias, Triton's bias operand)."""
    step = Step(_mixed(block_size), block_size=block_size, seed=2)
    bias = DistanceBias()
    with _path(name, block_size, path, monkeypatch) as backend:
        out = step.run(backend, AttentionType.DECODER, bias=bias)
    torch.testing.assert_close(out, step.reference(AttentionType.DECODER, bias), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_type", [AttentionType.DECODER, AttentionType.ENCODER_DECODER],
                         ids=["self", "cross"])
@pytest.mark.parametrize("name, block_size, path", PATHS)
def test_one_row_steps_are_unchanged(name, block_size, path, attn_type, monkeypatch):
    """``decode_query_lens`` None (today's steps) and all 1 give the same bits."""
    seqs = [Seq(9, 9, prefill=True), Seq(5, 1), Seq(block_size + 1, 1), Seq(40, 1)]
    step = Step(seqs, block_size=block_size, seed=3)
    with _path(name, block_size, path, monkeypatch) as backend:
        a = step.run(backend, attn_type, query_lens=False)
        b = step.run(backend, attn_type)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name, block_size, path", [p for p in PATHS if p.id.startswith("torch_sdpa-c-")])
def test_each_row_equals_a_one_row_step(name, block_size, path, monkeypatch):
    """What greedy exactness asks of the C paths: row j of a speculating
    sequence is computed exactly as a one-row decode step at its position would
    compute it (same kernel, same length, same reads), so its attention cannot
    differ from decoding one by one. (The torch gather pads every row to the
    step's longest, so its sums depend on the batch: it is close, not equal.)"""
    block = block_size
    seqs = [Seq(5, 1), Seq(block + 2, 4), Seq(41, 6)]
    step = Step(seqs, block_size=block, seed=4)
    with _path(name, block_size, path, monkeypatch) as backend:
        for attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER):
            multi = step.run(backend, attn_type)
            row = 0
            for i, s in enumerate(seqs):
                for j in range(s.q_len):
                    one = Step.__new__(Step)
                    one.__dict__.update(step.__dict__)
                    pos = s.seq_len - s.q_len + j
                    # The step before this row: its sequence with `pos` cached, the row as a one-row decode.
                    one.seqs = [Seq(pos + 1, 1)]
                    one.tables, one.cross_tables = [step.tables[i]], [step.cross_tables[i]]
                    one.k, one.v = [step.k[i][:pos + 1]], [step.v[i][:pos + 1]]
                    one.xk, one.xv = [step.xk[i]], [step.xv[i]]
                    one.cache = {t: c.clone() for t, c in step.cache.items()}
                    one._write("self", step.tables[i], range(pos), step.k[i][:pos], step.v[i][:pos])
                    one.q = step.q[row:row + 1]
                    assert torch.equal(one.run(backend, attn_type)[0], multi[row]), (attn_type, i, j)
                    row += 1


def test_bad_decode_query_lens_are_value_errors():
    step = Step([Seq(5, 1), Seq(9, 3)], block_size=16, seed=5)
    md = step.metadata(TorchSDPABackend)
    assert md.decode_metadata.max_query_len == 3
    assert md.decode_query_start == [0, 1, 4]
    assert md.decode_rows.self_lens_list == [5, 7, 8, 9] and md.decode_rows.seq_of_row == [0, 1, 1, 1]
    fields = {f: getattr(md, f) for f in md.__dataclass_fields__}
    for lens, match in [([1], "2 decode sequences"), ([1, 2], "add up to 3"), ([0, 4], ">= 1"),
                        ([1, 10], "<= its seq_len")]:
        with pytest.raises(ValueError, match=match) as e:
            TorchSDPABackend.make_metadata(**{**fields, "decode_query_lens": lens,
                                              "num_decode_tokens": sum(lens) if match != "add up to 3" else 4})
        assert "decode_query_lens" in str(e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn_type", [AttentionType.DECODER, AttentionType.ENCODER_DECODER],
                         ids=["self", "cross"])
@pytest.mark.parametrize("name", ["torch_native-triton-cuda", "xformers-cuda"])
def test_multi_row_decode_on_cuda(name, attn_type):
    """The real kernels: Triton's paged attention (one causal group per
    speculating sequence) and xFormers' with the bottom-right causal mask."""
    backend = _backend(name.split("-")[0])
    if name.startswith("xformers"):
        from encdec.attention.selector import xformers_problem
        if xformers_problem("cuda", torch.float32) is not None:
            pytest.skip("xFormers without CUDA kernels")
    step = Step(_mixed(16), block_size=16, seed=6)
    out = step.run(backend, attn_type, device="cuda")
    torch.testing.assert_close(out, step.reference(attn_type), atol=5e-5, rtol=1e-5)
