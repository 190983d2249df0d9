"""Scheduler with fake groups (no model): who is preempted, in which order
groups come back, the priority policy, and that abort or failure anywhere
leaves no block behind."""
from __future__ import annotations

import subprocess
import sys

import pytest

from encdec.config import CacheConfig, PreemptionMode, SchedulerConfig
from encdec.core.scheduler import Scheduler
from encdec.sampling_params import SamplingParams
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4  # tokens per block


def make_scheduler(num_gpu: int, num_cpu: int = 64, *, mode: str | None = None, policy: str = "fcfs",
                   max_num_seqs: int = 16, min_admission: int = 1) -> Scheduler:
    cache = CacheConfig(block_size=BS)
    cache.num_gpu_blocks, cache.num_cpu_blocks = num_gpu, num_cpu
    cfg = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max_num_seqs, max_model_len=256,
                          preemption_mode=PreemptionMode(mode) if mode else None, policy=policy,
                          min_admission=min_admission)
    return Scheduler(cfg, cache)


_next_seq_id = iter(range(10**6))


def make_group(request_id: str, *, arrival: float, dec_len: int = 2, enc_len: int = 4, n: int = 1,
               priority: int = 0) -> SequenceGroup:
    inputs = {"prompt_token_ids": [2] + [0] * (dec_len - 1),
              "encoder_prompt_token_ids": list(range(5, 5 + enc_len)),
              "prompt": None, "encoder_prompt": None}
    seqs = [Sequence(next(_next_seq_id), inputs, BS) for _ in range(n)]
    encoder_seq = Sequence(seqs[0].seq_id, inputs, BS, from_decoder_prompt=False)
    return SequenceGroup(request_id, seqs, arrival, SamplingParams(n=n, temperature=1.0, seed=0),
                         encoder_seq=encoder_seq, priority=priority)


def step(sched: Scheduler, token: int = 7):
    """One engine step without a model: every scheduled sequence gets a token."""
    metas, out = sched.schedule()
    for s in out.scheduled_seq_groups:
        s.seq_group.update_num_computed_tokens(s.token_chunk_size)
        for seq in s.seq_group.get_seqs(SequenceStatus.RUNNING):
            seq.append_token_id(token + seq.seq_id)  # siblings diverge: copy-on-write
    sched.free_finished_seq_groups()
    return metas, out


def ids(groups) -> list[str]:
    return sorted(g.request_id for g in groups)


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not bm.block_tables and not bm.cross_block_tables


# -- victim order ----------------------------------------------------------------

def test_fcfs_victim_is_latest_arrival_not_latest_admitted():
    # Each group: 1 cross block + 1 self block; 6 blocks hold three. Added (and
    # admitted) in the order a, b, c, but a arrived last: a is the victim.
    sched = make_scheduler(num_gpu=6)
    groups = {r: make_group(r, arrival=t) for r, t in (("a", 2.0), ("b", 0.0), ("c", 1.0))}
    for g in groups.values():
        sched.add_seq_group(g)
    _, out = step(sched)
    assert out.num_prefill_groups == 3
    step(sched)
    step(sched)  # length 5: the first self block is full
    _, out = step(sched)  # everyone needs a second self block and none is free
    assert out.preempted == 1
    assert [g.request_id for g in sched.swapped] == ["a"]
    assert ids(sched.running) == ["b", "c"]
    assert sched.stats.num_preempted_swap == 1
    a = groups["a"]
    bm = sched.block_manager
    # a's two blocks went to the CPU, decoder table first, then cross.
    assert [cpu for _, cpu in out.blocks_to_swap_out] == \
        bm.get_block_table(a.seqs[0]) + bm.get_cross_block_table(a)
    assert sched.stats.num_blocks_swapped_out == 2


def test_victims_go_from_the_least_urgent_end_and_never_hit_a_scheduled_group():
    sched = make_scheduler(num_gpu=8)
    for r, t in (("a", 0.0), ("b", 1.0), ("c", 2.0), ("d", 3.0)):
        sched.add_seq_group(make_group(r, arrival=t))
    for _ in range(3):  # prefill, then lengths 4 and 5
        step(sched)
    # All four need a second self block and none is free. a: d goes (2 free);
    # a and b take one each; c, now the least urgent left, preempts itself.
    _, out = step(sched)
    assert ids(sched.running) == ["a", "b"]
    assert [g.request_id for g in sched.swapped] == ["d", "c"]
    scheduled = [s.seq_group.request_id for s in out.scheduled_seq_groups]
    assert sorted(scheduled) == ["a", "b"]  # no victim was a group given slots
    assert out.preempted == 2 and sched.stats.num_preempted_swap == 2


