"""whisper_longform's ratio lines: the reduced-precision target asks for our fastest
row at equal or better WER than faster-whisper's fastest, so that line must skip a
faster row with a worse WER, and say so when no row of ours qualifies."""
from __future__ import annotations

from encdec.benchmarks.whisper_longform import print_ratios


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
