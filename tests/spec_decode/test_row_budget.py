"""The per-step cap on draft rows (``draft_rows.row_budget``): a step's decode rows
and their drafts stay within the fused CPU decode step's rows."""
from encdec.kernels.cpu.decoder_step_cpu import MAX_ROWS
from encdec.worker.draft_rows import row_budget


def test_drafts_fit_untouched_when_within_the_budget():
    rows = {1: 5, 2: 3}
    assert row_budget(rows, 2, MAX_ROWS) is rows


def test_many_rows_share_the_budget_evenly():
    spec = {sid: 5 for sid in range(64)}  # 64 rows at k = 5: 384 query rows
    capped = row_budget(spec, 64, 256)
    assert set(capped) == set(spec) and set(capped.values()) == {3}
    assert 64 + sum(capped.values()) <= 256


def test_a_row_below_its_share_keeps_its_own_count():
    capped = row_budget({1: 1, 2: 8, 3: 8}, 40, 64)  # share (64 - 40) // 3 = 8
    assert capped == {1: 1, 2: 8, 3: 8}
    capped = row_budget({1: 1, 2: 9, 3: 9}, 40, 64)
    assert capped == {1: 1, 2: 8, 3: 8}


def test_no_drafts_where_no_row_could_take_one():
    assert row_budget({sid: 3 for sid in range(200)}, 200, 256) == {}
    assert row_budget({1: 3}, 256, 256) == {}
