"""``/v1/audio/*`` through the official ``openai`` client equals ``LLM.transcribe``."""
from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from encdec.entrypoints.openai.serving_transcription import SEGMENT_FIELDS
from encdec.transcription import format_transcription

from .conftest import SPEECH

CLIP = SPEECH / "s00.wav"


@pytest.fixture()
def wclient(whisper_server):
    from openai import OpenAI

    return OpenAI(base_url=whisper_server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("path", [CLIP, "long"], ids=["short", "long"])
def test_formats_equal_transcribe(wclient, whisper_llm, long_wav, path):
    path = long_wav if path == "long" else path
    plain = whisper_llm.transcribe(str(path), use_tqdm=False)[0]
    stamped = whisper_llm.transcribe(str(path), timestamps=True, use_tqdm=False)[0]
    with open(path, "rb") as f:
        data = f.read()

    def create(fmt):
        return wclient.audio.transcriptions.create(model="tiny.en", file=(path.name, data), response_format=fmt)

    assert create("json").text == plain.text
    text, srt, vtt = create("text"), create("srt"), create("vtt")
    assert all(isinstance(x, str) for x in (text, srt, vtt))  # the SDK's str for text/plain
    assert text == format_transcription(plain, "txt")
    assert srt == format_transcription(stamped, "srt")
    assert vtt == format_transcription(stamped, "vtt")
    verbose = create("verbose_json")
    assert verbose.text == stamped.text and verbose.language == "english" and verbose.words is None
    assert_same_segments(verbose.segments, stamped.segments)
    import soundfile as sf

    assert verbose.duration == pytest.approx(sf.info(str(path)).duration, abs=1e-3)
    if path == long_wav:
        assert len(stamped.segments) > 1 and stamped.segments[-1].end > 30


def assert_same_segments(served, offline) -> None:
    """OpenAI's segment fields equal: ids, tokens, times and text exactly; the
    scores within float noise (the server's encoder cache may hand a window the
    cross K/V an earlier request computed in another batch)."""
    assert len(served) == len(offline)
    for i, (a, b) in enumerate(zip(served, offline)):
        for f in SEGMENT_FIELDS:
            want = i if f == "id" else getattr(b, f)
            if f in ("avg_logprob", "compression_ratio", "no_speech_prob"):
                assert getattr(a, f) == pytest.approx(want, rel=1e-4, abs=1e-5), (i, f)
            else:
                assert getattr(a, f) == want, (i, f)
    assert all(s.temperature == 0.0 for s in offline)  # no sampled retry: both sides deterministic


def test_word_granularity_equals_transcribe(wclient, whisper_llm, long_wav):
    """A multi-window file: OpenAI's top-level ``words`` ({word, start, end}) are
    ``LLM.transcribe(word_timestamps=True)``'s words; segments only when asked too."""
    ref = whisper_llm.transcribe(str(long_wav), timestamps=True, word_timestamps=True, use_tqdm=False)[0]
    want = [(w.word.strip(), w.start, w.end) for s in ref.segments for w in s.words]
    assert len(want) > 50 and ref.segments[-1].end > 30
    data = long_wav.read_bytes()
    words = wclient.audio.transcriptions.create(model="tiny.en", file=(long_wav.name, data),
                                                response_format="verbose_json", timestamp_granularities=["word"])
    assert words.segments is None and words.text == ref.text
    assert [(w.word, w.start, w.end) for w in words.words] == want
    both = wclient.audio.transcriptions.create(model="tiny.en", file=(long_wav.name, data),
                                               response_format="verbose_json",
                                               timestamp_granularities=["word", "segment"])
    assert [(w.word, w.start, w.end) for w in both.words] == want
    assert_same_segments(both.segments, ref.segments)


def test_temperature_is_whisper_fallback_or_one_temperature(wclient, whisper_llm):
    """0: the fallback ladder (as LLM.transcribe's default; a clean clip stays at 0);
    t > 0: every window decoded at t, never retried elsewhere."""
    clip = SPEECH / "s03.wav"
    data = clip.read_bytes()
    ladder = wclient.audio.transcriptions.create(model="tiny.en", file=(clip.name, data),
                                                 response_format="verbose_json", temperature=0.0)
    ref = whisper_llm.transcribe(str(clip), timestamps=True, use_tqdm=False)[0]
    assert_same_segments(ladder.segments, ref.segments)
    hot = wclient.audio.transcriptions.create(model="tiny.en", file=(clip.name, data),
                                              response_format="verbose_json", temperature=0.7)
    assert hot.segments and all(s.temperature == pytest.approx(0.7) for s in hot.segments)


def test_stream_events(wclient, whisper_llm, long_wav):
    ref = whisper_llm.transcribe(str(long_wav), use_tqdm=False)[0]
    with open(long_wav, "rb") as f:
        events = list(wclient.audio.transcriptions.create(model="tiny.en", file=f, stream=True))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == ref.text
    assert "".join(d.delta for d in deltas) == ref.text
    assert deltas and all(d.delta for d in deltas)  # per window, as windows finish in order
    # The audio counts by its length (50 encoder positions a second), though this
    # server's encoder cache already holds the file's windows from earlier tests.
    usage = done.usage
    assert usage.input_token_details.audio_tokens == round(50 * ref.duration)
    assert usage.input_tokens == usage.input_token_details.audio_tokens + usage.input_token_details.text_tokens
    assert usage.output_tokens > 0 and usage.input_token_details.text_tokens > 0


def test_prompt_is_initial_prompt(wclient, whisper_llm):
    """``prompt`` is ``initial_prompt``; s03 (not s00: with a prompt tiny.en's
    greedy pass on it falls below the log-prob threshold and the result is a
    random sample) decodes at temperature 0 with it, and the prompt changes the scores."""
    clip, prompt = SPEECH / "s03.wav", "Foxes and dogs."
    ref = whisper_llm.transcribe(str(clip), initial_prompt=prompt, timestamps=True, use_tqdm=False)[0]
    plain = whisper_llm.transcribe(str(clip), timestamps=True, use_tqdm=False)[0]
    assert ref.segments[0].avg_logprob != pytest.approx(plain.segments[0].avg_logprob)
    with open(clip, "rb") as f:
        got = wclient.audio.transcriptions.create(model="tiny.en", file=f, prompt=prompt,
                                                  response_format="verbose_json")
    assert got.text == ref.text
    assert_same_segments(got.segments, ref.segments)


def test_translation_on_english_only_model_is_refused_like_transcribe(wclient, whisper_llm):
    import openai

    with pytest.raises(ValueError, match="English-only") as offline:
        whisper_llm.transcribe(str(CLIP), task="translate", use_tqdm=False)
    with open(CLIP, "rb") as f, pytest.raises(openai.BadRequestError) as served:
        wclient.audio.translations.create(model="tiny.en", file=f)
    assert str(offline.value) in served.value.message
    with open(CLIP, "rb") as f:  # the server still works
        assert wclient.audio.transcriptions.create(model="tiny.en", file=f).text


def test_async_client(whisper_server, whisper_llm):
    from openai import AsyncOpenAI

    clips = [SPEECH / f"s{i:02d}.wav" for i in range(4)]
    refs = whisper_llm.transcribe([str(c) for c in clips], use_tqdm=False)

    async def main():
        async with AsyncOpenAI(base_url=whisper_server.v1, api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(client.audio.transcriptions.create(
                model="tiny.en", file=(c.name, c.read_bytes()), response_format="text") for c in clips))

    assert asyncio.run(main()) == [format_transcription(r, "txt") for r in refs]


def test_beam_size_and_vad_filter_equal_transcribe(whisper_server, whisper_llm, tmp_path):
    """faster-whisper's ``beam_size`` and ``vad_filter`` as form fields are
    ``LLM.transcribe``'s options: s01 is a clip where 2 beams change tiny.en's words;
    VAD skips the padding around two clips, so the segments start at the speech."""
    import numpy as np
    import soundfile as sf

    def post(path, **data):
        resp = httpx.post(whisper_server.v1 + "/audio/transcriptions", timeout=120,
                          files={"file": (path.name, path.read_bytes())},
                          data={"response_format": "verbose_json", **data})
        assert resp.status_code == 200, resp.text
        return resp.json()

    clip = SPEECH / "s01.wav"
    beams = whisper_llm.transcribe(str(clip), beam_size=2, timestamps=True, use_tqdm=False)[0]
    assert beams.text != whisper_llm.transcribe(str(clip), use_tqdm=False)[0].text
    got = post(clip, beam_size="2")
    assert got["text"] == beams.text
    assert [(s["start"], s["end"], s["text"]) for s in got["segments"]] == \
        [(s.start, s.end, s.text) for s in beams.segments]

    pytest.importorskip("silero_vad")
    pad = np.zeros(3 * 16000, np.float32)
    padded = tmp_path / "padded.wav"
    sf.write(padded, np.concatenate([pad, sf.read(CLIP, dtype="float32")[0], pad,
                                     sf.read(SPEECH / "s03.wav", dtype="float32")[0], pad]), 16000, subtype="PCM_16")
    vad = whisper_llm.transcribe(str(padded), vad_filter=True, timestamps=True, use_tqdm=False)[0]
    assert vad.segments[0].start > 2.0  # the leading silence skipped
    got = post(padded, vad_filter="true")
    assert got["text"] == vad.text
    assert [(s["start"], s["end"], s["text"]) for s in got["segments"]] == \
        [(s.start, s.end, s.text) for s in vad.segments]


def test_vad_filter_without_the_extra_is_refused(monkeypatch):
    """Without silero-vad, ``vad_filter=true`` is a 400 naming the field and the extra."""
    from encdec.entrypoints.openai import serving_transcription
    from encdec.entrypoints.openai.protocol import APIError, TranscriptionRequest

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "silero_vad" else find_spec(name, *a))
    with pytest.raises(APIError) as e:
        serving_transcription.TranscriptionServer.options(TranscriptionRequest(vad_filter="true"), "transcribe")
    assert e.value.status == 400 and e.value.param == "vad_filter" and "encdec[vad]" in e.value.message
    assert serving_transcription.TranscriptionServer.options(TranscriptionRequest(), "transcribe").vad_filter is False