# -- priority policy ---------------------------------------------------------------

def run_three_priorities(policy: str):
    """Three groups whose arrival order and priority order disagree, stepped
    until the 6-block cache forces one swap."""
    sched = make_scheduler(num_gpu=6, policy=policy)
    sched.add_seq_group(make_group("low-early", arrival=0.0, priority=5))
    sched.add_seq_group(make_group("high-late", arrival=2.0, priority=0))
    sched.add_seq_group(make_group("mid", arrival=1.0, priority=1))
    for _ in range(4):
        step(sched)
    return sched


def test_priority_policy_victim_is_lowest_priority_even_if_earliest():
    sched = run_three_priorities("priority")
    assert [g.request_id for g in sched.swapped] == ["low-early"]
    assert ids(sched.running) == ["high-late", "mid"]


def test_priority_policy_fcfs_ignores_priority():
    sched = run_three_priorities("fcfs")
    assert [g.request_id for g in sched.swapped] == ["high-late"]


def test_priority_policy_admits_waiting_in_priority_order():
    sched = make_scheduler(num_gpu=2, policy="priority")
    for r, t, p in (("x", 0.0, 3), ("y", 1.0, 1), ("z", 2.0, 2)):
        sched.add_seq_group(make_group(r, arrival=t, priority=p, dec_len=1, enc_len=1))
    order = []
    while sched.has_unfinished_seqs():
        _, out = step(sched)
        order += [s.seq_group.request_id for s in out.scheduled_seq_groups[: out.num_prefill_groups]]
        for g in list(sched.running):  # finish after one token
            for seq in g.get_seqs():
                seq.status = SequenceStatus.FINISHED_STOPPED
        sched.free_finished_seq_groups()
    assert order == ["y", "z", "x"]
    assert_all_free(sched)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_preemption_makes_room_for_an_urgent_waiting_group(mode):
    sched = make_scheduler(num_gpu=6, mode=mode, policy="priority")
    for r, t in (("bg1", 0.0), ("bg2", 1.0), ("bg3", 2.0)):
        sched.add_seq_group(make_group(r, arrival=t, priority=10))
    step(sched)
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    sched.add_seq_group(make_group("urgent", arrival=3.0, priority=0))
    _, out = step(sched)
    # The least urgent running group (latest of the lowest priority) made room,
    # and the urgent group was admitted in the same step.
    assert out.preempted == 1 and sched.stats.num_preempted_for_priority == 1
    prefills = [s.seq_group.request_id for s in out.scheduled_seq_groups[: out.num_prefill_groups]]
    assert prefills == ["urgent"]
    where = sched.swapped if mode == "swap" else sched.waiting
    assert [g.request_id for g in where] == ["bg3"]
    # Equal priorities never preempt each other for admission.
    sched.add_seq_group(make_group("same", arrival=4.0, priority=10))
    before = sched.stats.num_preempted_for_priority
    step(sched)
    assert sched.stats.num_preempted_for_priority == before


# -- swapped before waiting --------------------------------------------------------

def test_swapped_groups_resume_before_new_ones_are_admitted():
    # a, b: 2 blocks each; c: 2 cross + 2 self. c is swapped out at step 3,
    # leaving 2 free: room for "new" (2 blocks), not for c (4 + 1 to append).
    sched = make_scheduler(num_gpu=8)
    sched.add_seq_group(make_group("a", arrival=0.0))
    sched.add_seq_group(make_group("b", arrival=1.0))
    sched.add_seq_group(make_group("c", arrival=2.0, dec_len=5, enc_len=8))
    for _ in range(4):
        step(sched)
    assert ids(sched.swapped) == ["c"]
    assert sched.block_manager.get_num_free_gpu_blocks() >= 2
    sched.add_seq_group(make_group("new", arrival=3.0, dec_len=1, enc_len=1))  # 2 blocks
    resumed_at = admitted_at = None
    for i in range(40):
        _, out = step(sched)
        names = [s.seq_group.request_id for s in out.scheduled_seq_groups]
        assert len(names) == len(set(names))  # a resumed group is scheduled once
        prefills = set(names[: out.num_prefill_groups])
        if sched.swapped:
            assert "new" not in prefills
        if out.blocks_to_swap_in and resumed_at is None:
            resumed_at = i
        if "new" in prefills:
            admitted_at = i
        for g in list(sched.running):  # a and b stop at 8 tokens
            if g.request_id in ("a", "b") and g.seqs[0].get_len() >= 8:
                g.seqs[0].status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_finished_seq_groups()
        if admitted_at is not None:
            break
    assert resumed_at is not None and admitted_at is not None and resumed_at <= admitted_at
    assert sched.stats.num_swapped_in == 1


