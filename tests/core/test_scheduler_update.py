"""``Scheduler.update``: the one owner of a step's sequence state. Runner
outputs (no model): tokens appended and stop-checked, finished sequences freed,
beam decisions applied (fork, drop, append, finish), the persistent batch's
joins and leaves, and statistics that stay bounded over a long run."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import tracemalloc

import pytest

from encdec.core import admission as scheduler_module
from encdec.core.outputs import BeamCandidates, ModelRunnerOutput, SampledTokens
from encdec.core.scheduler_outputs import BeamDecision, BeamUpdate
from encdec.core.stop_checker import StopChecker
from encdec.sampling_params import BeamRowParams, BeamSearchParams, SamplingParams
from encdec.sequence import SequenceStatus
from tests.core.test_scheduler import assert_all_free, make_group, make_scheduler

EOS = 2


def scheduler(num_gpu: int = 64, **kw):
    sched = make_scheduler(num_gpu, **kw)
    sched.stop_checker = StopChecker(sched.scheduler_config.max_model_len, eos_token_id=EOS)
    return sched


def run_step(sched, token_of=lambda seq_id: 7):
    metas, out = sched.schedule()
    samples = [SampledTokens(sid, [token_of(sid)]) for m in metas for sid in m.seq_data]
    return metas, out, sched.update(out, ModelRunnerOutput(samples))


def test_update_appends_stops_on_eos_and_frees():
    sched = scheduler()
    a, b = make_group("a", arrival=0), make_group("b", arrival=1)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    eos_for_a = {a.get_seqs()[0].seq_id}
    _, out, finished = run_step(sched)
    assert out.seq_ids_joined == [a.get_seqs()[0].seq_id, b.get_seqs()[0].seq_id] and not out.seq_ids_left
    assert not finished and a.get_seqs()[0].get_output_token_ids() == [7]
    _, out, finished = run_step(sched, lambda sid: EOS if sid in eos_for_a else 9)
    assert not out.seq_ids_joined and not out.seq_ids_left
    assert finished == [a] and a.get_seqs()[0].status is SequenceStatus.FINISHED_STOPPED
    assert sched.running == [b]
    _, out, _ = run_step(sched)
    assert out.seq_ids_left == [a.get_seqs()[0].seq_id]  # the runner drops it from its batch
    assert b.get_seqs()[0].get_output_token_ids() == [7, 9, 7]
    sched.abort_seq_group("b")
    _, out, _ = run_step(sched)
    assert out.seq_ids_left == [b.get_seqs()[0].seq_id]
    assert_all_free(sched)


def test_several_tokens_a_step_append_in_order_until_one_ends_the_sequence():
    """A step may carry several tokens for a sequence (a drafter's, verified):
    each is stop-checked in turn; those after the one that ends it are dropped."""
    sched = scheduler()
    a, b = make_group("a", arrival=0), make_group("b", arrival=1)
    for g in (a, b):
        sched.add_seq_group(g)
    sa, sb = a.get_seqs()[0], b.get_seqs()[0]
    tokens = {sa.seq_id: [5, EOS, 9], sb.seq_id: [5, 6, 8]}
    metas, out = sched.schedule()
    finished = sched.update(out, ModelRunnerOutput([SampledTokens(sid, tokens[sid]) for m in metas
                                                    for sid in m.seq_data]))
    assert finished == [a] and sa.status is SequenceStatus.FINISHED_STOPPED
    assert sa.get_output_token_ids() == [5, EOS] and sb.get_output_token_ids() == [5, 6, 8]


def test_a_beam_group_needs_a_beam_search():
    sched = scheduler()
    g = make_group("beams", arrival=0, n=2)
    g.sampling_params = BeamRowParams.from_beam_params(BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="beam search"):
        sched.add_seq_group(g)
    assert not sched.has_unfinished_seqs() and sched.get_seq_group("beams") is None


def test_update_stops_at_max_tokens():
    sched = scheduler()
    g = make_group("g", arrival=0)
    g.sampling_params = SamplingParams(max_tokens=3)
    sched.add_seq_group(g)
    for _ in range(2):
        assert not run_step(sched)[2]
    assert run_step(sched)[2] == [g]
    assert g.get_seqs()[0].status is SequenceStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


class Decided:
    """Beam search whose next decision is given (its rules are tested in
    tests/beam_search): what ``update`` does with a decision."""

    def __init__(self) -> None:
        self.next: BeamDecision | None = None

    def start(self, group) -> None:
        pass

    def decide(self, candidates, groups) -> list[BeamDecision]:
        assert set(candidates) == set(groups) == {self.next.request_id}
        return [self.next]


def beam_step(sched, decision: BeamDecision):
    _, out = sched.schedule()
    sched.beams.next = decision
    return out, sched.update(out, ModelRunnerOutput([], beam_candidates={"beams": BeamCandidates([], [], [])}))


def test_beam_decision_forks_drops_and_appends_sharing_blocks():
    sched = scheduler()
    sched.beams = Decided()
    g = make_group("beams", arrival=0, n=3, dec_len=6)
    sched.add_seq_group(g)
    sched.schedule()
    s0, s1, s2 = (s.seq_id for s in g.get_seqs())
    # Beam 0 is kept by two new beams (one forks), beam 1 by one, beam 2 by none.
    decision = BeamDecision("beams", finished=False, dropped=[s2], beams=[
        BeamUpdate(s0, s0, 11, -0.5), BeamUpdate(s0, 100, 12, -0.7), BeamUpdate(s1, s1, 13, -0.9)])
    beam_step(sched, decision)
    seqs = g.get_seqs(SequenceStatus.RUNNING)
    assert [s.seq_id for s in seqs] == [s0, 100, s1]
    assert [s.get_last_token_id() for s in seqs] == [11, 12, 13]
    assert [s.data.cumulative_logprob for s in seqs] == [-0.5, -0.7, -0.9]
    bm = sched.block_manager
    assert bm.get_block_table(seqs[1])[0] == bm.get_block_table(seqs[0])[0]  # the fork shares the prompt block
    assert s2 not in bm.block_tables
    out, finished = beam_step(sched, BeamDecision("beams", finished=True))
    assert out.seq_ids_joined == [100] and out.seq_ids_left == [s2]
    assert finished == [g] and all(s.is_finished() for s in g.get_seqs())
    assert_all_free(sched)


def test_ten_thousand_requests_keep_scheduler_memory_bounded(monkeypatch):
    """A long-running server's scheduler: per-request state is dropped when the
    request ends and the admission history keeps its last ADMITTED_HISTORY
    entries, so 10,000 more requests leave its traced memory where it was (the
    history's dict resizes as it turns over: a bounded wobble, not growth)."""
    monkeypatch.setattr(scheduler_module, "ADMITTED_HISTORY", 512)
    sched = scheduler(num_gpu=256, max_num_seqs=64)
    samples: list[int] = []

    def serve(start: int, count: int) -> None:
        for i in range(start, start + count):
            g = make_group(str(i), arrival=float(i))
            g.sampling_params = SamplingParams(max_tokens=2)
            sched.add_seq_group(g)
            if i % 50 == 49:
                while sched.has_unfinished_seqs():
                    run_step(sched)
            if i % 1000 == 999:
                gc.collect()
                samples.append(tracemalloc.get_traced_memory()[0])

    tracemalloc.start()
    try:
        serve(0, 1000)  # past ADMITTED_HISTORY: the history is full from here on
        serve(1000, 10000)
    finally:
        tracemalloc.stop()
    grown = max(samples[1:]) - samples[0]
    # A leak of 26 bytes a request would pass 256 KiB over these 10,000.
    assert grown < 256 * 1024, f"the scheduler's memory grew by {grown} bytes over 10,000 requests: {samples}"
    assert len(sched.stats.admitted_at_step) == 512
    assert sched.stats.num_encoder_passes == 11000
    run_step(sched)  # the last batch leaves the runner's batch
    assert not sched._requests and not sched._batch_seq_ids
    assert not sched.block_manager.block_tables and not sched.block_manager.cross_block_tables
    assert_all_free(sched)


def test_what_crosses_the_step_boundary_imports_no_torch():
    code = ("import sys, encdec.core.outputs, encdec.core.scheduler, encdec.core.step_update; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
