"""``/v1/realtime?intent=transcription`` on a real server (127.0.0.1, tiny.en),
driven by the official ``openai`` client's realtime connection."""
from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest

from tests.entrypoints.conftest import API_KEY, start_server, stop_server

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
        big = base64.b64encode(bytes(16 << 20)).decode()  # 16 MiB of PCM in one append: over OpenAI's 15
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


def test_a_16_mib_append_gets_an_error_event_and_the_next_append_works(whisper_server):
    """The WebSocket takes messages past the 15 MiB limit, so the session can answer (not a 1009 close)."""
    with _connect(whisper_server) as conn:
        assert conn.recv().type == "session.created"
        _update(conn, 16000, None)
        big = base64.b64encode(bytes(16 << 20)).decode()
        err = _error(conn, {"type": "input_audio_buffer.append", "audio": big}, "input_audio_buffer_append_too_large")
        assert err.param == "audio"
        _stream(conn, _pcm16(np.zeros(8000, np.float32)), 16000, realtime=False)  # 0.5 s
        conn.send({"type": "input_audio_buffer.commit"})
        events = _recv(conn, {"input_audio_buffer.committed", "error"}, limit=50)
        assert events[-1].type == "input_audio_buffer.committed", events[-1]


def test_refused_handshakes_are_not_logged_as_errors(whisper_server):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    for query in ({"model": "whisper-1"}, {"intent": "conversation"}, {"api_key": "sk-wrong", "model": "x"}):
        with pytest.raises(InvalidStatus):
            with _connect(whisper_server, **query) as conn:
                conn.recv()
    with pytest.raises(InvalidStatus):  # a wrong path: a 404, also refused at INFO
        with connect(whisper_server.base.replace("http", "ws", 1) + "/v1/nowhere") as ws:
            ws.recv()
    time.sleep(0.5)  # the server logs after it answered
    assert "without completing handshake" not in whisper_server.log.read_text()


@pytest.fixture(scope="module")
def short_idle_server(ct2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("idle_server") / "server.log"
    server = start_server(str(ct2_dir), log, "--served-model-name", "tiny.en", "--kv-cache-memory", str(64 << 20),
                          "--swap-space", "0.05", "--realtime-idle-timeout", "2")
    yield server
    stop_server(server)


def test_an_idle_session_is_closed_after_the_timeout(short_idle_server):
    """Each client event restarts the clock; 2 s (the server's --realtime-idle-timeout)
    after the last one the session gets an ``error`` event and the connection closes."""
    from websockets.exceptions import ConnectionClosed

    with _connect(short_idle_server) as conn:
        assert conn.recv().type == "session.created"
        for _ in range(2):  # events 1.2 s apart keep it open past the timeout
            time.sleep(1.2)
            _update(conn, 16000, None)
        last = time.monotonic()
        err = _recv(conn, {"error"}, limit=5)[-1]
        waited = time.monotonic() - last
        assert err.error.code == "session_idle_timeout" and 1.5 < waited < 10, (err, waited)
        with pytest.raises(ConnectionClosed):
            conn.recv()


class _PeakRSS:
    """The server process's resident memory, sampled every 50 ms on a thread."""

    def __init__(self, pid: int):
        psutil = pytest.importorskip("psutil")
        self.proc, self.peak = psutil.Process(pid), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self):
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.peak = max(self.peak, self.now())


DONE = {"conversation.item.input_audio_transcription.completed", "conversation.item.input_audio_transcription.failed"}


def _speech(speech_clips, seconds: float, rate: int) -> np.ndarray:
    """``seconds`` of the shipped clips back to back, trimmed of their edge silences, at ``rate``."""
    import librosa

    clips = [librosa.effects.trim(w, top_db=30)[0] for w in speech_clips[2]]
    wav = np.concatenate(clips * (1 + int(seconds * 16000) // sum(map(len, clips))))[:int(seconds * 16000)]
    return wav if rate == 16000 else librosa.resample(wav, orig_sr=16000, target_sr=rate).astype(np.float32)


def _send_turn(conn, pcm: bytes, rate: int, turn_detection) -> list:
    """Stream ``pcm`` at full speed and commit; every event until the last turn's
    transcript. The ``session.update`` after the commit marks where the commit's
    events end (the session handles client events in order)."""
    _stream(conn, pcm, rate, realtime=False)
    conn.send({"type": "input_audio_buffer.commit"})
    conn.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": turn_detection}}}})
    events = _recv(conn, {"session.updated"}, limit=5000)
    last = [e.item_id for e in events if e.type == "input_audio_buffer.committed"][-1]
    while not any(e.type in DONE and e.item_id == last for e in events):
        events += _recv(conn, DONE, limit=5000)
    assert not [e for e in events if e.type == "error" and e.error.code != "input_audio_buffer_commit_empty"]
    return events


@pytest.mark.slow
@pytest.mark.parametrize("seconds, turn_detection", [
    (90, None),  # one turn the client commits
    (100, {"type": "server_vad", "silence_duration_ms": 2000}),  # speech without a 2 s pause
], ids=["committed-90s", "server-vad-100s"])
def test_a_long_turn_keeps_the_server_memory_flat(warm_server, speech_clips, seconds, turn_detection):
    """A long turn is ended at the 30 s cap (as committed: transcript and all), and the
    server's memory stays flat while it streams: the session keeps its audio as a list
    of chunks and each turn its own samples, never a copy per append."""
    pcm = _pcm16(_speech(speech_clips, seconds, 24000))
    with _connect(warm_server) as conn:
        assert conn.recv().type == "session.created"
        _update(conn, 24000, turn_detection)
        # warm-up, the same turn once: the session's first passes and the allocator's high-water
        # mark for several passes at once (a fresh server grows by 20-60 MiB on its first long turn)
        _send_turn(conn, pcm, 24000, turn_detection)
        with _PeakRSS(warm_server.proc.pid) as rss:
            base = rss.now()
            events = _send_turn(conn, pcm, 24000, turn_detection)
    growth = (rss.peak - base) / 2**20
    assert growth < 50, f"server RSS grew by {growth:.0f} MiB"
    completed = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert len(completed) >= seconds // 30 and all(e.transcript for e in completed), [e.type for e in events]