def test_swap_in_appends_a_slot_and_restores_statuses():
    sched = make_scheduler(num_gpu=6)
    for r, t in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        sched.add_seq_group(make_group(r, arrival=t))
    for _ in range(4):
        step(sched)
    c = sched.swapped[0]
    assert all(s.status is SequenceStatus.SWAPPED for s in c.get_seqs())
    for seq in sched.running[0].get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
    sched.free_finished_seq_groups()
    _, out = step(sched)
    assert c in sched.running and all(s.status is SequenceStatus.RUNNING for s in c.get_seqs())
    assert len(out.blocks_to_swap_in) == sched.stats.num_blocks_swapped_in


# -- recompute ---------------------------------------------------------------------

def test_recompute_reprefills_prompt_and_outputs():
    # single, forked (n=2, one copy-on-write at step 1), late: 2 blocks each,
    # 9 in all. At step 3 forked needs 2 more: late, the least urgent, is recomputed.
    sched = make_scheduler(num_gpu=9, mode="recompute")
    sched.add_seq_group(make_group("single", arrival=0.0))
    sched.add_seq_group(make_group("forked", arrival=1.0, n=2))
    sched.add_seq_group(make_group("late", arrival=2.0))
    for _ in range(4):
        step(sched)
    assert sched.stats.num_preempted_recompute == 1 and not sched.swapped
    assert [g.request_id for g in sched.waiting] == ["late"]
    late = sched.waiting[0]
    seq = late.seqs[0]
    assert seq.status is SequenceStatus.WAITING and seq.data.get_num_computed_tokens() == 0
    assert seq.get_output_len() == 3  # kept: they are re-prefilled, not re-sampled
    assert seq.seq_id not in sched.block_manager.block_tables
    assert "late" not in sched.block_manager.cross_block_tables
    # The others finish: late comes back as one prefill of prompt + outputs.
    tokens = seq.get_token_ids()
    for g in sched.running:
        for s in g.get_seqs():
            s.status = SequenceStatus.FINISHED_STOPPED
    sched.free_finished_seq_groups()
    metas, out = sched.schedule()
    meta = metas[0]
    assert meta.request_id == "late" and meta.is_prompt
    assert next(iter(meta.seq_data.values())).get_token_ids() == tokens
    assert meta.token_chunk_size == len(tokens) > 2


def test_forked_group_is_swapped_even_in_recompute_mode():
    sched = make_scheduler(num_gpu=7, mode="recompute")
    sched.add_seq_group(make_group("a", arrival=0.0))
    sched.add_seq_group(make_group("forked", arrival=1.0, n=3))
    for _ in range(5):
        step(sched)
    assert [g.request_id for g in sched.swapped] == ["forked"]
    assert sched.stats.num_preempted_recompute == 0 and sched.stats.num_preempted_swap == 1


# -- abort -------------------------------------------------------------------------

def test_abort_in_each_queue_frees_everything():
    sched = make_scheduler(num_gpu=8)
    for r, t, n in (("a", 0.0, 1), ("b", 1.0, 2), ("c", 2.0, 2)):
        sched.add_seq_group(make_group(r, arrival=t, n=n))
    for _ in range(4):
        step(sched)
    sched.add_seq_group(make_group("w", arrival=9.0))
    assert ids(sched.running) and ids(sched.swapped) and ids(sched.waiting) == ["w"]
    bm = sched.block_manager
    assert bm.get_num_free_cpu_blocks() < bm.num_total_cpu_blocks  # someone is on the CPU
    for queue in ("waiting", "swapped", "running"):
        for g in list(getattr(sched, queue)):
            aborted = sched.abort_seq_group(g.request_id)
            assert aborted == [g]
            assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in g.get_seqs())
            assert all(s.seq_id not in bm.block_tables for s in g.get_seqs())
            assert g.request_id not in bm.cross_block_tables
    assert not sched.has_unfinished_seqs()
    assert_all_free(sched)
    assert sched.abort_seq_group("nope") == []


