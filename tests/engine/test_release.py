"""An engine lets go of everything when the caller drops it: its model, KV
cache and engine objects are collectable after ``del llm`` (no module-level
reference, no cycle gc cannot break). On an H100 a second engine in one
process ran out of memory after ``del`` of the first; the CUDA test says
whether torch still holds the first one's tensors (a reference kept) or only
caches their memory."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from encdec import LLM, SamplingParams


def _refs(llm: LLM) -> dict[str, weakref.ref]:
    engine = llm.llm_engine
    worker = engine.worker
    return {"engine": weakref.ref(engine), "model": weakref.ref(worker.model),
            "kv cache": weakref.ref(worker.cache_engine.gpu_cache[0]),
            "runner": weakref.ref(worker.model_runner)}


def _use(llm: LLM) -> None:
    outs = llm.generate(["hello there", "a somewhat longer prompt for the encoder"],
                        SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_native"])
def test_dropped_engine_is_collected(tiny_bart, backend):
    llm = LLM(tiny_bart, device="cpu", attention_backend=backend, kv_cache_memory=16 << 20)
    _use(llm)
    refs = _refs(llm)
    del llm
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still referenced after del and gc: {alive}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dropped_cuda_engine_returns_its_tensors(tiny_bart):
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(tiny_bart, device="cuda", dtype="float16", kv_cache_memory=256 << 20)  # CUDA graphs on
    _use(llm)
    during = torch.cuda.memory_allocated()
    refs = _refs(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    after, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"allocated before {before >> 20} MiB, with the engine {during >> 20} MiB, after del "
          f"{after >> 20} MiB (reserved {reserved >> 20} MiB)")
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still referenced after del and gc: {alive}"
    assert after - before < 16 << 20, f"{(after - before) >> 20} MiB of tensors outlived the engine"
