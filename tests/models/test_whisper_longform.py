"""The sequential long-form algorithm (``mode="sequential"``) against HF
``generate`` long-form on the same weights, and its fallback / no-speech /
prompt rules. Real weights: tiny.en (``ct2_dir``) and multilingual base
(``whisper_base_dir``); audio built from the shipped clips, nothing downloaded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from encdec import SamplingParams
from encdec.transcription.driver import run_jobs
from encdec.transcription import SequentialJob, TranscribeOptions

TEMPS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
RULES = {"compression_ratio_threshold": 2.4, "log_prob_threshold": -1.0, "no_speech_threshold": 0.6}


def long_file(wavs, gap_s: float = 2.0) -> np.ndarray:
    gap = np.zeros(int(16000 * gap_s), np.float32)
    return np.concatenate([x for w in wavs for x in (w, gap)])


def hf_longform(hf, audio: np.ndarray, **kw) -> list[tuple[float, float, list[int]]]:
    """HF long-form ``generate`` (timestamps, conditioning, fallback thresholds):
    (start, end, tokens) per segment. Audio of <= 30 s gets HF's short-form
    features (padded to 30 s), as ours does."""
    model, proc = hf
    long = len(audio) > 30 * 16000
    feats = proc.feature_extractor(audio, sampling_rate=16000, return_tensors="pt", truncation=not long,
                                   padding="longest" if long else "max_length", return_attention_mask=True)
    kw = {"temperature": TEMPS, **kw}
    with torch.inference_mode():
        out = model.generate(feats.input_features, attention_mask=feats.attention_mask, return_timestamps=True,
                             return_segments=True, condition_on_prev_tokens=True,
                             compression_ratio_threshold=2.4, logprob_threshold=-1.0, no_speech_threshold=0.6,
                             **kw)
    return [(round(float(s["start"]), 2), round(float(s["end"]), 2), s["tokens"].tolist())
            for s in out["segments"][0]]


def ours(llm, audio: np.ndarray, **kw) -> tuple[list[tuple[float, float, list[int]]], object]:
    kw = {"temperature": TEMPS, **kw}
    (t,) = llm.transcribe((audio, 16000), condition_on_previous_text=True, use_tqdm=False, **RULES, **kw)
    assert all(s.temperature == 0.0 for s in t.segments)  # exactness is at temperature 0
    return [(round(s.start, 2), round(s.end, 2), s.tokens) for s in t.segments], t


def _hf(out: str):
    from transformers import WhisperForConditionalGeneration as HFWhisper
    from transformers import WhisperProcessor

    return HFWhisper.from_pretrained(out).eval(), WhisperProcessor.from_pretrained(out)


@pytest.fixture(scope="module")
def tiny(ct2_dir):
    from encdec import LLM

    return LLM(model=str(ct2_dir), num_threads=2, kv_cache_memory=512 * 2**20, swap_space=0.1)


@pytest.fixture(scope="module")
def tiny_hf(whisper_tiny_hf_dir):
    return _hf(whisper_tiny_hf_dir)


def test_longform_matches_hf_tiny_en(tiny, tiny_hf, speech_clips):
    _, _, wavs = speech_clips
    audio = long_file(wavs)
    assert len(audio) / 16000 >= 180
    want = hf_longform(tiny_hf, audio)
    got, t = ours(tiny, audio)
    print(f"\n{len(audio) / 16000:.0f} s, {len(got)} segments; first: {t.segments[0].text!r}")
    assert got == want


@pytest.mark.slow  # lean default run: `make test-all` runs it
def test_longform_matches_hf_base(whisper_base_dir, whisper_base_hf_dir, speech_clips):
    """The same >= 3-minute file as tiny.en (base is ~5x slower on this CPU)."""
    from encdec import LLM

    _, _, wavs = speech_clips
    audio = long_file(wavs)
    assert len(audio) / 16000 >= 180
    hf = _hf(whisper_base_hf_dir)
    llm = LLM(model=whisper_base_dir, num_threads=2, kv_cache_memory=256 * 2**20, swap_space=0.1)
    want = hf_longform(hf, audio, language="en", task="transcribe")
    got, t = ours(llm, audio, language="en")
    assert got == want
    # Detected (not given) language: the same tokens, English with high probability.
    got_detect, t = ours(llm, audio)
    assert t.language == "en" and t.language_probability > 0.5
    assert got_detect == want


def _job(llm, audio, **kw) -> tuple[SequentialJob, object]:
    engine = llm.llm_engine
    job = SequentialJob(engine, (audio, 16000), TranscribeOptions(**kw))
    (t,) = run_jobs(engine, [job], use_tqdm=False)
    return job, t


def test_fallback_retries_hotter_on_one_encoder_pass(tiny, speech_clips):
    """A threshold the greedy output of a real sentence exceeds (ratio ~0.97 >
    0.5): every attempt is retried up to the last temperature, which the segment
    shows; the window's features are one tensor for every attempt."""
    _, _, wavs = speech_clips
    job, t = _job(tiny, wavs[3], compression_ratio_threshold=0.5, no_speech_threshold=None,
                  sampling_params=SamplingParams(seed=7))
    assert t.segments and all(s.temperature == 1.0 for s in t.segments)
    assert job.num_requests == len(TEMPS)  # one window, six attempts
    greedy_job, g = _job(tiny, wavs[3], no_speech_threshold=None)
    assert greedy_job.num_requests == 1 and g.segments[0].temperature == 0.0
    if not job.encoder_cache_reported:
        pytest.skip("no encoder cache in this build (issue 14): every attempt runs the encoder "
                    f"({job.encoder_passes} passes for {job.num_requests} requests)")
    assert job.encoder_passes == 1


