"""The web page at ``/`` in a real browser: Debian's Chromium (``/usr/bin/chromium``,
headless) driven by Playwright for Python against real servers on 127.0.0.1:
Whisper tiny.en with an API key (upload, live microphone, the key flow) and a
tiny random NLLB (the text panel). The microphone is Chromium's fake device
playing a WAV built here from the shipped clips. Without Chromium or Playwright
the browser tests skip, saying which is missing (``make test`` prints it with
``-rs``). Screenshots of each panel go to ``$ENCDEC_TEST_ARTIFACTS`` (default: a
temporary directory, printed)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from encdec.transcription import format_transcription

from .conftest import SPEECH, start_server, stop_server

CHROMIUM = Path("/usr/bin/chromium")
KEY = "sk-browser-test"
CLIP = SPEECH / "s00.wav"
LIVE_TURNS = (("s06", "s09"), ("s04", "s07"))  # two sentences a turn: partial passes have time to agree
RATE = 16000
TIMEOUT_MS = 60_000


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to run the browser tests"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install '.[test]' (the browser itself is the system's Chromium)"
    return None


@pytest.fixture(scope="module")
def mic_turns(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    """The fake microphone's WAV (silence, turn, pause, turn, silence) and each turn's samples."""
    import soundfile as sf

    def speech(name: str) -> np.ndarray:  # the clip without its silent ends (0.2 s, 0.6 s), 50 ms kept
        wav = sf.read(SPEECH / f"{name}.wav", dtype="float32")[0]
        loud = np.nonzero(np.abs(wav) > 0.02)[0]
        return wav[max(loud[0] - RATE // 20, 0):loud[-1] + RATE // 20]

    turns = []
    for names in LIVE_TURNS:  # a 0.2 s pause inside a turn: under server VAD's 0.5 s of silence
        a, b = (speech(n) for n in names)
        turns.append(np.concatenate([a, np.zeros(RATE // 10, np.float32), b]))
    z = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    path = tmp_path_factory.mktemp("mic") / "mic.wav"
    sf.write(path, np.concatenate([z(0.8), turns[0], z(2.0), turns[1], z(3.0)]), RATE, subtype="PCM_16")
    return path, turns


@pytest.fixture(scope="module")
def chromium(mic_turns):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={mic_turns[0].resolve()}%noloop"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=args, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    out = Path(os.environ.get("ENCDEC_TEST_ARTIFACTS") or tmp_path_factory.mktemp("browser_artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots: {out}")
    return out


@pytest.fixture(scope="module")
def keyed_whisper(ct2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed_whisper") / "server.log"
    server = start_server(str(ct2_dir), log, "--served-model-name", "tiny.en", "--api-key", KEY,
                          "--max-audio-mb", "2", "--kv-cache-memory", str(256 << 20), "--swap-space", "0.1")
    # one transcription first: a cold server's first passes pay for warm-up, which would
    # leave the first live turn without partial passes
    httpx.post(server.v1 + "/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
               files={"file": (CLIP.name, CLIP.read_bytes())}, data={"model": "tiny.en"}, timeout=120)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def nllb_server(tmp_path_factory):
    from encdec.testing import make_random_nllb

    path = make_random_nllb(str(tmp_path_factory.mktemp("nllb")), seed=5)
    server = start_server(path, tmp_path_factory.mktemp("nllb_server") / "server.log",
                          "--served-model-name", "nllb", "--kv-cache-memory", "16MiB")
    yield server, path
    stop_server(server)


def _open(chromium, base: str, *, width: int = 1000, key: str | None = None):
    """A page at ``/`` (in its own browser context: its own session storage), ready;
    ``key``: the API key already given in this session."""
    page = chromium.new_page(viewport={"width": width, "height": 900}, accept_downloads=True)
    if key is not None:
        page.add_init_script(f"sessionStorage.setItem('encdec.apiKey', {json.dumps(key)})")
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(base + "/")
    page.wait_for_selector("body[data-ready=true]")
    return page


def _tab_to(page, element_id: str, limit: int = 40) -> None:
    """Tab (keyboard only) until ``element_id`` has the focus."""
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
    raise AssertionError(f"#{element_id} is not reachable by Tab")


def _text(page, selector: str) -> str:
    return page.locator(selector).text_content() or ""


def test_page_status_and_websocket_key_subprotocol(keyed_whisper):
    """``/`` and its files; the status route of a Whisper server; a browser's key
    subprotocol on /v1/realtime (wrong: 401 before the handshake; right: the
    session, with the ``realtime`` subprotocol chosen)."""
    pytest.importorskip("websockets")
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    base = keyed_whisper.base
    page = httpx.get(base + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(base + "/ui/app.js", timeout=10).headers["content-type"].startswith("text/javascript")
    assert httpx.get(base + "/ui/..%2Fapi_server.py", timeout=10).status_code == 404
    status = httpx.get(base + "/ui/status", timeout=10).json()
    assert status["model"] == "tiny.en" and status["panels"] == ["transcribe", "live"]
    assert status["api_key_required"] is True and status["device"] == "cpu" and status["translation"] is None
    assert status["speech_languages"] == []  # tiny.en: English only, no language or translate controls
    assert status["vad"] == (importlib.util.find_spec("silero_vad") is not None)
    assert {"running", "waiting", "kv_cache_usage"} <= set(status)
    url = base.replace("http", "ws") + "/v1/realtime?intent=transcription"
    with pytest.raises(InvalidStatus) as e:
        connect(url, subprotocols=["realtime", "openai-insecure-api-key.wrong"]).close()
    assert e.value.response.status_code == 401
    with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"


def _srt_times(text: str, sep: str) -> list[tuple[float, float]]:
    def secs(h, m, s, ms):
        return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000

    pattern = rf"(\d+):(\d\d):(\d\d){re.escape(sep)}(\d{{3}}) --> (\d+):(\d\d):(\d\d){re.escape(sep)}(\d{{3}})"
    return [(secs(*m[:4]), secs(*m[4:])) for m in re.findall(pattern, text)]


def _give_key(page, key: str) -> None:
    page.fill("#api-key", key)
    page.click("#key-save")


@pytest.mark.browser
def test_key_then_keyboard_upload_equals_transcribe(chromium, keyed_whisper, whisper_llm, artifacts):
    """Refused without the key (the server's 401 words on the page), refused with a
    wrong one, then by keyboard only: pick the clip, run; the transcript equals
    ``LLM.transcribe``'s, and the SRT and VTT downloads are the server's with the
    segments' times. The key is kept across a reload."""
    page = _open(chromium, keyed_whisper.base)
    assert page.locator("#key-form").is_visible()
    page.set_input_files("#tr-file", str(CLIP))
    page.click("#tr-run")
    page.wait_for_function("document.getElementById('tr-error').textContent.length > 0")
    refusal = httpx.get(keyed_whisper.v1 + "/models", timeout=10).json()["error"]["message"]
    assert _text(page, "#tr-error") == refusal and _text(page, "#key-error") == refusal
    _give_key(page, "wrong")
    page.wait_for_function(f"document.getElementById('key-error').textContent === {json.dumps(refusal)}")
    page.screenshot(path=str(artifacts / "api-key.png"))
    _give_key(page, KEY)
    page.wait_for_selector("#key-form", state="hidden")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#key-form").is_hidden()  # kept for the session
    assert page.locator("#tr-language").is_hidden() and page.locator("#tr-translate").is_hidden()  # English only

    # Subscribe to file choosers before the key press: Playwright turns the browser's
    # interception on by a message it does not wait for, and a chooser opened before
    # that lands is the native one, which headless Chromium never reports.
    page.on("filechooser", lambda _: None)
    _tab_to(page, "tr-file")
    with page.expect_file_chooser() as chooser:
        page.keyboard.press("Space")
    chooser.value.set_files(str(CLIP))
    _tab_to(page, "tr-run")
    page.keyboard.press("Enter")
    page.wait_for_selector("#tr-result", state="visible")
    stamped = whisper_llm.transcribe(str(CLIP), timestamps=True, use_tqdm=False)[0]
    assert _text(page, "#tr-text") == stamped.text
    starts = page.eval_on_selector_all("#tr-segments .segment", "bs => bs.map(b => [+b.dataset.start, +b.dataset.end])")
    assert starts == [[s.start, s.end] for s in stamped.segments]
    page.screenshot(path=str(artifacts / "transcribe.png"), full_page=True)

    for fmt, sep in (("srt", ","), ("vtt", ".")):
        _tab_to(page, f"dl-{fmt}")
        with page.expect_download() as dl:
            page.keyboard.press("Enter")
        got = Path(dl.value.path()).read_text()
        assert dl.value.suggested_filename == f"s00.{fmt}"
        assert got == format_transcription(stamped, fmt)
        times = _srt_times(got, sep)
        assert times == [pytest.approx((s.start, s.end), abs=1e-3) for s in stamped.segments]

    page.check("#tr-words")  # word timestamps: each word with its times
    page.click("#tr-run")
    page.wait_for_selector("#tr-wordlist .word")
    worded = whisper_llm.transcribe(str(CLIP), word_timestamps=True, use_tqdm=False)[0]
    words = page.eval_on_selector_all("#tr-wordlist .word", "ws => ws.map(w => [w.textContent, w.title])")
    assert words == [[w.word.strip(), f"{_short(w.start)} – {_short(w.end)}"] for s in worded.segments for w in s.words]

    # beam size, set by keyboard only, reaches the server: s01 is a clip where 2 beams
    # change tiny.en's words; the VAD box shows where the server has the extra
    assert page.locator("#tr-vad").is_visible() == (importlib.util.find_spec("silero_vad") is not None)
    page.uncheck("#tr-words")
    beam_clip = SPEECH / "s01.wav"
    page.set_input_files("#tr-file", str(beam_clip))
    _tab_to(page, "tr-beam-size")
    page.keyboard.press("Control+A")
    page.keyboard.type("2")
    _tab_to(page, "tr-run")
    page.keyboard.press("Enter")
    page.wait_for_function("!document.getElementById('tr-run').disabled && "
                           "document.getElementById('tr-elapsed').textContent.startsWith('done')")
    beams = whisper_llm.transcribe(str(beam_clip), beam_size=2, timestamps=True, use_tqdm=False)[0]
    assert beams.text != whisper_llm.transcribe(str(beam_clip), use_tqdm=False)[0].text
    assert _text(page, "#tr-text") == beams.text
    page.close()


def _short(seconds: float) -> str:
    """The page's M:SS.ss."""
    m = int(seconds // 60)
    return f"{m}:{seconds - 60 * m:05.2f}"


@pytest.mark.browser
def test_dropped_bad_file_shows_the_servers_message(chromium, keyed_whisper, tmp_path):
    bad = tmp_path / "notes.wav"
    bad.write_bytes(b"this is not audio\n" * 10)
    want = httpx.post(keyed_whisper.v1 + "/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                      files={"file": (bad.name, bad.read_bytes())}, data={"model": "tiny.en"}, timeout=60)
    assert want.status_code == 400
    page = _open(chromium, keyed_whisper.base, key=KEY)
    dropped = page.evaluate_handle("""text => { const dt = new DataTransfer();
        dt.items.add(new File([text], 'notes.wav', {type: 'audio/wav'})); return dt; }""", bad.read_text())
    page.dispatch_event("#tr-drop", "drop", {"dataTransfer": dropped})  # dragged onto the page
    assert page.evaluate("document.getElementById('tr-file').files[0].name") == "notes.wav"
    page.click("#tr-run")
    page.wait_for_function("document.getElementById('tr-error').textContent.length > 0")
    assert _text(page, "#tr-error") == want.json()["error"]["message"]
    page.close()


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


class _Wire:
    """What the page and the server say on ``/v1/realtime``, as Playwright sees the
    frames: the audio the page sent (the samples the server decodes, in order) and
    the server's events."""

    def __init__(self, page) -> None:
        self.appends: list[str] = []  # base64 PCM16 of each input_audio_buffer.append
        self.events: list[dict] = []  # server events, in order
        page.on("websocket", self._socket)

    def _socket(self, ws) -> None:
        if "/v1/realtime" in ws.url:
            ws.on("framesent", self._sent)
            ws.on("framereceived", lambda payload: self.events.append(json.loads(payload)))

    def _sent(self, payload: str) -> None:
        event = json.loads(payload)
        if event["type"] == "input_audio_buffer.append":
            self.appends.append(event["audio"])

    def event(self, kind: str, item_id: str | None = None) -> dict:
        """The first server event of ``kind`` (for ``item_id``, if given)."""
        found = [e for e in self.events if e["type"] == kind and item_id in (None, e.get("item_id"))]
        assert found, f"no {kind} for {item_id}: {[e['type'] for e in self.events]}"
        return found[0]

    def turn_audio(self, item_id: str) -> tuple[np.ndarray, int]:
        """The samples of a turn as the server cut them: the session's audio from
        ``speech_started``'s ``audio_start_ms`` to ``speech_stopped``'s ``audio_end_ms``."""
        import base64

        from encdec.transcription.live import pcm16_to_float

        rate = self.event("session.created")["session"]["audio"]["input"]["format"]["rate"]
        audio = pcm16_to_float(b"".join(base64.b64decode(a) for a in self.appends))
        start = self.event("input_audio_buffer.speech_started", item_id)["audio_start_ms"]
        end = self.event("input_audio_buffer.speech_stopped", item_id)["audio_end_ms"]
        assert 0 <= start < end and end * rate // 1000 <= len(audio), (start, end, len(audio) / rate)
        return audio[start * rate // 1000:end * rate // 1000], rate


def _found_in(turn: np.ndarray, played: np.ndarray, window: int = RATE // 2) -> list[tuple[float, float]]:
    """Where each half second of the played turn (pauses left out) lies in the
    samples the server cut for it (both 16 kHz), and how closely: (shift in
    seconds, normalised correlation). The browser's capture lands between
    samples (~0.98 where they line up best, 1.0 for the same samples) and can
    drop a 10 ms buffer under load (later windows shift by 10 ms; the window
    across the gap matches less)."""
    from scipy.signal import correlate

    out = []
    for s in range(0, len(played) - window + 1, window):
        part = played[s:s + window]
        if np.abs(part).max() < 0.02:
            continue
        at = int(np.argmax(correlate(turn, part, mode="valid", method="fft")))
        got = turn[at:at + window]
        out.append(((at - s) / RATE, float(np.dot(got, part) / (np.linalg.norm(got) * np.linalg.norm(part) + 1e-9))))
    return out


@pytest.mark.browser
def test_live_microphone_two_turns(chromium, keyed_whisper, whisper_llm, mic_turns, artifacts):
    """The fake microphone plays two turns with a pause: two final turns, each the
    server's ``completed`` transcript, which is exactly ``LLM.transcribe``'s of the
    samples the page sent for that turn (the session's audio from
    ``audio_start_ms`` to ``audio_end_ms``, seeded as a realtime session seeds its
    temperature fallback); those samples hold the played turn, in order (the
    browser resamples its capture to 48 kHz and then to 24 kHz and may drop a
    buffer, so they change a little run to run, and the transcript with them);
    partial (grey) text before each final, a latency shown."""
    from encdec import SamplingParams
    from encdec.audio import load_audio
    from encdec.entrypoints.openai.realtime import REALTIME_SEED

    page = _open(chromium, keyed_whisper.base, key=KEY)
    wire = _Wire(page)
    page.click("#tab-live")
    page.click("#live-start")
    try:
        page.wait_for_function("document.querySelectorAll('#live-turns .turn[data-state=final]').length >= 2",
                               timeout=60_000)
    finally:  # on a timeout too: what the page showed
        page.screenshot(path=str(artifacts / "live.png"), full_page=True)
    page.click("#live-stop")
    page.wait_for_selector("#panel-live[data-state=stopped]")
    turns = page.eval_on_selector_all("#live-turns .turn", "ts => ts.map(t => ({text: t.querySelector('.final')"
                                      ".textContent, partials: +t.dataset.partials, latency: t.dataset.latencyMs}))")
    assert _text(page, "#live-error") == ""
    assert len(turns) == 2, turns
    completed = [e for e in wire.events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert [turn["text"] for turn in turns] == [e["transcript"] for e in completed[:2]]
    sent = [wire.turn_audio(e["item_id"]) for e in completed[:2]]
    np.savez(artifacts / "live_turns.npz", *[samples for samples, _ in sent])  # at the session's rate
    for (samples, rate), played in zip(sent, mic_turns[1]):  # each turn holds the played one, in order
        found = _found_in(load_audio((samples, rate)), played)
        shifts, matches = zip(*found)
        assert np.median(matches) > 0.9 and max(shifts) - min(shifts) < 0.1, found
    seeded = SamplingParams(temperature=0.0, max_tokens=None, seed=REALTIME_SEED)
    offline = whisper_llm.transcribe(sent, sampling_params=seeded, use_tqdm=False)
    assert [turn["text"] for turn in turns] == [t.text for t in offline]
    for turn in turns:
        assert _words(turn["text"]) and turn["partials"] >= 1 and int(turn["latency"]) >= 0, turn
    with page.expect_download() as dl:
        page.click("#live-srt")
    srt = Path(dl.value.path()).read_text()
    assert len(_srt_times(srt, ",")) == 2 and turns[1]["text"].strip() in srt
    page.close()


@pytest.mark.browser
def test_text_panel_streams_translation(chromium, nllb_server, artifacts):
    """The pickers list the tokenizer's language codes; a translation streams in
    several chunks and ends as the server's non-streaming answer for the same request."""
    from transformers import AutoTokenizer

    from encdec.translation import language_table

    server, path = nllb_server
    codes = sorted(language_table(AutoTokenizer.from_pretrained(path)))
    page = _open(chromium, server.base, width=390)  # phone width
    assert page.locator("#key-form").is_hidden()
    assert page.eval_on_selector_all("#tx-src option", "os => os.map(o => o.value)") == codes
    assert page.eval_on_selector_all("#tx-tgt option", "os => os.map(o => o.value)") == codes
    page.select_option("#tx-src", "eng_Latn")
    page.select_option("#tx-tgt", "deu_Latn")
    text = "The rain in Spain falls mainly on the plain."
    page.fill("#tx-input", text)
    page.fill("#tx-max", "16")
    page.fill("#tx-temperature", "0")
    page.click("#tx-run")
    page.wait_for_selector("#tx-output[data-state=done]")
    page.screenshot(path=str(artifacts / "text.png"), full_page=True)
    ids = httpx.post(server.base + "/ui/translation-prompt", json={"text": text, "src_lang": "eng_Latn",
                                                                 "tgt_lang": "deu_Latn"}, timeout=30).json()
    body = {"model": "nllb", "prompt": ids["prompt"], "decoder_prompt": ids["decoder_prompt"], "max_tokens": 16,
            "temperature": 0, "top_p": 1, "vllm_xargs": {"forced_bos_token_id": ids["forced_bos_token_id"]}}
    answer = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert _text(page, "#tx-output") == answer
    assert int(page.get_attribute("#tx-output", "data-chunks")) > 1
    page.close()
