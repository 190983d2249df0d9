"""A realtime session's final pass falls back to temperature sampling as
``LLM.transcribe`` does, from seeded streams (``session_options``): a turn
whose greedy decode fails the thresholds gets the same transcript in every
session, and it is ``LLM.transcribe``'s with the same seed, on a real server
(127.0.0.1, tiny.en)."""
from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest

from encdec import SamplingParams
from encdec.entrypoints.openai.realtime import REALTIME_SEED, session_options
from encdec.transcription import TranscribeOptions
from tests.entrypoints.conftest import SPEECH

websockets = pytest.importorskip("websockets")
sf = pytest.importorskip("soundfile")

RATE = 16000
EVENT_TIMEOUT = 60.0  # seconds: the longest wait for one server event


def test_session_options_are_transcribe_s_defaults_with_a_seed():
    options = session_options("en", "Names: Ada.", seed=7)
    assert options.sampling_params.seed == 7 and options.sampling_params.max_tokens is None
    assert options.sampling_params.temperature == 0.0  # greedy windows: the seed only reaches the fallback
    assert dataclasses.replace(options, sampling_params=None) == TranscribeOptions(language="en",
                                                                                  initial_prompt="Names: Ada.")
    assert session_options().sampling_params.seed == REALTIME_SEED


@pytest.fixture(scope="module")
def noisy_turn() -> np.ndarray:
    """A sentence under louder noise (-3 dB), as the server decodes its PCM16:
    tiny.en's greedy pass and its retries fail the thresholds (every temperature
    is tried)."""
    wav = sf.read(SPEECH / "s05.wav", dtype="float32")[0]
    noise = np.random.default_rng(0).normal(0, 1.4 * np.sqrt(np.mean(wav ** 2)), len(wav)).astype(np.float32)
    pcm = (np.clip(wav + noise, -1, 32767 / 32768) * 32768).astype("<i2")
    return pcm.astype(np.float32) / 32768.0


def _final(server, samples: np.ndarray) -> str:
    """One session: the samples as one committed turn (no VAD); its transcript."""
    from websockets.sync.client import connect

    pcm = (samples * 32768).astype("<i2").tobytes()
    url = server.base.replace("http", "ws") + "/v1/realtime?intent=transcription"
    with connect(url, open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=EVENT_TIMEOUT))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": None}}}}))
        step = RATE // 10 * 2  # 100 ms appends
        for i in range(0, len(pcm), step):
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[i:i + step]).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        for _ in range(500):  # bounded: a few deltas, then the transcript
            event = json.loads(ws.recv(timeout=EVENT_TIMEOUT))
            assert event["type"] not in ("error", "conversation.item.input_audio_transcription.failed"), event
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                return event["transcript"]
    raise AssertionError("no completed transcript in 500 events")


def test_a_final_that_falls_back_is_the_seeded_transcribe(whisper_server, whisper_llm, noisy_turn):
    seeded = SamplingParams(temperature=0.0, max_tokens=None, seed=REALTIME_SEED)
    (want,) = whisper_llm.transcribe(noisy_turn, sampling_params=seeded, use_tqdm=False)
    assert want.text and any(s.temperature > 0 for s in want.segments), want.segments  # it fell back: sampled
    assert [_final(whisper_server, noisy_turn) for _ in range(2)] == [want.text] * 2
