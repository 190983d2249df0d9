"""Steps with the same rows as the step before (issue 54's decode path): the
scheduler's room per row (``SlotRoom``) and reused metadata must schedule
exactly what the full per-row check schedules, say ``same_rows`` only when
nothing joined, left, was preempted or moved, and leave no block behind."""
from __future__ import annotations

import random

import pytest

from encdec.core.outputs import ModelRunnerOutput, SingleTokens
from encdec.core.slot_room import SlotRoom
from encdec.core.stop_checker import StopChecker
from encdec.sampling_params import SamplingParams
from tests.core.test_scheduler import assert_all_free, make_group, make_scheduler

EOS = 2


def test_slot_room_counts_down_and_forgets_on_any_change():
    rows = [object(), object(), object()]
    room = SlotRoom()
    assert room.due(rows, 0) is None  # nothing known yet
    room.record(rows, [2, 0, 5], 0)
    assert room.due(rows, 0) == [1]  # row 1 had no room left for one more token
    room.set(1, 3)
    assert room.due(rows, 0) == []
    assert room.due(rows, 0) == [0]  # row 0: 2 -> 1 -> 0 -> -1
    assert room.due(rows, 1) is None  # another lookahead
    room.record(rows, [1, 1, 1], 0)
    assert room.due(rows[:2], 0) is None  # a row left
    assert room.due([rows[1], rows[0], rows[2]], 0) is None  # another order
    room.forget()
    assert room.due(rows, 0) is None


def _scheduler(num_gpu: int, full_check: bool):
    sched = make_scheduler(num_gpu, max_num_seqs=32)
    sched.stop_checker = StopChecker(sched.scheduler_config.max_model_len, eos_token_id=EOS)
    if full_check:  # the per-row check every step, as before SlotRoom
        sched._room.due = lambda running, lookahead: None
    return sched


def _run(full_check: bool, num_gpu: int, seed: int) -> tuple[list, list]:
    """Groups with various prompts and lengths arriving over time, random tokens
    (eos now and then); returns per step (same_rows, scheduled seq ids, their
    self tables, block moves) and every group's output."""
    rng = random.Random(seed)
    sched = _scheduler(num_gpu, full_check)
    groups = []
    trace = []
    names: dict[int, int] = {}  # seq_id -> order of first appearance (seq ids are global)
    for step in range(400):
        if step % 9 == 0 and len(groups) < 24:
            for _ in range(rng.randint(1, 3)):
                g = make_group(f"r{len(groups)}", arrival=float(len(groups)), dec_len=rng.randint(1, 7),
                               enc_len=rng.randint(2, 9))
                g.sampling_params = SamplingParams(temperature=0, max_tokens=rng.randint(5, 40))
                groups.append(g)
                sched.add_seq_group(g)
        if step == 60 and groups:
            sched.abort_seq_group(groups[1].request_id)
        metas, out = sched.schedule()
        ids = [sid for m in metas for sid in m.seq_data]
        trace.append((out.same_rows, [names.setdefault(i, len(names)) for i in ids], [list(m.block_tables[s]) for m in metas for s in m.seq_data],
                      out.blocks_to_copy, out.blocks_to_swap_in, out.blocks_to_swap_out, out.preempted))
        tokens = [EOS if rng.random() < 0.02 else rng.randint(3, 50) for _ in ids]
        sched.update(out, ModelRunnerOutput([], SingleTokens(ids, tokens)))
        if not sched.has_unfinished_seqs() and len(groups) >= 24:
            break
    assert_all_free(sched)
    return trace, [[s.get_output_token_ids() for s in g.get_seqs()] for g in groups]


@pytest.mark.parametrize("num_gpu", [400, 20], ids=["roomy", "tight-cache-preempts"])
def test_same_rows_schedules_what_the_full_check_schedules(num_gpu):
    fast, out_fast = _run(False, num_gpu, seed=3)
    full, out_full = _run(True, num_gpu, seed=3)
    assert out_fast == out_full
    assert [t[1:] for t in fast] == [t[1:] for t in full]
    assert sum(t[0] for t in fast) > 10  # the steady steps took the short path
    if num_gpu == 20:
        assert sum(t[-1] for t in fast) > 0  # and preemption happened between them


def test_same_rows_only_when_nothing_joined_or_left():
    sched = _scheduler(200, False)
    a, b = make_group("a", arrival=0), make_group("b", arrival=1)
    for g in (a, b):
        g.sampling_params = SamplingParams(temperature=0, max_tokens=50)
        sched.add_seq_group(g)
    flags = []

    def step(tokens=None):
        metas, out = sched.schedule()
        ids = [sid for m in metas for sid in m.seq_data]
        sched.update(out, ModelRunnerOutput([], SingleTokens(ids, tokens or [7] * len(ids))))
        flags.append(out.same_rows)
        return out

    step()  # both prefill
    step()  # decode: the step before had prefills
    step()
    step()
    c = make_group("c", arrival=2)
    c.sampling_params = SamplingParams(temperature=0, max_tokens=50)
    sched.add_seq_group(c)
    step()  # c joins
    step()  # c decodes for the first time
    step()
    sched.abort_seq_group("a")
    out = step()  # a left
    assert out.seq_ids_left
    step()
    assert flags == [False, False, True, True, False, False, True, False, True]