@pytest.fixture(scope="module")
def fw_tiny(ct2_dir):
    fw = pytest.importorskip("faster_whisper")
    return fw.WhisperModel(str(ct2_dir), device="cpu", compute_type="float32", cpu_threads=2)


@pytest.mark.parametrize("silence", ["zeros", "noise"])
def test_silence_is_judged_as_faster_whisper_judges_it(tiny, fw_tiny, speech_clips, silence):
    """35 s of silence, then a sentence. The fallback rule scores an attempt on the
    log-probs after the Whisper processors (HF's and openai/whisper's), so digital
    silence keeps tiny.en's "you" (average -0.81, above the -1.0 threshold) as
    faster-whisper and HF do, while faint noise is skipped by the no-speech rule.
    Segments, average log-probs and no-speech probabilities equal faster-whisper's
    (with ``skip_digital_silence=False``: by default the zeros are not decoded)."""
    _, _, wavs = speech_clips
    quiet = (np.zeros(16000 * 35, np.float32) if silence == "zeros"
             else np.random.default_rng(0).normal(0, 3e-4, 16000 * 35).astype(np.float32))
    audio = np.concatenate([quiet, wavs[3]])
    job, t = _job(tiny, audio, skip_digital_silence=False)
    want, _ = fw_tiny.transcribe(audio, beam_size=1)
    want = list(want)
    assert [(s.start, s.end, s.text) for s in t.segments] == [(s.start, s.end, s.text.strip()) for s in want]
    for a, b in zip(t.segments, want):
        assert abs(a.avg_logprob - b.avg_logprob) < 0.01 and abs(a.no_speech_prob - b.no_speech_prob) < 0.01
    assert job.windows_skipped == (1 if silence == "noise" else 0)
    assert all(s.start >= 30.0 for s in t.segments) == (silence == "noise") and "leave the room" in t.text
    off, _ = _job(tiny, audio, no_speech_threshold=None, skip_digital_silence=False)
    assert off.windows_skipped == 0


def test_fallback_rules_are_faster_whispers():
    """The compression ratio is over the text (a repeated phrase fails 2.4; HF's
    token-id measure gives such a window 2.0), and when every temperature fails
    the best average log-prob under the ratio threshold is taken."""
    from encdec.transcription.rules import best_attempt, compression_ratio

    assert compression_ratio("She's a little bit " * 13) > 2.4 > compression_ratio(
        "Please remember to turn off the lights when you leave the room.")
    assert compression_ratio("") == 0.0
    attempts = [([1], -1.5, 3.0), ([2], -1.2, 1.1), ([3], -1.4, 1.0), ([4], -0.9, 2.6)]
    assert best_attempt(attempts, 2.4) == ([2], -1.2, 1.1)
    assert best_attempt(attempts, None) == ([4], -0.9, 2.6)
    assert best_attempt(attempts[:1], 2.4) == ([1], -1.5, 3.0)


def test_bad_options():
    with pytest.raises(ValueError, match="beam_size"):
        TranscribeOptions(beam_size=0)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="best_of"):
            TranscribeOptions(best_of=bad)
    with pytest.raises(ValueError, match="temperature"):
        TranscribeOptions(temperature=(0.0, 3.0))
    with pytest.raises(ValueError, match="mode"):
        TranscribeOptions(mode="parallel")
    with pytest.raises(ValueError, match="clip_timestamps"):
        TranscribeOptions(clip_timestamps=[5.0, 1.0])


def _window_prompt_ids(llm, audio, **kw) -> list[int]:
    job = SequentialJob(llm.llm_engine, (audio, 16000), TranscribeOptions(**kw))
    (req,) = job.next_requests()  # the window (it carries the no-speech query too)
    return list(req.prompt["decoder_prompt"]["prompt_token_ids"])


