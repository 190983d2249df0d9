"""mixed_bench end to end at its smallest: Whisper tiny.en, one stream and two
windows arriving, unbudgeted and with a budget that splits the windows' passes
by rows; the budgeted run's steps stay within it and outputs match."""
from __future__ import annotations

from benchmarks import mixed_bench


def test_whisper_smallest_run_splits_and_matches(ct2_dir, capsys):
    mixed_bench.main(["--budgets", "none,150", "--streams", "1", "--uploads", "2", "--stream-tokens", "48",
                      "--upload-tokens", "2", "--threads", "1"])
    out = capsys.readouterr().out
    lines = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if line.startswith("budget")}
    assert "most encoder work in a step 3000 tokens" in lines["none"]  # both windows in one step
    assert "most encoder work in a step 150 tokens" in lines["150"]
    assert "outputs identical across budgets: True" in out
