"""``AsyncLLMEngine`` in-process: streams equal ``LLM.generate``, aborts free blocks,
bad requests queue nothing, and the event loop is never blocked by a step."""
from __future__ import annotations

import asyncio
import time

import pytest

from encdec import SamplingParams
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, StepStats


@pytest.fixture(params=[False, True], ids=["sync", "async-scheduling"])
def engine(tiny_bart, request):
    """Both ways a step may be scheduled: after the step before (CPU's default) and
    while it runs (CUDA's default, ``async_scheduling``)."""
    stats: list[StepStats] = []
    args = EngineArgs(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01, async_scheduling=request.param)
    eng = AsyncLLMEngine.from_engine_args(args, on_step=stats.append)
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


class _AbandoningJob:
    """A job (``encdec.transcription`` protocol) that asks for a short and a long
    request and, once the short one is back, no longer needs the long one but
    goes on with a third (as a sequential job goes on to its next window)."""

    def __init__(self):
        from encdec.transcription import JobRequest

        long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        short = SamplingParams(max_tokens=2, temperature=0.0)
        self.options = None
        self._ready = [JobRequest(0, "hello", short), JobRequest(1, "hello there", long)]
        self._abandoned: list[int] = []
        self.seen: list[int] = []
        self.done = False
        self.partial_text = ""

    def next_requests(self):
        out, self._ready = self._ready, []
        return out

    def abandoned_tickets(self):
        out, self._abandoned = self._abandoned, []
        return out

    def add_output(self, out, ticket):
        from encdec.transcription import JobRequest

        self.seen.append(ticket)
        if ticket == 0:  # the long one is moot; ask for one more (30 steps) before finishing
            self._abandoned = [1]
            self._ready = [JobRequest(2, "hello", SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))]
        if ticket == 2:
            self.done = True

    def result(self):
        return self.seen


def test_run_job_aborts_what_the_job_abandons(engine):
    """The server's job driver aborts an abandoned request at once: the job never
    gets its output, and every KV block is free when the job returns."""
    from encdec.transcription.driver import run_job

    job = _AbandoningJob()

    async def go():
        seen = await run_job(engine, job, request_id_prefix="job")
        for _ in range(100):  # the abort lands on the engine thread
            if engine.engine.num_free_blocks()[0] == engine.engine.cache_config.num_gpu_blocks:
                break
            await asyncio.sleep(0.05)
        return seen

    assert run(engine, go) == [0, 2]
    assert engine.engine.num_free_blocks()[0] == engine.engine.cache_config.num_gpu_blocks
    assert not engine.engine.has_unfinished_requests()
    generated = sum(s.generation_tokens for s in engine.stats)
    # 2 + 30 tokens, plus at most a few of the long one before its abort landed
    assert generated < 2 + 30 + 10, f"{generated} tokens: the abandoned request ran on beside the third"


def test_run_jobs_aborts_what_the_job_abandons(bart_llm):
    """The same for ``LLM.transcribe``'s synchronous driver: the call ends when the
    third request does (~30 steps), not when the abandoned 400-token one would."""
    from encdec.transcription.driver import run_jobs

    engine = bart_llm.llm_engine
    steps, step = [], engine.step
    engine.step = lambda: steps.append(1) or step()
    try:
        job = _AbandoningJob()
        assert run_jobs(engine, [job], use_tqdm=False) == [[0, 2]]
    finally:
        del engine.step
    assert len(steps) < 60, f"{len(steps)} steps: the abandoned request ran on"
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


class _Deferring(AsyncLLMEngine):
    """Holds back requests whose prompt starts with "later" (as a disaggregated
    decoder engine holds back those whose encoder output must be fetched)."""

    def _defer(self, engine, inputs):
        text = engine.tokenizer.decode(inputs["encoder_prompt_token_ids"], skip_special_tokens=True)
        return "later" if text.startswith("later") else None


def test_deferred_requests_are_registered_then_queued_and_an_abort_between_drops_them(tiny_bart, bart_llm):
    import dataclasses

    eng = _Deferring.from_engine_args(EngineArgs(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01))
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = {"now": "The rain in Spain", "later": "later, a quick brown fox", "gone": "later still"}
    refs = {k: list(o.outputs[0].token_ids) for k, o in zip(prompts, bart_llm.generate(list(prompts.values()), sp,
                                                                                       use_tqdm=False))}

    async def go():
        reqs = [AsyncRequest(k, p, sp) for k, p in prompts.items()]
        iterators, deferred = await eng._submit(reqs)
        assert [reqs[i].request_id for i, *_ in deferred] == ["later", "gone"]
        assert eng.engine.get_stats().num_running + eng.engine.get_stats().num_waiting <= 1  # only "now" queued
        await eng.abort("gone")  # aborted while its encoder output would be fetched: never queued
        assert await eng._queue([dataclasses.replace(reqs[i], processed=(inputs, params))
                                 for i, inputs, params, _ in deferred]) == []
        got = {}
        for rid, it in zip(prompts, iterators):
            if rid != "gone":
                async for out in it:
                    got[rid] = list(out.outputs[0].token_ids)
        return got

    try:
        assert run(eng, go) == {"now": refs["now"], "later": refs["later"]}
        assert eng.engine.num_free_blocks()[0] == eng.engine.cache_config.num_gpu_blocks
        assert not eng.engine.has_unfinished_requests()
    finally:
        eng.shutdown(30)
