"""Pure pieces of word timestamps and VAD: DTW, punctuation merging, packing
speech regions into windows and mapping packed time back."""
from __future__ import annotations

import subprocess
import sys

import math

import numpy as np
import pytest

from encdec.audio import N_SAMPLES, SAMPLE_RATE as SR
from encdec.transcription import TranscribeOptions
from encdec.transcription.alignment import Word, dtw, merge_punctuations
from encdec.transcription.vad import pack_speech


def brute_dtw_cost(cost: np.ndarray) -> float:
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            acc[i, j] = cost[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
    return acc[n, m]


def test_dtw_path_is_monotonic_and_optimal():
    rng = np.random.default_rng(0)
    for n, m in [(1, 1), (3, 7), (6, 40), (12, 9)]:
        cost = rng.standard_normal((n, m))
        rows, cols = dtw(cost)
        assert (rows[0], cols[0]) == (0, 0) and (rows[-1], cols[-1]) == (n - 1, m - 1)
        steps = np.stack([np.diff(rows), np.diff(cols)], 1)
        assert all(tuple(s) in {(1, 0), (0, 1), (1, 1)} for s in steps)
        assert np.isclose(cost[rows, cols].sum(), brute_dtw_cost(cost))


def test_merge_punctuations_as_openai_whisper():
    words = [Word(0, 1, ' "', 1), Word(1, 2, "Hello", 1), Word(2, 3, ",", 1), Word(3, 4, " world", 1),
             Word(4, 5, ".", 1), Word(5, 6, '"', 1)]
    tokens = [[1], [2], [3], [4], [5], [6]]
    merge_punctuations(words, tokens)
    kept = [(w.word, t) for w, t in zip(words, tokens) if w.word]
    assert kept == [(' "Hello,', [1, 2, 3]), (' world."', [4, 5, 6])]


def test_pack_speech_windows_and_map_back():
    wav = np.arange(200 * SR, dtype=np.float32)  # sample value = its index
    regions = [(10 * SR, 20 * SR), (40 * SR, 55 * SR), (60 * SR, 62 * SR), (100 * SR, 140 * SR)]
    packed, windows, tmap = pack_speech(wav, regions)
    assert len(packed) == 67 * SR
    assert np.array_equal(packed, np.concatenate([wav[s:e] for s, e in regions]))
    assert all(len(w) <= N_SAMPLES for _, w in windows)
    covered = np.concatenate([np.arange(s, s + len(w)) for s, w in windows])
    assert np.array_equal(covered, np.arange(len(packed)))  # every packed sample once, in order
    assert [s for s, _ in windows][:2] == [0, 27 * SR]  # 10 + 15 + 2 s in one window; the 40 s region is cut
    for t in [0.0, 3.5, 10.0, 24.9, 25.0, 26.5, 27.0, 66.9]:
        orig = tmap.original(t)
        assert abs(wav[int(round(orig * SR))] - packed[int(round(t * SR))]) < 1.0 + 1e-3
    assert tmap.original(10.0) == 40.0 and tmap.original(10.0, is_end=True) == 20.0
    assert pack_speech(wav, [])[1] == []


def test_import_encdec_does_not_import_silero():
    code = "import sys, encdec, encdec.transcription; print('silero_vad' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_vad_leaves_torch_threads_alone():
    """silero-vad sets torch's threads to 1 when imported; the first VAD call must
    not leave the process (our engine, HF beside it) on one thread."""
    import pytest

    pytest.importorskip("silero_vad")
    code = ("import numpy as np, torch; torch.set_num_threads(2)\n"
            "from encdec.transcription.vad import speech_regions\n"
            "speech_regions(np.zeros(16000 * 2, np.float32))\n"
            "import silero_vad, sys; assert 'silero_vad.model' in sys.modules\n"
            "print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "2"


@pytest.mark.parametrize("params, field", [
    ({"threshold": 2}, "threshold"), ({"threshold": 0}, "threshold"), ({"threshold": "0.5"}, "threshold"),
    ({"neg_threshold": 0.6}, "neg_threshold"), ({"min_silence_duration_ms": -1}, "min_silence_duration_ms"),
    ({"speech_pad_ms": math.nan}, "speech_pad_ms"), ({"max_speech_duration_s": 0}, "max_speech_duration_s"),
    ({"min_speech_duration_ms": True}, "min_speech_duration_ms"),
])
def test_vad_parameters_out_of_range_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=rf"vad_parameters\['{field}'\]"):
        TranscribeOptions(vad_filter=True, vad_parameters=params)


def test_vad_parameters_in_range_are_taken():
    for params in ({"threshold": 0.3, "neg_threshold": None, "max_speech_duration_s": math.inf, "speech_pad_ms": 0},
                   {"threshold": 0.6, "neg_threshold": 0.4}):
        assert TranscribeOptions(vad_filter=True, vad_parameters=params).vad_parameters == params
