"""The transcription job protocol on real tiny.en weights: jobs driven by hand
equal ``LLM.transcribe``; a bad input refuses the whole call and leaves the
engine empty; a failure mid-run aborts what the call queued; the driver uses
only the engine's public methods; each input is decoded once."""
from __future__ import annotations

import glob
import os
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from encdec import SamplingParams
from encdec.transcription.offline import _as_inputs
from encdec.transcription import TranscribeOptions, TranscriptionJob

torch.set_num_threads(1)
SPEECH = os.path.join(os.path.dirname(__file__), "..", "data", "speech")
MAX_STEPS = 3000  # bound on engine steps in the hand-driven loop


@pytest.fixture(scope="module")
def llm(ct2_dir):
    from encdec import LLM

    return LLM(model=str(ct2_dir), num_threads=1, kv_cache_memory=256 * 2**20, swap_space=0.1)


@pytest.fixture(scope="module")
def clips():
    import soundfile as sf

    files = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))
    return files, [sf.read(f, dtype="float32")[0] for f in files]


@pytest.fixture(scope="module")
def long_wav(clips):
    """~45 s of speech with pauses: two windows."""
    _, wavs = clips
    gap = np.zeros(16000, np.float32)
    out = np.concatenate([x for w in wavs[:12] for x in (w, gap)])
    return out[: 16000 * 45]


