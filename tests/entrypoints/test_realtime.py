"""``/v1/realtime?intent=transcription`` on a real server (127.0.0.1, tiny.en),
driven by the official ``openai`` client's realtime connection."""
from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest

from tests.entrypoints.conftest import API_KEY

pytest.importorskip("websockets")
sf = pytest.importorskip("soundfile")

CHUNK_S = 0.1
EVENT_TIMEOUT = 60.0  # seconds: the longest wait for one server event


def _pcm16(wav: np.ndarray) -> bytes:
    return (np.clip(wav, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


def _quantized(wav: np.ndarray) -> np.ndarray:
    """What the server decodes from ``_pcm16(wav)``."""
    return np.frombuffer(_pcm16(wav), "<i2").astype(np.float32) / 32768.0


def _connect(server, **query):
    from openai import OpenAI

    client = OpenAI(base_url=server.v1, api_key=query.pop("api_key", "none"), max_retries=0, timeout=60)
    return client.realtime.connect(model=query.pop("model", "tiny.en"),
                                   extra_query={"intent": "transcription", **query})


def _recv(conn, until: set[str], *, limit: int = 500) -> list:
    """Events up to and including the first whose type is in ``until`` (bounded in count and
    time: a watchdog closes the connection, which ends a blocked ``recv``)."""
    out = []
    watchdog = threading.Timer(EVENT_TIMEOUT, conn.close)
    watchdog.start()
    try:
        for _ in range(limit):
            event = conn.recv()
            out.append(event)
            if event.type in until:
                return out
    finally:
        watchdog.cancel()
    raise AssertionError(f"no {until} in {limit} events: {[e.type for e in out]}")


def _stream(conn, pcm: bytes, rate: int, *, realtime: bool = True) -> None:
    step = int(rate * CHUNK_S) * 2
    for i in range(0, len(pcm), step):
        conn.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
        if realtime:
            time.sleep(CHUNK_S)


def _update(conn, rate: int, turn_detection) -> None:
    conn.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": rate}, "transcription": {"model": "tiny.en"},
        "turn_detection": turn_detection}}}})
    (updated,) = [e for e in _recv(conn, {"session.updated", "error"})]
    assert updated.type == "session.updated", updated


def _check_texts(events, want: str) -> None:
    """The completed transcript is ``want``; the deltas only ever extend the text; the
    partial text (deltas up to the commit) is completed by the last delta when the final
    text starts with it, and nothing is sent after the commit when it does not (local
    agreement can settle on words the final pass decodes otherwise)."""
    kinds = [e.type for e in events]
    cut = kinds.index("input_audio_buffer.committed")
    is_delta = lambda e: e.type == "conversation.item.input_audio_transcription.delta"  # noqa: E731
    before = [e.delta for e in events[:cut] if is_delta(e)]
    after = [e.delta for e in events[cut:] if is_delta(e)]
    deltas = before + after
    assert all(deltas) and all(d.startswith(" ") and d.strip() for d in deltas[1:]), deltas
    (done,) = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert done.transcript == want
    assert done.usage.type == "tokens" and done.usage.input_tokens > 0
    partial = "".join(before).split()
    if want.split()[:len(partial)] == partial:
        assert "".join(deltas) == " ".join(want.split()), (deltas, want)
    else:
        assert not after, (deltas, want)


@pytest.fixture(scope="module")
def clip(speech_clips):
    files, _, wavs = speech_clips
    return np.concatenate([wavs[0], np.zeros(4000, np.float32), wavs[1]])  # ~7 s


class _Reader:
    """Collects a connection's events on a thread while the test sends (bounded in count and time)."""

    def __init__(self, conn, until: set[str], limit: int = 500):
        self.conn, self.until, self.limit, self.events = conn, until, limit, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for _ in range(self.limit):
                event = self.conn.recv()
                self.events.append(event)
                if event.type in self.until:
                    return
        except Exception:  # noqa: BLE001 - the connection closed (watchdog): join() reports it
            return

    def seen(self, kind: str) -> bool:
        return any(e.type == kind for e in self.events)

    def join(self) -> list:
        watchdog = threading.Timer(EVENT_TIMEOUT, self.conn.close)
        watchdog.start()
        self.thread.join(EVENT_TIMEOUT + 5)
        watchdog.cancel()
        assert self.events and self.events[-1].type in self.until, [e.type for e in self.events]
        return self.events


@pytest.fixture(scope="module")
def warm_server(whisper_server, clip):
    """The server after one transcription (its first requests pay for warm-up)."""
    import io

    from openai import OpenAI

    buf = io.BytesIO()
    sf.write(buf, clip[:16000], 16000, format="WAV")
    OpenAI(base_url=whisper_server.v1, api_key="none", max_retries=0, timeout=120).audio.transcriptions.create(
        model="tiny.en", file=("warm.wav", buf.getvalue()))
    return whisper_server


def test_manual_commit_16k_equals_transcribe(warm_server, whisper_llm, clip):
    """Partial text while the clip streams (silence follows it until some has come:
    passes are timed by the host), the committed turn's text as LLM.transcribe's."""
    silence = _pcm16(np.zeros(1600, np.float32))
    with _connect(warm_server) as conn:
        assert conn.recv().type == "session.created"
        _update(conn, 16000, None)
        reader = _Reader(conn, {"conversation.item.input_audio_transcription.completed",
                                "conversation.item.input_audio_transcription.failed"})
        pcm = _pcm16(clip)
        _stream(conn, pcm, 16000)
        for _ in range(100):  # at most 10 s more
            if reader.seen("conversation.item.input_audio_transcription.delta"):
                break
            _stream(conn, silence, 16000)
            pcm += silence
        conn.send({"type": "input_audio_buffer.commit"})
        events = reader.join()
    kinds = [e.type for e in events]
    assert "input_audio_buffer.committed" in kinds and "error" not in kinds, kinds
    assert "conversation.item.input_audio_transcription.delta" in kinds[:kinds.index("input_audio_buffer.committed")]
    (want,) = whisper_llm.transcribe(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0, use_tqdm=False)
    _check_texts(events, want.text)


