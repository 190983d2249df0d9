"""Whisper transcription with speculative decoding (``ngram``): the same tokens,
text, timestamps and words as without it.

A Whisper window asks its tokens' processed log-probs (the fallback rule reads
their average) and its rows follow the timestamp and suppress rules, which read
the row's own output at each position. Speculation keeps both exact: each kept
token reports the log-prob the sampler would have reported
(``encdec.sample.draft_logprobs``), and each draft row gets the rules as at its
own position (``WhisperLogitsProcessor.apply_at``: the output grown by the
drafts before it). Fallback retries sample ``best_of`` > 1 sequences and so
run unspeculated (``n > 1``); language detection (allowed ids) too.
"""
from __future__ import annotations

import pytest
import torch

from encdec import LLM

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
KW = dict(num_threads=1, kv_cache_memory=128 * 2**20, swap_space=0.1)


def _all_free(llm: LLM) -> bool:
    free, _ = llm.llm_engine.num_free_blocks()
    return free == llm.llm_engine.cache_config.num_gpu_blocks


def _segments(transcriptions) -> list:
    return [[(s.text, list(s.tokens), s.start, s.end, s.temperature,
              None if s.words is None else [(w.start, w.end, w.word, round(w.probability, 4)) for w in s.words])
             for s in t.segments] for t in transcriptions]


def _processor(rules_isa):
    """A WhisperLogitsProcessor on a 40-token vocabulary: text ids 0-29 (eos
    25, no-timestamps 26), timestamps 30-39; suppressed 3 and 5, begin-suppressed 7."""
    from encdec.models.whisper_processors import WhisperLogitsProcessor

    proc = WhisperLogitsProcessor.__new__(WhisperLogitsProcessor)
    proc.device, proc.vocab = torch.device("cpu"), 40
    proc.sot, proc.eos, proc.no_ts, proc.ts_begin, proc.max_initial = 24, 25, 26, 30, 4
    proc.suppress_ids, proc.begin_ids = torch.tensor([3, 5]), torch.tensor([7])
    proc.rows, proc.rules_isa = {}, rules_isa
    return proc


@pytest.mark.parametrize("isa", ["torch", "c"])
def test_apply_at_gives_each_draft_row_the_rules_of_its_own_prefix(isa):
    """Row i of ``apply_at(logits, slots, ahead)`` equals ``apply`` on a row
    whose output really is ``output + ahead[i]``: timestamp pairs opened and
    closed by drafts, the monotonic lower bound moved by a draft timestamp,
    begin-suppress only at an empty output, a row without suppression."""
    from encdec.kernels.cpu import build, whisper_rules_cpu
    from encdec.models.whisper_processors import _Row

    if isa == "c" and not whisper_rules_cpu.available():
        pytest.skip("no C compiler for the Whisper rules")
    rules = build.cpu_isa() if isa == "c" else None
    proc = _processor(rules)
    proc.rows = {0: _Row([30, 11], True, True), 1: _Row([12], False, True), 2: _Row([], True, True),
                 3: _Row([9], False, False)}
    assert proc.slots_acted_on(5) == ()
    cases = [(0, []), (0, [12]), (0, [12, 33]), (0, [12, 33, 34]), (0, [35, 36]), (1, [3, 4]), (2, []),
             (2, [31]), (2, [31, 13]), (3, [5]), (9, [1])]  # slot 9: not tracked, no rule
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(cases), 40, generator=gen) * 3
    got = logits.clone()
    proc.apply_at(got, [s for s, _ in cases], [a for _, a in cases])
    for i, (slot, ahead) in enumerate(cases):
        ref = _processor(rules)
        if slot in proc.rows:
            r = proc.rows[slot]
            ref.rows = {0: _Row(r.output + ahead, r.timestamps, r.suppress)}
        want = ref.apply(logits[i:i + 1].clone())
        assert torch.equal(got[i:i + 1], want), (slot, ahead, got[i], want)
    assert torch.isinf(got[2, :30]).all()  # an empty timestamped output: a timestamp first


def _doubled(audio, n: int) -> list:
    """Clips each said twice in one window (a half-second pause between): the
    second saying repeats the first's tokens, so drafts copied from the
    window's own output are kept."""
    import numpy as np

    pause = np.zeros(8000, np.float32)
    return [(np.concatenate([a, pause, a]), 16000) for a in audio[:n]]


def _same_with_speculation(model_dir: str, clips: list, **opts) -> LLM:
    """Transcribe ``clips`` without and with speculation: every segment's text,
    tokens, times, temperature and words agree, the average log-probs to float
    rounding. Returns the speculating engine."""
    want = LLM(model_dir, **KW).transcribe(clips, use_tqdm=False, **opts)
    llm = LLM(model_dir, **KW, speculative_config=SPEC)
    got = llm.transcribe(clips, use_tqdm=False, **opts)
    assert _segments(got) == _segments(want)
    for t, w in zip(got, want):
        for s, r in zip(t.segments, w.segments):
            assert s.avg_logprob == pytest.approx(r.avg_logprob, abs=1e-4)
    assert _all_free(llm)
    return llm


def test_shipped_clip_transcribes_the_same_with_speculation(ct2_dir, speech_clips):
    """tiny.en (real weights), a shipped clip said twice, timestamps on: drafts
    are tried and kept on its rows, and the output is the one without them."""
    llm = _same_with_speculation(str(ct2_dir), _doubled(speech_clips[2], 1), timestamps=True)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 5


@pytest.mark.slow
def test_word_timestamps_unchanged_by_speculation(ct2_dir, speech_clips):
    llm = _same_with_speculation(str(ct2_dir), _doubled(speech_clips[2], 3), timestamps=True, word_timestamps=True)
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 10


@pytest.mark.slow
def test_long_form_transcribes_the_same_with_speculation(ct2_dir, speech_clips):
    """Sequential long-form (timestamps, previous-text prompts, seeks) on a
    minute of shipped clips with pauses, k 1 and 5: the same segments."""
    from benchmarks.whisper_longform import build_file

    _, texts, audio = speech_clips
    wav, _ = build_file(audio, texts, seed=0, minutes=1.0)
    want = _segments(LLM(str(ct2_dir), **KW).transcribe([(wav, 16000)], use_tqdm=False))
    for k in (1, 5):
        llm = LLM(str(ct2_dir), **KW, speculative_config={**SPEC, "num_speculative_tokens": k})
        assert _segments(llm.transcribe([(wav, 16000)], use_tqdm=False)) == want
        assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
        assert _all_free(llm)


def test_independent_long_form_transcribes_the_same_with_speculation(ct2_dir, speech_clips):
    """Independent long-form (windows decoded side by side, no timestamps) on a
    minute of shipped clips: the same segments with drafts tried."""
    from benchmarks.whisper_longform import build_file

    _, texts, audio = speech_clips
    wav, _ = build_file(audio, texts, seed=0, minutes=1.0)
    opts = dict(mode="independent", timestamps=False, use_tqdm=False)
    want = _segments(LLM(str(ct2_dir), **KW).transcribe([(wav, 16000)], **opts))
    llm = LLM(str(ct2_dir), **KW, speculative_config=SPEC)
    assert _segments(llm.transcribe([(wav, 16000)], **opts)) == want
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    assert _all_free(llm)