def assert_engine_empty(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


def test_jobs_driven_by_hand_equal_transcribe(llm, clips, long_wav):
    files, _ = clips
    engine = llm.llm_engine
    audios = [(long_wav, 16000), files[3]]
    options = TranscribeOptions(timestamps=True)
    options.validate(engine)
    jobs = [TranscriptionJob(engine, a, options, index=i) for i, a in enumerate(audios)]
    assert jobs[0].duration == pytest.approx(45.0) and 3 < jobs[1].duration < 5
    in_flight = {}

    def submit(job):
        for req in job.next_requests():
            rid = f"by-hand-{job.index}-{req.ticket}"
            engine.add_request(rid, req.prompt, req.params)
            in_flight[rid] = (job, req.ticket)

    for job in jobs:
        submit(job)
    assert len(in_flight) == 3  # two windows of the long file, one of the clip
    assert all(job.next_requests() == [] for job in jobs)  # each request is handed out once
    assert not any(job.done for job in jobs) and jobs[0].seconds_done == 0.0
    with pytest.raises(RuntimeError, match="before the job is done"):
        jobs[0].result()
    last = None
    for _ in range(MAX_STEPS):
        if not in_flight:
            break
        for out in engine.step():
            job, ticket = in_flight.pop(out.request_id)
            job.add_output(out, ticket)
            submit(job)
            last = (job, out)
    assert not in_flight and all(job.done for job in jobs)
    assert [job.seconds_done for job in jobs] == [job.duration for job in jobs]
    ours = [job.result() for job in jobs]
    assert ours == llm.transcribe(audios, timestamps=True, use_tqdm=False, mode="independent")
    assert "lights" in ours[1].text.lower() and len(ours[0].segments) >= 4
    assert ours[0].duration == jobs[0].duration and ours[0].language == "en"
    with pytest.raises(ValueError, match="not an open request"):
        last[0].add_output(last[1], 0)
    assert_engine_empty(llm)


def test_bad_input_in_a_list_refuses_the_call(llm, clips, tmp_path):
    files, wavs = clips
    with pytest.raises(ValueError, match=r"audio input 1: .*does not exist"):
        llm.transcribe([files[0], str(tmp_path / "missing.wav"), files[1]], use_tqdm=False)
    assert_engine_empty(llm)
    with pytest.raises(ValueError, match=r"audio input 2: .*NaN"):
        llm.transcribe([files[0], wavs[1], (np.full(100, np.nan, np.float32), 16000)], use_tqdm=False)
    assert_engine_empty(llm)
    from encdec import SamplingParams

    with pytest.raises(ValueError, match=r"allowed_token_ids token ids must be in"):
        llm.transcribe(files[0], sampling_params=SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(TypeError, match="timestamps must be a bool"):
        llm.transcribe(files[0], timestamps="yes", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be a str"):
        llm.transcribe(files[0], prompt=3, use_tqdm=False)
    assert_engine_empty(llm)


class PublicEngine:
    """The engine seen through its public request API only; anything else raises."""

    PUBLIC = {"tokenizer", "hf_config", "generation_config", "process_request", "process_requests",
              "add_processed_request", "step", "abort_request", "has_unfinished_requests"}

    def __init__(self, engine, fail_at_step: int | None = None):
        self._engine, self._fail_at_step, self.used, self.steps = engine, fail_at_step, Counter(), 0

    def __getattr__(self, name):
        if name not in self.PUBLIC:
            raise AttributeError(f"transcribe reached LLMEngine.{name}, outside the public request API")
        self.used[name] += 1
        return getattr(self._engine, name)

    def step(self):
        self.used["step"] += 1
        self.steps += 1
        if self.steps == self._fail_at_step:
            raise KeyboardInterrupt("stopped mid-run")
        return self._engine.step()


def test_transcribe_uses_only_public_engine_methods(llm, clips, long_wav):
    from encdec.transcription.offline import transcribe

    files, _ = clips
    engine = PublicEngine(llm.llm_engine)
    stand_in = SimpleNamespace(llm_engine=engine)  # no generate, no _generate, no counters
    audios = [files[2], (long_wav, 16000)]
    assert transcribe(stand_in, audios, use_tqdm=False, mode="independent") == \
        llm.transcribe(audios, use_tqdm=False, mode="independent")
    assert engine.used["add_processed_request"] == 3 and engine.used["step"] > 0
    assert set(engine.used) <= PublicEngine.PUBLIC
    root = os.path.join(os.path.dirname(__file__), "..", "..", "encdec")
    for path in glob.glob(os.path.join(root, "transcription", "**", "*.py"), recursive=True):
        src = open(path).read()
        assert not re.search(r"\b(llm|engine)\._", src), path
        assert "request_counter" not in src, path


def test_failure_mid_run_aborts_what_the_call_queued(llm, long_wav):
    from encdec.transcription.offline import transcribe

    engine = PublicEngine(llm.llm_engine, fail_at_step=3)
    with pytest.raises(KeyboardInterrupt):
        transcribe(SimpleNamespace(llm_engine=engine), [(long_wav, 16000)] * 2, use_tqdm=False)
    assert engine.used["abort_request"] == 1
    assert_engine_empty(llm)
    assert llm.transcribe((long_wav[:16000 * 5], 16000), use_tqdm=False)[0].text  # the engine still works


def test_each_input_decoded_once(llm, clips, long_wav, monkeypatch):
    """A path is read once and a 44.1 kHz array resampled once; the windows go to
    the engine as 16 kHz arrays and are never read or resampled again."""
    import librosa

    files, _ = clips
    at_44k = librosa.resample(long_wav, orig_sr=16000, target_sr=44100)
    calls = Counter()
    real_load, real_resample = librosa.load, librosa.resample

    def load(*a, **kw):
        calls["load"] += 1
        return real_load(*a, **kw)

    def resample(*a, **kw):
        calls["resample"] += 1
        return real_resample(*a, **kw)

    monkeypatch.setattr(librosa, "load", load)
    monkeypatch.setattr(librosa, "resample", resample)
    results = llm.transcribe([files[3], (at_44k, 44100)], use_tqdm=False, mode="independent")
    assert calls == {"load": 1, "resample": 1}
    assert len(results[1].segments) == 2 and "lights" in results[0].text.lower()


def test_input_forms():
    a = np.zeros(10, np.float32)
    assert len(_as_inputs((a, 16000.0))) == 1 and len(_as_inputs((a, np.int64(8000)))) == 1
    assert len(_as_inputs((a, a))) == 2 and len(_as_inputs((a, True))) == 2
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        TranscribeOptions(sampling_params={"temperature": 0})


def test_transcribe_takes_a_transcribe_options_or_its_fields_by_keyword(llm, clips):
    files, _ = clips
    options = TranscribeOptions(mode="independent", timestamps=True)
    by_options = llm.transcribe(files[0], options, use_tqdm=False)
    assert by_options == llm.transcribe(files[0], mode="independent", timestamps=True, use_tqdm=False)
    assert by_options[0].text.strip() and by_options[0].segments[0].end > 0
    with pytest.raises(TypeError, match="not both"):
        llm.transcribe(files[0], options, mode="sequential")
    with pytest.raises(TypeError, match="options must be a TranscribeOptions, got dict"):
        llm.transcribe(files[0], {"mode": "independent"})
    with pytest.raises(TypeError, match="beam_sise"):
        llm.transcribe(files[0], beam_sise=2)
    with pytest.raises(ValueError, match="initial_prompt or its older name prompt"):
        llm.transcribe(files[0], prompt="a", initial_prompt="b")
    assert_engine_empty(llm)


def _output(tokenizer, eot: int, text: str | None, logprob: float, n: int = 1):
    """A finished output of ``n`` samples of ``text`` (None: no text), each token at ``logprob``."""
    from encdec.outputs import CompletionOutput, RequestOutput
    from encdec.sequence import Logprob

    ids = (tokenizer.encode(text, add_special_tokens=False) if text else []) + [eot]
    samples = [CompletionOutput(i, text or "", ids, logprob * len(ids), [{t: Logprob(logprob)} for t in ids], "stop")
               for i in range(n)]
    return RequestOutput("x", None, [], None, [], samples, True)


def test_an_independent_window_that_repeats_itself_is_decoded_again(llm, clips):
    """mode="independent" retries a window as the sequential mode does
    (``rules.needs_fallback``): an attempt whose text repeats itself (compression
    ratio above 2.4) or averages below the log-prob threshold is asked again at
    the next temperature (best_of samples), the first that passes is kept; when
    every temperature fails, ``best_attempt``'s. An attempt of no text is kept; a
    caller's ``sampling_params`` or a single temperature turn the ladder off."""
    files, _ = clips
    engine = llm.llm_engine
    tok, eot = engine.tokenizer, engine.generation_config.eos_token_id
    loop, good = " She sells" + " S-E" * 80, " She sells sea shells by the sea shore."

    def job_for(**kw):
        options = TranscribeOptions(mode="independent", **kw)
        options.validate(engine)
        job = TranscriptionJob(engine, files[3], options)
        (req,) = job.next_requests()
        return job, req

    job, req = job_for()
    assert req.params.temperature == 0.0 and req.params.logprobs == 0  # the average needs the log-probs
    job.add_output(_output(tok, eot, loop, -0.1), req.ticket)
    (retry,) = job.next_requests()
    assert retry.params.temperature == 0.2 and retry.params.n == 5 and not job.done
    job.add_output(_output(tok, eot, good, -0.2, n=5), retry.ticket)
    assert job.done and job.result().text == good.strip()

    job, req = job_for()  # unlikely (average -1.5 < -1.0) at every temperature: the best of them
    for i, lp in enumerate([-1.5, -1.2, -2.0, -3.0, -1.9, -2.5]):
        job.add_output(_output(tok, eot, f" attempt {i}", lp, n=req.params.n), req.ticket)
        if i < 5:
            (req,) = job.next_requests()
    assert job.done and job.result().text == "attempt 1"

    job, req = job_for()  # no text: kept, whatever its log-prob
    job.add_output(_output(tok, eot, None, -5.0), req.ticket)
    assert job.done and job.next_requests() == [] and job.result().text == ""

    for kw in ({"temperature": (0.0,)}, {"sampling_params": SamplingParams(temperature=0.0)}):
        job, req = job_for(**kw)
        job.add_output(_output(tok, eot, loop, -0.1), req.ticket)
        assert job.done and job.result().text == loop.strip(), kw