def bad(server, files=None, data=None, path="/audio/transcriptions", **kw):
    return httpx.post(server.v1 + path, files=files, data=data, timeout=60, **kw)


def test_bad_audio_requests_then_good(whisper_server):
    wav = CLIP.read_bytes()
    cases = [
        (dict(files={"file": ("big.wav", b"\0" * (3 << 20), "audio/wav")}, data={"model": "tiny.en"}),
         413, "limit"),
        (dict(files={"file": ("noise.wav", b"this is not audio at all" * 50, "audio/wav")}), 400, "decode"),
        (dict(files={"file": ("empty.wav", b"", "audio/wav")}), 400, "empty"),
        (dict(data={"model": "tiny.en"}, files={"other": ("a.wav", wav, "audio/wav")}), 400, "file"),
        (dict(content=b"{}", headers={"content-type": "application/json"}), 415, "multipart"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"model": "whisper-1"}), 404, "whisper-1"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"response_format": "csv"}), 400,
         "response_format"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"chunking_strategy": "auto"}), 400,
         "chunking_strategy"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"language": "fr"}), 400, "English-only"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")},
              data={"timestamp_granularities[]": "segment"}), 400, "verbose_json"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"temperature": "2"}), 400, "temperature"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"stream": "true", "response_format": "srt"}),
         400, "stream"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"timestamp_granularities[]": "word"}), 400,
         "verbose_json"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")},
              data={"timestamp_granularities[]": "char", "response_format": "verbose_json"}), 400,
         "timestamp_granularities"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"temperature": "-0.1"}), 400, "temperature"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"temperature": "hot"}), 400, "temperature"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"beam_size": "0"}), 400, "beam_size"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"beam_size": "two"}), 400, "beam_size"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"beam_size": "1000"}), 400, "max_num_seqs"),
        (dict(files={"file": ("a.wav", wav, "audio/wav")}, data={"vad_filter": "maybe"}), 400, "vad_filter"),
    ]
    for kw, status, word in cases:
        before = whisper_server.metrics()
        resp = bad(whisper_server, **kw)
        assert resp.status_code == status, (kw.get("data"), resp.text)
        assert word in resp.json()["error"]["message"], resp.json()
        for field in {"beam_size", "vad_filter"} & set(kw.get("data") or {}):
            assert resp.json()["error"]["param"] == field, resp.json()
        after = whisper_server.metrics()  # refused before anything was queued
        assert after["vllm:prompt_tokens_total{}"] == before["vllm:prompt_tokens_total{}"], kw.get("data")
        ok = bad(whisper_server, files={"file": ("a.wav", wav, "audio/wav")}, data={"response_format": "text"})
        assert ok.status_code == 200 and ok.text.strip()


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory, ct2_dir):
    """A random 2-layer multilingual Whisper (h-whisper's test checkpoint), served and offline."""
    from pathlib import Path

    import numpy as np
    import soundfile as sf

    from encdec import LLM
    from tests.models.test_whisper_multilingual_job import write_multilingual_ct2

    from .conftest import start_server, stop_server

    out = tmp_path_factory.mktemp("ml_whisper")
    write_multilingual_ct2(out, Path(ct2_dir))
    t = np.arange(16000 * 4) / 16000
    clips = []
    for f in (150, 2500):
        clips.append(out / f"tone{f}.wav")
        sf.write(clips[-1], (0.3 * np.sin(2 * np.pi * f * t)).astype(np.float32), 16000, subtype="PCM_16")
    llm = LLM(str(out), kv_cache_memory=64 << 20, swap_space=0.05)
    server = start_server(str(out), out / "server.log", "--served-model-name", "ml",
                          "--kv-cache-memory", str(64 << 20), "--swap-space", "0.05")
    yield server, llm, clips
    stop_server(server)