@pytest.mark.parametrize("option", [{}, {"initial_prompt": "Seashells, SEASHELLS."}, {"prefix": "Please remember"},
                                    {"hotwords": "lights room"}, {"hotwords": "lights", "prefix": "Please"},
                                    {"hotwords": "lights", "initial_prompt": "Turn them off."}])
def test_prompts_follow_faster_whisper_get_prompt(tiny, ct2_dir, speech_clips, option):
    """The first window's decoder prompt is faster-whisper's ``get_prompt`` for the
    same options (previous tokens = the initial prompt), and each option changes
    the decoding."""
    import os
    from types import SimpleNamespace

    fw = pytest.importorskip("faster_whisper", reason="pip install faster-whisper (test extra)")
    from faster_whisper.tokenizer import Tokenizer
    from tokenizers import Tokenizer as HFTokenizer

    _, _, wavs = speech_clips
    tok = Tokenizer(HFTokenizer.from_file(os.path.join(str(ct2_dir), "tokenizer.json")), False, task="transcribe",
                    language="en")
    previous = tok.encode(" " + option["initial_prompt"].strip()) if "initial_prompt" in option else []
    want = fw.transcribe.WhisperModel.get_prompt(SimpleNamespace(max_length=448), tok, previous,
                                                 without_timestamps=False, prefix=option.get("prefix"),
                                                 hotwords=option.get("hotwords"))
    assert _window_prompt_ids(tiny, wavs[3], **option) == want
    if option:
        plain = tiny.transcribe((wavs[3], 16000), use_tqdm=False)[0]
        got = tiny.transcribe((wavs[3], 16000), use_tqdm=False, **option)[0]
        assert got.segments[0].tokens != plain.segments[0].tokens or got.text != plain.text
        if "prefix" in option:
            assert got.text.startswith(option["prefix"])


def _attempt_output(ids: list[int], logprob: float, prompt_token_logprobs=None, *, samples=()):
    """A finished engine output whose every token has log-prob ``logprob``;
    ``samples``: more (ids, logprob) completions of the same request (n > 1)."""
    from encdec.outputs import CompletionOutput, RequestOutput
    from encdec.sequence import Logprob

    done = [CompletionOutput(i, "", x, lp * len(x), [{t: Logprob(lp)} for t in x], "stop")
            for i, (x, lp) in enumerate([(ids, logprob), *samples])]
    return RequestOutput("fake", None, [], None, [], done, finished=True,
                         prompt_token_logprobs=prompt_token_logprobs)


def test_retries_go_one_then_the_rest_at_once_judged_in_ladder_order(tiny):
    """The first failed attempt asks for the next temperature alone, the second
    for every remaining temperature at once; the window is decided on the first
    temperature, in ladder order, whose attempt passes (not the first to come
    back), the attempts still running are abandoned, and a late output of one of
    them is ignored."""
    from encdec.models.whisper_tokens import WhisperSpecialTokens

    ids = WhisperSpecialTokens.of(tiny.llm_engine.generation_config)
    tb, eot = ids.timestamp_begin, ids.eot
    window = [tb, 440, 1000, 2000, tb + 100, eot]  # one segment, 0-2 s; then the window is done
    good, bad = -0.1, -3.0  # average log-prob above / below log_prob_threshold (-1)
    job = SequentialJob(tiny.llm_engine, (np.zeros(16000 * 5, np.float32), 16000),  # placeholder audio
                        TranscribeOptions(best_of=1, skip_digital_silence=False))
    (greedy,) = job.next_requests()  # P(no speech) comes with the first attempt: no probe request
    asked = greedy.params.prompt_token_logprobs
    assert list(asked.values()) == [[ids.no_timestamps - 1]]
    sot_at = list(asked)[0]
    assert greedy.prompt["decoder_prompt"]["prompt_token_ids"][sot_at] == ids.sot
    job.add_output(_attempt_output(window, bad, {sot_at: {ids.no_timestamps - 1: np.log(0.01)}}), greedy.ticket)
    (first,) = job.next_requests()  # the first retry goes alone
    assert first.params.temperature == TEMPS[1] and first.params.n == 1
    job.add_output(_attempt_output(window, bad), first.ticket)
    assert not job.segments and job.abandoned_tickets() == []
    retries = job.next_requests()
    assert [r.params.temperature for r in retries] == list(TEMPS[2:])
    assert all(r.params.n == 1 for r in retries)
    by_temp = {r.params.temperature: r.ticket for r in retries}
    job.add_output(_attempt_output(window, good), by_temp[0.6])  # passes, but 0.4 comes first
    assert not job.segments and job.abandoned_tickets() == []
    job.add_output(_attempt_output(window, good), by_temp[0.4])
    assert sorted(job.abandoned_tickets()) == sorted([by_temp[0.8], by_temp[1.0]])
    assert job.done and job.next_requests() == []
    job.add_output(_attempt_output(window, good), by_temp[0.8])  # finished before its abort landed
    (seg,) = job.result().segments
    assert seg.temperature == 0.4 and seg.tokens == window[:-1] and (seg.start, seg.end) == (0.0, 2.0)
    assert seg.no_speech_prob == pytest.approx(0.01)
    with pytest.raises(ValueError, match="ticket"):
        job.add_output(_attempt_output(window, good), 999)


