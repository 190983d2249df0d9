"""whisper_longform's ratio lines: the reduced-precision target asks for our fastest
row at equal or better WER than faster-whisper's fastest, so that line must skip a
faster row with a worse WER, and say so when no row of ours qualifies."""
from __future__ import annotations

from benchmarks.whisper_longform import print_ratios


def test_the_equal_wer_line_skips_faster_rows_with_worse_wer(capsys):
    rows = {"ours independent": (10.0, 300.0, 0.130),  # fastest, worse WER than fw's fastest
            "ours indep. + VAD": (12.0, 250.0, 0.120),
            "ours sequential": (15.0, 200.0, 0.110),
            "fw seq int8": (60.0, 50.0, 0.110),
            "fw batched + VAD": (30.0, 100.0, 0.121)}
    print_ratios(rows)
    out = capsys.readouterr().out
    assert "our fastest (ours independent, WER 0.130) / fw fastest (fw batched + VAD, WER 0.121): 3.00x" in out
    assert "our fastest at equal or better WER (ours indep. + VAD, WER 0.120) / fw fastest: 2.50x" in out
    assert "ours sequential / fw seq int8: 4.00x" in out


def test_no_row_at_equal_wer_is_said(capsys):
    print_ratios({"ours independent": (10.0, 300.0, 0.2), "fw batched + VAD": (30.0, 100.0, 0.1)})
    assert "none of our rows at equal or better WER than fw fastest's 0.100" in capsys.readouterr().out


def test_the_measured_equal_line_keeps_rows_level_within_noise(capsys):
    """With ``compare``, a row whose WER is higher but not significantly so counts
    as level; one whose interval lies above zero does not."""
    from benchmarks.wer_compare import WerDifference

    rows = {"ours independent": (10.0, 300.0, 0.140),  # fastest, significantly worse
            "ours indep. + VAD": (12.0, 250.0, 0.123),  # 0.003 worse, within noise
            "ours sequential": (15.0, 200.0, 0.118),
            "fw batched + VAD": (30.0, 100.0, 0.120)}
    diffs = {"ours independent": WerDifference(0.020, 0.012, 0.028),
             "ours indep. + VAD": WerDifference(0.003, -0.002, 0.008),
             "ours sequential": WerDifference(-0.002, -0.007, 0.003)}
    seen = []

    def compare(a, b):
        seen.append((a, b))
        return diffs[a]

    print_ratios(rows, compare=compare)
    out = capsys.readouterr().out
    assert all(b == "fw batched + VAD" for _, b in seen)
    assert "3.00x; WER ours - fw +0.020 (95% interval +0.012..+0.028): worse" in out
    assert "our fastest at equal or better WER (ours sequential, WER 0.118) / fw fastest: 2.00x" in out
    assert ("our fastest not significantly worse (ours indep. + VAD, WER ours - fw +0.003 "
            "(95% interval -0.002..+0.008): level within noise) / fw fastest: 2.50x") in out
    diffs["ours indep. + VAD"] = diffs["ours sequential"] = WerDifference(0.01, 0.001, 0.02)
    print_ratios(rows, compare=compare)
    assert "every row of ours is significantly worse than fw fastest" in capsys.readouterr().out


def test_the_beam_rows_are_compared_like_for_like(capsys):
    rows = {"ours indep. + VAD int8": (10.0, 300.0, 0.123),
            "ours indep. + VAD beam 2 int8": (14.0, 210.0, 0.096),
            "fw batched + VAD int8": (30.0, 100.0, 0.120),
            "fw batched + VAD beam 2 int8": (40.0, 75.0, 0.097)}
    print_ratios(rows)
    out = capsys.readouterr().out
    assert ("ours indep. + VAD beam 2 int8 (WER 0.096) / fw batched + VAD beam 2 int8 (WER 0.097): 2.80x"
            in out)
    # the beam row is the fastest of ours at equal or better WER than fw's fastest (its greedy row)
    assert "our fastest at equal or better WER (ours indep. + VAD beam 2 int8, WER 0.096) / fw fastest: 2.10x" in out