@pytest.mark.slow  # lean default run: `make test-all` runs it
def test_multilingual_translation_and_detection_equal_transcribe(multilingual):
    from openai import OpenAI

    server, llm, clips = multilingual
    client = OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)
    # One temperature (the API's): the random model loops on a tone at every
    # temperature, and the default ladder with best_of=5 samples 25 looping rows
    # per window (10x this test's time) to compare what one temperature compares.
    temp = 0.4
    for clip in clips:
        with open(clip, "rb") as f:
            data = f.read()
        given = llm.transcribe(str(clip), language="de", task="translate", temperature=temp, use_tqdm=False)[0]
        got = client.audio.translations.create(model="ml", file=(clip.name, data), response_format="text",
                                               temperature=temp, extra_body={"language": "de"})
        assert got == format_transcription(given, "txt")
        detected = llm.transcribe(str(clip), task="translate", temperature=temp, use_tqdm=False)[0]
        got = client.audio.translations.create(model="ml", file=(clip.name, data), temperature=temp)
        assert got.text == detected.text
        plain = llm.transcribe(str(clip), timestamps=True, temperature=temp, use_tqdm=False)[0]
        verbose = client.audio.transcriptions.create(model="ml", file=(clip.name, data), temperature=temp,
                                                     response_format="verbose_json")
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        assert verbose.text == plain.text and verbose.language == LANGUAGES[plain.language]