def test_best_of_samples_each_retry_and_keeps_the_most_likely(tiny):
    """``best_of=5`` (faster-whisper's default): each retry is one request
    sampling 5 sequences at its temperature (greedy stays one), and the sample
    kept is the one with the best log-prob per token before eot (openai/whisper's
    ranker), not the first nor the best sum; the segment shows its tokens and
    average log-prob."""
    from encdec.models.whisper_tokens import WhisperSpecialTokens

    ids = WhisperSpecialTokens.of(tiny.llm_engine.generation_config)
    tb, eot = ids.timestamp_begin, ids.eot
    short, long_ = [tb, 440, tb + 100, eot], [tb, 440, 1000, 2000, tb + 100, eot]
    job = SequentialJob(tiny.llm_engine, (np.zeros(16000 * 5, np.float32), 16000),  # placeholder audio
                        TranscribeOptions(skip_digital_silence=False))
    (greedy,) = job.next_requests()
    assert greedy.params.n == 1 and greedy.params.temperature == 0.0
    (sot_at, (no_speech,)), = greedy.params.prompt_token_logprobs.items()
    job.add_output(_attempt_output(long_, -3.0, {sot_at: {no_speech: np.log(0.01)}}), greedy.ticket)
    (first,) = job.next_requests()
    assert first.params.temperature == 0.2 and first.params.n == 5
    job.add_output(_attempt_output(long_, -3.0, samples=[(short, -2.5)] * 4), first.ticket)
    assert not job.segments  # every sample at 0.2 failed
    retries = {r.params.temperature: r for r in job.next_requests()}
    assert sorted(retries) == list(TEMPS[2:]) and {r.params.n for r in retries.values()} == {5}
    # sums: short -2.0 (the best), long -2.7; per token before eot: short -0.67, long -0.54
    samples = [(short, -0.5), (long_, -0.45), (short, -0.6), (long_, -0.9)]
    job.add_output(_attempt_output(long_, -2.0, samples=samples), retries[0.4].ticket)
    assert sorted(job.abandoned_tickets()) == sorted(retries[t].ticket for t in TEMPS[3:])
    (seg,) = job.result().segments
    assert seg.temperature == 0.4 and seg.tokens == long_[:-1]
    assert seg.avg_logprob == pytest.approx(-0.45)


def test_a_beam_attempt_reports_no_speech_itself(tiny, speech_clips):
    """With beams the window's first attempt is a beam request; it asks for
    P(no speech) itself, as a greedy one does: no probe request."""
    from encdec import BeamSearchParams
    from encdec.models.whisper_tokens import WhisperSpecialTokens

    ids = WhisperSpecialTokens.of(tiny.llm_engine.generation_config)
    _, _, wavs = speech_clips
    job = SequentialJob(tiny.llm_engine, (wavs[3], 16000), TranscribeOptions(beam_size=2))
    (first,) = job.next_requests()
    assert isinstance(first.params, BeamSearchParams)
    (pos, tokens), = first.params.prompt_token_logprobs.items()
    assert tokens == [ids.no_timestamps - 1] and first.prompt["decoder_prompt"]["prompt_token_ids"][pos] == ids.sot
    (seg, *_) = tiny.transcribe((wavs[3], 16000), beam_size=2, use_tqdm=False)[0].segments
    assert 0.0 <= seg.no_speech_prob < 0.5


def test_parallel_retries_choose_as_one_at_a_time_and_free_their_blocks(tiny, speech_clips):
    """Through the engine, seeded: a compression-ratio threshold (0.969) that the
    greedy output's text (0.9692) and the seeded attempts at 0.2-0.6 fail and the
    one at 0.8 passes (0.9688). The window takes the 0.8 attempt, token for token the one
    a ladder that stops at 0.8 takes; what the job abandoned is aborted, nothing
    stays queued and every KV block is free."""
    _, _, wavs = speech_clips
    engine = tiny.llm_engine
    kw = dict(compression_ratio_threshold=0.969, log_prob_threshold=None, no_speech_threshold=None,
              best_of=1, sampling_params=SamplingParams(seed=30))
    job, t = _job(tiny, wavs[3], **kw)
    assert [s.temperature for s in t.segments] == [0.8] and job.num_requests == len(TEMPS)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    _, ladder = _job(tiny, wavs[3], temperature=TEMPS[:5], **kw)
    assert [s.tokens for s in ladder.segments] == [s.tokens for s in t.segments]
