"""CUDA graphs for decode steps: buckets, when a step replays, and the padding of
its inputs to the bucket, checked on CPU by running the padded inputs eagerly
(what a replay computes) against the step's own forward. The capture itself
needs CUDA (``cuda``-marked tests)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from encdec.attention.backends.torch_native import TorchNativeMetadata  # noqa: E402
from encdec.worker.cuda_graphs import (  # noqa: E402
    DecodeGraphs,
    bucket_for,
    capture_sizes,
    graphs_wanted,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35
    assert capture_sizes(300)[-3:] == [272, 288, 304]  # past 256 rows, every 16 (as vLLM)
    assert capture_sizes(10_000)[-1] == 512 and len(capture_sizes(10_000)) == 51
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, sizes) is None


def test_graphs_only_on_cuda_with_torch_native_unless_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(cuda, "torch_native", enforce_eager=False)
    assert not graphs_wanted(cuda, "torch_native", enforce_eager=True)
    assert not graphs_wanted(cuda, "xformers", enforce_eager=False)
    assert not graphs_wanted(cpu, "torch_native", enforce_eager=False)
    assert not graphs_wanted(cuda, "torch_native", enforce_eager=False, position_bias=True)  # T5


def _decode_step(tiny_bart, monkeypatch):
    """An LLM on CPU (torch_native) and the inputs and hidden states of one of its
    decode steps: 3 rows, two of them sharing a cross table (n=2)."""
    from encdec import LLM, SamplingParams

    llm = LLM(tiny_bart, device="cpu", attention_backend="torch_native", kv_cache_memory=8 << 20,
              max_num_seqs=8)
    model = llm.llm_engine.worker.model
    # Graphs replay the op-by-op step (CUDA's): capture that one, not the fused CPU
    # decode step, whose hidden states are its own (its LM head takes them as they are).
    model.fused_decode = False
    real = model.forward
    seen = []

    def forward(input_ids, positions, kv_caches, md, **kw):
        out = real(input_ids, positions, kv_caches, md, **kw)
        if md.num_prefills == 0 and not seen:
            seen.append((input_ids.clone(), positions.clone(), md, out.clone()))
        return out

    monkeypatch.setattr(model, "forward", forward)
    llm.generate(["a short prompt", "another somewhat longer prompt for the encoder"],
                 [SamplingParams(max_tokens=3, min_tokens=3, temperature=0.0),
                  SamplingParams(max_tokens=3, min_tokens=3, n=2, temperature=1.0, seed=1)], use_tqdm=False)
    monkeypatch.setattr(model, "forward", real)
    return llm, seen[0]


def _graphs(llm) -> DecodeGraphs:
    w = llm.llm_engine.worker
    caches, mc = w.cache_engine.gpu_cache, w.model_config
    bs = w.cache_engine.block_size
    # The cache's last block is never handed out in so short a run: the pad slot's block.
    return DecodeGraphs(w.model, caches, max_num_seqs=8, max_model_len=mc.max_model_len,
                        max_encoder_len=mc.max_encoder_len, block_size=bs,
                        pad_slot=(caches[0].shape[1] - 1) * bs, device=w.device)


@pytest.mark.parametrize("decode_path", ["torch-fallback", "triton-interpreter"])
def test_padded_step_computes_the_step(tiny_bart, monkeypatch, decode_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if decode_path == "triton-interpreter" else "0")
    llm, (ids, pos, md, want) = _decode_step(tiny_bart, monkeypatch)
    n = ids.shape[0]
    assert n == 3 and md.decode_cross.kv_lens.shape[0] == 2  # the n=2 rows share one group
    graphs = _graphs(llm)
    bucket = bucket_for(n, graphs.sizes)
    assert bucket == 4
    # Stale rows from a bigger step must not leak into this one.
    graphs.buffers.input_ids.fill_(7)
    graphs.buffers.self_kv_lens.fill_(5)
    graphs.buffers.fill(ids, pos, md, bucket)
    b = graphs.buffers
    assert b.slot_mapping[n:bucket].tolist() == [graphs.buffers.pad_slot] * (bucket - n)
    assert b.self_q_start[: bucket + 1].tolist() == [0, 1, 2, 3, 3]
    assert b.cross_q_start[: bucket + 1].tolist() == md.decode_cross.q_start_loc.tolist() + [3, 3]
    assert b.self_kv_lens[n:bucket].tolist() == [0] and b.cross_kv_lens[2:bucket].tolist() == [0, 0]
    with torch.inference_mode():
        got = graphs._run(bucket)  # what the bucket's graph replays
    assert got.shape[0] == bucket
    torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5)


def test_when_a_step_replays(tiny_bart, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm, (ids, pos, md, _) = _decode_step(tiny_bart, monkeypatch)
    graphs = _graphs(llm)
    assert graphs.bucket(md, 3) is None  # nothing captured: eager
    graphs.graphs = {s: "captured" for s in graphs.sizes}  # stand-ins: only the decision is under test
    assert graphs.bucket(md, 3) == 4
    assert graphs.bucket(md, 9) is None  # past the largest bucket
    init = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if f.init}  # not cached properties
    prefill = TorchNativeMetadata(**{**init, "num_prefills": 1})
    assert graphs.bucket(prefill, 3) is None
    wide = TorchNativeMetadata(**init)
    wide.decode_self = wide.decode_self._replace(tables=torch.zeros(3, graphs.self_width + 1, dtype=torch.int32))
    assert graphs.bucket(wide, 3) is None  # a table wider than captured


def test_capture_needs_cuda(tiny_bart, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm, _ = _decode_step(tiny_bart, monkeypatch)
    assert llm.llm_engine.worker.model_runner.graphs is None  # CPU never captures
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        _graphs(llm).capture()


@pytest.mark.cuda
@requires_cuda
def test_graphs_replay_and_match_eager_on_cuda(tiny_bart, monkeypatch):
    from encdec import LLM, SamplingParams

    prompts = [f"prompt {i} " * (1 + i % 7) for i in range(24)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    eager = LLM(tiny_bart, device="cuda", dtype="float32", attention_backend="torch_native",
                enforce_eager=True, kv_cache_memory=512 << 20)
    assert eager.llm_engine.worker.model_runner.graphs is None
    graphed = LLM(tiny_bart, device="cuda", dtype="float32", kv_cache_memory=512 << 20)
    graphs = graphed.llm_engine.worker.model_runner.graphs
    assert graphed.llm_engine.worker.backend.get_name() == "torch_native"  # the CUDA default
    assert graphs is not None and set(graphs.graphs) == set(graphs.sizes)
    replays = []
    real = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda *a: replays.append(a[-1]) or real(*a))
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert replays and set(replays) <= set(graphs.sizes)


class _EagerGraph:
    """A captured graph's stand-in on CPU: replay runs the bucket's padded
    inputs eagerly into the bucket's output, which is what a replay computes."""

    def __init__(self, graphs: DecodeGraphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.outputs[self.bucket] = self.graphs._run(self.bucket)


def test_a_step_that_admits_replays_its_decode_rows(tiny_bart, monkeypatch):
    """Requests admitted while others decode: the step's prefills run eagerly,
    its decode rows through the graph, and the tokens are those of an engine
    without graphs: greedy, n=2 rows sharing a cross table, beams, encoder-cache hits."""
    from encdec import LLM, SamplingParams
    from encdec.sampling_params import BeamSearchParams

    monkeypatch.setenv("TRITON_INTERPRET", "0")

    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(10)] + ["prompt number 3 " * 4] * 2
    params = [SamplingParams(max_tokens=2 + 3 * (i % 4), min_tokens=2 + 3 * (i % 4), temperature=0.0)
              for i in range(10)]
    params[4] = SamplingParams(max_tokens=7, min_tokens=7, n=2, temperature=1.0, seed=3)  # rows share a cross table
    params[6] = BeamSearchParams(2, 6)  # beams
    params += [SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)] * 2  # encoder-cache hits

    def engine():
        return LLM(tiny_bart, device="cpu", attention_backend="torch_native", kv_cache_memory=8 << 20,
                   max_num_seqs=4)

    def tokens(outs):
        return [[c.token_ids for c in o.outputs] for o in outs]

    want = tokens(engine().generate(prompts, params, use_tqdm=False))
    llm = engine()
    llm.llm_engine.worker.model.fused_decode = False  # graphs replay CUDA's op-by-op step, never the CPU one
    graphs = _graphs(llm)
    graphs.graphs = {b: _EagerGraph(graphs, b) for b in graphs.sizes}
    runner = llm.llm_engine.worker.model_runner
    runner.graphs = graphs
    replays, real = [], graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda ids, *a: replays.append(len(ids)) or real(ids, *a))
    steps, model_calls, forward = [], [], runner.model.forward

    def counted(input_ids, positions, kv, md, **kw):
        model_calls.append((md.num_prefills, md.num_decode_tokens))
        return forward(input_ids, positions, kv, md, **kw)

    monkeypatch.setattr(runner.model, "forward", counted)
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda metas, sched, *rest: steps.append(
        (sched.num_prefill_groups, len(metas) - sched.num_prefill_groups)) or execute(metas, sched, *rest))
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert sum(1 for p, d in steps if p and d) > 1  # steps admitted requests while others decoded
    # No forward mixed prefills with decode rows: those rows were replayed.
    assert not [c for c in model_calls if c[0] and c[1]]
    assert sum(1 for c in model_calls if c[0]) == sum(1 for p, _ in steps if p)
    assert len(replays) == sum(1 for _, d in steps if d)  # every step's decode rows
