"""The priority policy's hold on encoder work: while a request of a negative
priority (a live turn's final pass) runs, less urgent requests wait before their
encoder pass, which would run in one of its steps and delay each token after;
an encoder cache hit (no pass) is not held, priority 0 holds nothing back, and
fcfs has no hold. This is what ``PartialBudget`` once did by hand for partial
passes (tests/entrypoints/test_live_priority.py: the cap it keeps)."""
from __future__ import annotations

from tests.core.test_encoder_budget import make_group, make_scheduler, run_steps


def admitted_at(steps: list[tuple[list[str], int]]) -> dict[str, int]:
    return {rid: i for i, (ids, _) in enumerate(steps) for rid in ids}


def test_final_holds_partial_and_upload_encoder_passes():
    sched = make_scheduler(None, policy="priority")
    sched.add_seq_group(make_group("final", 30, arrival=0.0, priority=-2))
    sched.schedule()  # the final runs (one token computed by hand below)
    for name, prio in (("partial", -1), ("upload", 0)):
        sched.add_seq_group(make_group(name, 30, arrival=1.0, priority=prio))
    final = sched.running[0]
    final.update_num_computed_tokens(1)
    final.seqs[0].append_token_id(7)
    at = admitted_at(run_steps(sched))
    # the final needs 2 more steps; the partial goes after it, the upload after the partial
    assert at["partial"] >= 2 and at["upload"] > at["partial"], at


def test_cached_encoder_input_and_ordinary_priorities_are_not_held():
    sched = make_scheduler(None, policy="priority")
    sched.add_seq_group(make_group("final", 30, arrival=0.0, priority=-2, key="clip"))
    sched.add_seq_group(make_group("same-clip", 30, arrival=0.5, priority=0, key="clip"))
    sched.add_seq_group(make_group("other", 30, arrival=1.0, priority=0))
    at = admitted_at(run_steps(sched))
    assert at["final"] == at["same-clip"] == 0  # its cross table is the final's: no encoder pass to hold
    assert at["other"] > 0
    sched = make_scheduler(None, policy="priority")
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", 30, arrival=float(i), priority=i))
    assert set(admitted_at(run_steps(sched)).values()) == {0}  # nothing negative: no hold


def test_fcfs_has_no_hold():
    sched = make_scheduler(None)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", 30, arrival=float(i)))
    assert set(admitted_at(run_steps(sched)).values()) == {0}
