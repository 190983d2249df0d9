"""Async scheduling (``EngineArgs.async_scheduling``): step N+1 is scheduled and
packed on the host while step N runs on the device, and step N's tokens are
applied before N+1 runs. Tokens identical on and off (a batch mixing greedy and
seeded random rows, a stop string, a logits processor that reads each row's
output so far, and a beam search), every KV block free after aborts, and, with
a device emulated by a delay (a step's output is ready ``DELAY`` after its
kernels are queued, as a GPU's), the next step's host work done before that
delay ends."""
from __future__ import annotations

import time

import pytest

from encdec import LLM, BeamSearchParams, SamplingParams
from encdec.sample.logits_processor import AdapterLogitsProcessor

DELAY = 0.05  # seconds the emulated device takes per step


class BanLastOutput(AdapterLogitsProcessor):
    """Reads the live output list each step: a stale list would change the tokens."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        def ban(output_ids, logits):
            if output_ids:
                logits[output_ids[-1]] = float("-inf")
            return logits
        return ban if (params.extra_args or {}).get("ban_last") else None


PROMPTS = ["the quick brown fox", "jumps over the lazy dog", "a b c d e f", "hello world again",
           "one two three four five", "seven eight nine"]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=24),
            SamplingParams(temperature=0.8, seed=7, max_tokens=20),
            SamplingParams(temperature=0.0, max_tokens=30, stop=["tok5tok5"]),
            SamplingParams(temperature=0.0, max_tokens=22, extra_args={"ban_last": True}),
            SamplingParams(temperature=0.0, max_tokens=18, min_tokens=10, ignore_eos=True),
            # Seeded: an unseeded row draws from the engine's generator, where a planned
            # step's spare row (a request that ended in the step before) takes a draw too.
            SamplingParams(temperature=1.0, seed=11, max_tokens=26)]


def _llm(tiny_bart: str, on: bool) -> LLM:
    return LLM(tiny_bart, device="cpu", kv_cache_memory=32 << 20, async_scheduling=on,
               logits_processors=[BanLastOutput], seed=3)


def _run(llm: LLM) -> list[tuple[list[int], str, str | None]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_async_scheduling_gives_the_tokens_of_sync(tiny_bart):
    off, on = _llm(tiny_bart, False), _llm(tiny_bart, True)
    want = _run(off)
    got = _run(on)
    assert got == want
    assert on.llm_engine.steps_planned_ahead > 10 and off.llm_engine.steps_planned_ahead == 0
    assert want[2][2] == "stop"  # the stop string ended one request early
    # the engine's counters agree too (a spare row of a finished request is not a token)
    assert on.llm_engine.num_generated_tokens == off.llm_engine.num_generated_tokens
    eng = on.llm_engine
    assert eng.num_free_blocks()[0] == eng.cache_config.num_gpu_blocks


def test_a_beam_search_in_the_batch_turns_planning_off_for_its_steps_only(tiny_bart):
    off, on = _llm(tiny_bart, False), _llm(tiny_bart, True)
    beam = BeamSearchParams(3, max_tokens=6)
    mixed = [*_params()[:4], beam]
    want = off.generate(PROMPTS[:5], mixed, use_tqdm=False)
    got = on.generate(PROMPTS[:5], mixed, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    assert on.llm_engine.steps_planned_ahead > 0  # once the beam search ended, the rest ran planned
    eng = on.llm_engine
    assert eng.num_free_blocks()[0] == eng.cache_config.num_gpu_blocks


def test_aborts_while_a_step_is_planned_leave_every_block_free(tiny_bart):
    llm = _llm(tiny_bart, True)
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, _params())):
        eng.add_request(str(i), p, sp)
    for _ in range(3):
        eng.step()
    assert eng._ahead is not None  # a planned step holds every running row
    eng.abort_request(["0", "3"])
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.num_free_blocks()[0] == eng.cache_config.num_gpu_blocks


class _EmulatedDevice:
    """Each step's output is ready ``DELAY`` after its kernels were queued (a
    GPU's behaviour: the host waits in ``get_output``); records when each step
    was queued, when the host finished planning the step after it, and when its
    output was ready."""

    def __init__(self, worker) -> None:
        self.events: list[tuple[str, float]] = []
        for name in ("execute_model", "run_step"):
            setattr(worker, name, self._launch(getattr(worker, name)))
        plan = worker.plan_step

        def planned(*a, **k):
            out = plan(*a, **k)
            self.events.append(("planned", time.perf_counter()))
            return out
        worker.plan_step = planned

    def _launch(self, fn):
        def launched(*a, **k):
            step = fn(*a, **k)
            queued = time.perf_counter()
            self.events.append(("queued", queued))
            get = step.get_output

            def get_output():
                time.sleep(max(0.0, queued + DELAY - time.perf_counter()))
                self.events.append(("ready", time.perf_counter()))
                return get()
            step.get_output = get_output
            return step
        return launched


@pytest.mark.parametrize("on", [True, False], ids=["async", "sync"])
def test_the_next_step_is_planned_while_the_device_runs(tiny_bart, on):
    llm = _llm(tiny_bart, on)
    device = _EmulatedDevice(llm.llm_engine.worker)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    ev = device.events
    overlapped = [i for i, (kind, _) in enumerate(ev) if kind == "planned"
                  and ev[i - 1][0] == "queued" and ev[i + 1][0] == "ready"
                  and ev[i][1] < ev[i - 1][1] + DELAY <= ev[i + 1][1]]
    if on:  # every step is followed by a plan made inside its device time (8 steps, 8 plans: the last
        # is dropped, its rows all ended)
        queued = sum(kind == "queued" for kind, _ in ev)
        assert len(overlapped) == queued == 8 and llm.llm_engine.steps_planned_ahead == 8
    else:
        assert overlapped == [] and all(kind != "planned" for kind, _ in ev)


def test_async_scheduling_is_checked():
    from encdec.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="x", async_scheduling="yes")
