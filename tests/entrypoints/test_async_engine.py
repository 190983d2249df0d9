"""``AsyncLLMEngine`` in-process: streams equal ``LLM.generate``, aborts free blocks,
bad requests queue nothing, and the event loop is never blocked by a step."""
from __future__ import annotations

import asyncio
import time

import pytest

from encdec import SamplingParams
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, StepStats


@pytest.fixture()
def engine(tiny_bart):
    stats: list[StepStats] = []
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01),
                                          on_step=stats.append)
    eng.stats = stats
    yield eng
    eng.shutdown(30)


def run(engine, coro):
    async def main():
        engine.start(asyncio.get_running_loop())
        return await asyncio.wait_for(coro(), 120)

    return asyncio.run(main())


def test_streams_equal_generate_and_grow(engine, bart_llm):
    prompts = ["The rain in Spain", "A quick brown fox", "Paged attention"]
    sp = SamplingParams(max_tokens=10, temperature=0.7, seed=5, n=2)
    refs = bart_llm.generate(prompts, sp, use_tqdm=False)

    async def go():
        async def one(i, p):
            seen = []
            async for out in engine.generate(p, sp, f"r{i}"):
                seen.append([list(c.token_ids) for c in out.outputs])
            return seen
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    for seen, ref in zip(run(engine, go), refs):
        assert seen[-1] == [c.token_ids for c in ref.outputs]
        assert len(seen) > 1  # partial outputs came before the final one
        for a, b in zip(seen, seen[1:]):  # each a prefix of the next
            assert all(y[:len(x)] == x for x, y in zip(a, b))
    assert engine.engine.num_free_blocks()[0] == engine.engine.cache_config.num_gpu_blocks


def test_bad_request_in_a_batch_queues_nothing_and_abort_frees(engine):
    async def go():
        good = AsyncRequest("good", "hello", SamplingParams(max_tokens=4))
        bad = AsyncRequest("bad", "hello", SamplingParams(max_tokens=4, stop_token_ids=[10**7]))
        with pytest.raises(ValueError, match="stop_token_ids"):
            await engine.add_requests([good, bad])
        (stream,) = await engine.add_requests([AsyncRequest(
            "long", "hello", SamplingParams(max_tokens=200, ignore_eos=True), stream=True)])
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break  # leaving the stream aborts the request
        await stream.aclose()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.engine.has_unfinished_requests():
                break
        return out

    out = run(engine, go)
    assert not out.finished
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.num_free_blocks()[0] == engine.engine.cache_config.num_gpu_blocks
    assert sum(s.num_aborted for s in engine.stats) == 1 and engine.stats[-1].kv_cache_usage == 0


def test_event_loop_stays_free_while_the_engine_steps(engine):
    async def go():
        sp = SamplingParams(max_tokens=200, ignore_eos=True)
        streams = await engine.add_requests([AsyncRequest(f"b{i}", "some text here", sp) for i in range(16)])
        task = asyncio.gather(*(s.__anext__() for s in streams))
        gaps, last = [], time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        await task
        return gaps

    gaps = run(engine, go)
    assert len(gaps) > 10  # the loop kept turning while the engine decoded