def test_server_vad_24k_equals_transcribe(warm_server, whisper_llm, speech_clips):
    """One sentence between silences: one turn, from speech_started's audio_start_ms
    to speech_stopped's audio_end_ms, transcribed as LLM.transcribe does those samples."""
    import librosa

    wav24 = librosa.resample(speech_clips[2][0], orig_sr=16000, target_sr=24000)
    audio = np.concatenate([np.zeros(12000, np.float32), wav24, np.zeros(36000, np.float32)])
    with _connect(warm_server) as conn:
        created = conn.recv()
        assert created.type == "session.created"
        assert created.session.audio.input.turn_detection.type == "server_vad"
        _stream(conn, _pcm16(audio), 24000)
        events = _recv(conn, {"conversation.item.input_audio_transcription.completed",
                              "conversation.item.input_audio_transcription.failed"})
    kinds = [e.type for e in events]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped") \
        < kinds.index("input_audio_buffer.committed"), kinds
    start = next(e for e in events if e.type == "input_audio_buffer.speech_started").audio_start_ms
    end = next(e for e in events if e.type == "input_audio_buffer.speech_stopped").audio_end_ms
    assert 0 < start < 500 and 500 + 1000 * len(wav24) / 24000 - 600 < end < 500 + 1000 * len(wav24) / 24000 + 1500
    samples = _quantized(audio)[start * 24:end * 24]
    (want,) = whisper_llm.transcribe((samples, 24000), use_tqdm=False)
    _check_texts(events, want.text)


def _error(conn, event: dict, code: str | None = None):
    conn.send(event)
    (err,) = [e for e in _recv(conn, {"error"}, limit=20) if e.type == "error"]
    assert err.error.type == "invalid_request_error" and err.error.message
    if code is not None:
        assert err.error.code == code, err.error
    return err.error


def test_bad_input_gets_error_events_and_the_session_goes_on(whisper_server):
    with _connect(whisper_server) as conn:
        assert conn.recv().type == "session.created"
        assert _error(conn, {"type": "response.create"}).param == "type"  # not a transcription event
        conn.send_raw('{"type": "input_audio_buffer.append", "audio": "%%%not base64"}')
        assert _recv(conn, {"error"}, limit=20)[-1].error.param == "audio"
        conn.send_raw('{"type": "input_audio_buffer.append", "audio": "AAAA"}')  # 3 bytes: not whole PCM16 samples
        assert _recv(conn, {"error"}, limit=20)[-1].error.param == "audio"
        for fmt, param in (({"type": "audio/pcmu"}, "type"), ({"type": "audio/pcm", "rate": 44100}, "rate")):
            err = _error(conn, {"type": "session.update", "session": {"type": "transcription",
                                                                      "audio": {"input": {"format": fmt}}}})
            assert err.param == f"session.audio.input.format.{param}"
        big = base64.b64encode(bytes(3 << 20)).decode()  # 3 MiB of PCM in one append
        _error(conn, {"type": "input_audio_buffer.append", "audio": big}, "input_audio_buffer_append_too_large")
        _error(conn, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
        _update(conn, 16000, None)  # the session still answers
        conn.send({"type": "session.close"})
        assert _recv(conn, {"session.closed"}, limit=20)[-1].type == "session.closed"
        _error(conn, {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(3200)).decode()},
               "session_closed")


def test_refused_connections(whisper_server):
    from websockets.exceptions import InvalidStatus

    for query, status in (({"model": "whisper-1"}, 404), ({"intent": "conversation"}, 400)):
        with pytest.raises(InvalidStatus) as e:
            with _connect(whisper_server, **query) as conn:
                conn.recv()
        assert e.value.response.status_code == status
        assert b'"error"' in e.value.response.body


def test_disconnect_mid_utterance_aborts_and_frees_everything(whisper_server, speech_clips):
    """A client that leaves while its turn's final pass runs (20 s of speech) gets its
    requests aborted, and every KV block is free again."""
    aborted = "vllm:request_success_total{finished_reason=abort}"
    before = whisper_server.metrics()[aborted]
    speech = np.concatenate(speech_clips[2][:8])[:16000 * 20]
    with _connect(whisper_server) as conn:
        assert conn.recv().type == "session.created"
        _update(conn, 16000, None)
        _stream(conn, _pcm16(speech), 16000, realtime=False)
        conn.send({"type": "input_audio_buffer.commit"})
        _recv(conn, {"input_audio_buffer.committed"})
        for _ in range(100):  # leave once the final pass runs (at most 10 s)
            if whisper_server.metrics()["vllm:num_requests_running{}"] > 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the final pass never ran")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = whisper_server.metrics()
        if m["vllm:kv_cache_usage_perc{}"] == 0 and m["vllm:num_requests_running{}"] == 0 \
                and m["vllm:num_requests_waiting{}"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"blocks still held after the client left: {m}")
    assert m[aborted] > before, "the final pass of the turn was not aborted when the client left"