# -- failure -----------------------------------------------------------------------

def test_never_fits_and_too_many_sequences_fail_with_an_error():
    sched = make_scheduler(num_gpu=4, max_num_seqs=2)
    sched.add_seq_group(make_group("huge", arrival=0.0, enc_len=20))  # 5 cross blocks
    sched.add_seq_group(make_group("wide", arrival=1.0, n=3))
    sched.add_seq_group(make_group("ok", arrival=2.0))
    _, out = step(sched)
    errors = {g.request_id: g.error for g in out.ignored_seq_groups}
    assert "KV cache blocks" in errors["huge"] and "raise kv_cache_memory" in errors["huge"]
    assert "max_num_seqs" in errors["wide"]
    assert [s.seq_group.request_id for s in out.scheduled_seq_groups] == ["ok"]
    assert sched.stats.num_ignored == 2


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_group_that_outgrows_the_whole_cache_fails_and_frees(mode):
    sched = make_scheduler(num_gpu=4, mode=mode)
    sched.add_seq_group(make_group("grows", arrival=0.0))  # 1 cross block, grows 1 block / 4 tokens
    failed = None
    for _ in range(30):
        _, out = step(sched)
        if out.ignored_seq_groups:
            failed = out.ignored_seq_groups[0]
            break
    assert failed is not None and "KV cache blocks" in failed.error
    assert failed.seqs[0].get_output_len() > 0  # what it made so far is kept
    assert not sched.has_unfinished_seqs()
    assert_all_free(sched)


def test_forked_group_without_swap_space_fails_instead_of_raising():
    sched = make_scheduler(num_gpu=7, num_cpu=1)
    sched.add_seq_group(make_group("a", arrival=0.0))
    sched.add_seq_group(make_group("forked", arrival=1.0, n=3))
    for _ in range(6):
        _, out = step(sched)
        if out.ignored_seq_groups:
            break
    [g] = out.ignored_seq_groups
    assert g.request_id == "forked" and "swap_space" in g.error
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in g.get_seqs())
    assert ids(sched.running) == ["a"]


def test_scheduler_does_not_import_torch():
    code = "import sys, encdec.core.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admitted_at_step_keeps_only_recent_admissions(monkeypatch):
    import encdec.core.admission as scheduler_module

    monkeypatch.setattr(scheduler_module, "ADMITTED_HISTORY", 3)
    sched = make_scheduler(num_gpu=64)
    for i in range(5):
        sched.add_seq_group(make_group(str(i), arrival=float(i)))
        step(sched)
    assert list(sched.stats.admitted_at_step.items()) == [("2", 2), ("3", 3), ("4", 4)]


# -- min_admission -----------------------------------------------------------------

@pytest.mark.parametrize("policy,min_admission,held_back", [
    ("fcfs", 2, True),       # one free slot while groups decode: wait for two
    ("fcfs", 1, False),      # the default: whenever one fits
    ("priority", 2, False),  # an urgent request is never held back
])
def test_min_admission_waits_for_room_while_groups_decode(policy, min_admission, held_back):
    sched = make_scheduler(256, max_num_seqs=4, policy=policy, min_admission=min_admission)
    for i in range(7):
        sched.add_seq_group(make_group(f"r{i}", arrival=float(i)))
    _, out = step(sched)
    assert out.num_prefill_groups == 4  # nothing decodes yet: admitted at once
    sched.abort_seq_group("r0")
    _, out = step(sched)
    assert out.num_prefill_groups == (0 if held_back else 1)
    assert len(out.scheduled_seq_groups) - out.num_prefill_groups == 3  # the decodes go on
    if held_back:
        sched.abort_seq_group("r1")
        _, out = step(sched)
        assert ids(g.seq_group for g in out.scheduled_seq_groups[:out.num_prefill_groups]) == ["r4", "r5"]
        sched.abort_seq_group("r2")  # one waits, one slot: all that wait fit
        _, out = step(sched)
        assert ids(g.seq_group for g in out.scheduled_seq_groups[:out.num_prefill_groups]) == ["r6"]
    sched.abort_seq_group([f"r{i}" for i in range(7)])
    assert_all_free(sched)


def test_min_admission_must_be_positive():
    with pytest.raises(ValueError, match="min_admission"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=8, min_admission=0)
