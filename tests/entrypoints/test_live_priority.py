"""Live passes rank ahead of other work. Under the priority policy (``encdec serve``'s
default) a turn's final pass submitted after a partial pass and an offline upload is
admitted first; under an explicit fcfs the three keep their arrival order.
``PartialBudget`` caps partial passes in flight. No timing: the
engine thread is held while the three are queued, and the engine admits one prefill
per step, so the admission order is the scheduler's choice alone."""
from __future__ import annotations

import asyncio
import threading

import pytest

from encdec.engine.arg_utils import EngineArgs
from encdec.engine.async_llm_engine import AsyncLLMEngine
from encdec.transcription.driver import JobProgress, run_job
from encdec.transcription import TranscribeOptions, make_job
from encdec.transcription.live import FINAL_PRIORITY, PARTIAL_PRIORITY, PartialBudget, Turn, pass_priorities


class _Admitted(JobProgress):
    """Records when the engine first scheduled each finished request of a job."""

    def __init__(self, name: str, admitted: list[tuple[float, str]]) -> None:
        super().__init__()
        self.name, self.admitted = name, admitted

    def finished(self, output, text: str) -> None:
        super().finished(output, text)
        self.admitted.append((output.metrics.first_scheduled_time, self.name))


async def _admission_order(engine: AsyncLLMEngine, wavs: list) -> list[str]:
    final_priority, partial_priority = pass_priorities(engine)
    partial, final = Turn(16000), Turn(16000)
    partial.append(wavs[1][:32000])
    final.append(wavs[2])
    options = TranscribeOptions()
    jobs = [("offline", make_job(engine, wavs[0], options), 0),
            ("partial", partial.partial_job(engine, options), partial_priority),
            ("final", final.final_job(engine, options), final_priority)]
    entered, release = threading.Event(), threading.Event()

    def hold(model) -> None:
        entered.set()
        release.wait(60)

    held = asyncio.ensure_future(asyncio.to_thread(engine.call_model, hold))
    assert await asyncio.to_thread(entered.wait, 60)
    admitted: list[tuple[float, str]] = []
    tasks = []
    for name, job, priority in jobs:  # queued in this order while the engine thread waits in hold()
        tasks.append(asyncio.ensure_future(run_job(engine, job, request_id_prefix=name, priority=priority,
                                                   progress=_Admitted(name, admitted))))
        await asyncio.sleep(0)  # the task runs up to add_requests, which queues its request
    release.set()
    await held
    results = await asyncio.gather(*tasks)
    assert all(r.text for r in results)
    assert len(admitted) == 3, admitted  # one request each: no temperature fallback
    return [name for _, name in sorted(admitted)]


@pytest.mark.parametrize("policy, priorities, want", [
    ("priority", (FINAL_PRIORITY, PARTIAL_PRIORITY), ["final", "partial", "offline"]),
    ("fcfs", (0, 0), ["offline", "partial", "final"]),  # fcfs refuses any priority but 0
])
def test_final_pass_is_admitted_before_earlier_partial_and_offline(ct2_dir, speech_clips, policy, priorities, want):
    args = EngineArgs(str(ct2_dir), num_threads=1, kv_cache_memory=64 << 20, swap_space=0.1,
                      scheduling_policy=policy, max_num_batched_tokens=1)  # one prefill per step
    engine = AsyncLLMEngine.from_engine_args(args)
    assert engine.scheduling_policy == policy and pass_priorities(engine) == priorities
    assert FINAL_PRIORITY < PARTIAL_PRIORITY < 0  # 0: every other request, offline uploads included

    async def main() -> list[str]:
        engine.start(asyncio.get_running_loop())
        return await asyncio.wait_for(_admission_order(engine, speech_clips[2]), 120)

    try:
        assert asyncio.run(main()) == want
    finally:
        engine.shutdown(30)


def test_partial_pass_cap():
    # Partial passes yield to final passes in the engine (tests/core/test_priority_hold.py);
    # PartialBudget only caps how many run at once, across sessions.
    budget = PartialBudget(2)
    assert budget.take() and budget.take() and not budget.take()  # the limit
    budget.release()
    assert budget.take() and not budget.take()
    assert PartialBudget().limit == 1
    unlimited = PartialBudget(None)
    assert all(unlimited.take() for _ in range(100))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="partial pass limit must be an int >= 1"):
            PartialBudget(bad)


def test_serve_schedules_by_priority_unless_told_fcfs():
    from encdec.entrypoints.cli import build_parser
    from encdec.entrypoints.cli_options import engine_options

    parser = build_parser()
    assert engine_options(parser.parse_args(["serve", "m"]))["scheduling_policy"] == "priority"
    told = parser.parse_args(["serve", "m", "--scheduling-policy", "fcfs"])
    assert engine_options(told)["scheduling_policy"] == "fcfs"
    assert engine_options(parser.parse_args(["generate", "--model", "m", "x"]))["scheduling_policy"] == "fcfs"
