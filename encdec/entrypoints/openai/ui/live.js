// "Live microphone": the microphone as PCM16 at the session's rate (an
// AudioWorklet) over /v1/realtime?intent=transcription; each turn's partial text
// in grey, its final text in black with its latency (end of speech -> final);
// the session as SRT.
import { api, apiKey, clock, download, showError } from "./api.js";

const CHUNK_S = 0.1;  // seconds of audio per input_audio_buffer.append

function base64(buffer) {
  const bytes = new Uint8Array(buffer);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

class Turn {
  constructor(list, itemId, startMs) {
    this.itemId = itemId;
    this.startMs = startMs;
    this.endMs = null;
    this.stoppedAt = null;  // performance.now() at speech_stopped
    this.committed = false;
    this.final = null;
    this.li = document.createElement("li");
    this.li.className = "turn";
    this.li.dataset.itemId = itemId;
    this.li.dataset.partials = "0";  // delta events before the final pass began (partial text)
    this.partial = document.createElement("span");
    this.partial.className = "partial";
    this.finalEl = document.createElement("span");
    this.finalEl.className = "final";
    this.meta = document.createElement("span");
    this.meta.className = "meta";
    this.li.append(this.partial, this.finalEl, this.meta);
    list.append(this.li);
  }

  delta(text) {
    if (this.final !== null) return;
    if (!this.committed) this.li.dataset.partials = String(Number(this.li.dataset.partials) + 1);
    this.partial.textContent += text;
  }

  complete(transcript) {
    this.final = transcript;
    this.partial.textContent = "";
    this.finalEl.textContent = transcript;
    this.li.dataset.state = "final";
    if (this.stoppedAt !== null) {
      const ms = Math.round(performance.now() - this.stoppedAt);
      this.li.dataset.latencyMs = String(ms);
      this.meta.textContent = ` (final ${ms} ms after the end of speech)`;
    }
  }
}

function srt(turns) {
  return turns.filter((t) => t.final).map((t, i) =>
    `${i + 1}\n${clock(t.startMs / 1000)} --> ${clock((t.endMs ?? t.startMs) / 1000)}\n${t.final.trim()}\n`).join("\n");
}

export function initLive(status) {
  const $ = (id) => document.getElementById(id);
  const start = $("live-start"), stop = $("live-stop"), save = $("live-srt");
  const state = $("live-state"), error = $("live-error"), list = $("live-turns");
  let ws = null, audio = null, turns = [], byId = new Map();

  const setState = (text, running) => {
    state.textContent = text;
    start.disabled = running;
    stop.disabled = !running;
    save.disabled = running || !turns.some((t) => t.final);
    document.getElementById("panel-live").dataset.state = running ? "running" : "stopped";
  };

  const teardown = () => {
    if (audio) {
      audio.stream.getTracks().forEach((t) => t.stop());
      audio.context.close();
      audio = null;
    }
    if (ws && ws.readyState <= WebSocket.OPEN) ws.close();
    ws = null;
  };

  const startAudio = async (rate) => {
    const stream = await navigator.mediaDevices.getUserMedia(
      { audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    const context = new AudioContext({ sampleRate: rate });  // the browser resamples the microphone
    await context.audioWorklet.addModule("/ui/pcm-worklet.js");
    const node = new AudioWorkletNode(context, "pcm16", { processorOptions: { chunk: Math.round(rate * CHUNK_S) } });
    const mute = context.createGain();
    mute.gain.value = 0;
    context.createMediaStreamSource(stream).connect(node).connect(mute).connect(context.destination);
    node.port.onmessage = (e) => {
      if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(e.data) }));
    };
    audio = { stream, context };
  };

  const onEvent = async (event) => {
    const turn = byId.get(event.item_id);
    switch (event.type) {
      case "session.created": {
        const rate = event.session.audio.input.format.rate;
        const language = $("live-language").value.trim();
        if (language) {
          ws.send(JSON.stringify({ type: "session.update", session: { type: "transcription",
            audio: { input: { transcription: { model: status.model, language } } } } }));
        }
        await startAudio(rate);
        setState(`Listening (${rate} Hz).`, true);
        break;
      }
      case "input_audio_buffer.speech_started": {
        const t = new Turn(list, event.item_id, event.audio_start_ms);
        turns.push(t);
        byId.set(event.item_id, t);
        break;
      }
      case "input_audio_buffer.speech_stopped":
        if (turn) { turn.endMs = event.audio_end_ms; turn.stoppedAt = performance.now(); }
        break;
      case "input_audio_buffer.committed":
        if (turn) turn.committed = true;
        break;
      case "conversation.item.input_audio_transcription.delta":
        if (turn) turn.delta(event.delta);
        break;
      case "conversation.item.input_audio_transcription.completed":
        if (turn) turn.complete(event.transcript);
        break;
      case "conversation.item.input_audio_transcription.failed":
        if (turn) turn.meta.textContent = ` (failed: ${event.error.message})`;
        break;
      case "error":
        error.textContent = event.error.message;
        break;
      case "session.closed":
        teardown();
        setState("Stopped.", false);
        break;
    }
  };

  start.addEventListener("click", async () => {
    showError(error, null);
    turns = [];
    byId = new Map();
    list.replaceChildren();
    try {
      if (status.api_key_required) await api("/v1/models");  // a refused key: the server's words, not a bare 1006
    } catch (err) {
      showError(error, err);
      return;
    }
    const key = apiKey();
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime?intent=transcription&model=${encodeURIComponent(status.model)}`;
    ws = key ? new WebSocket(url, ["realtime", `openai-insecure-api-key.${key}`]) : new WebSocket(url);
    setState("Connecting…", true);
    ws.onmessage = (m) => onEvent(JSON.parse(m.data)).catch((err) => { showError(error, err); teardown(); setState("Stopped.", false); });
    ws.onclose = (e) => {
      if (ws) {
        if (e.code !== 1000) error.textContent = `The connection closed (code ${e.code}${e.reason ? `: ${e.reason}` : ""}).`;
        teardown();
        setState("Stopped.", false);
      }
    };
  });

  stop.addEventListener("click", () => {
    if (audio) {  // no more audio; the server finishes the open turn, then says session.closed
      audio.stream.getTracks().forEach((t) => t.stop());
      audio.context.close();
      audio = null;
    }
    if (ws && ws.readyState === WebSocket.OPEN) {
      ws.send(JSON.stringify({ type: "session.close" }));
      state.textContent = "Finishing the last turn…";
    } else {
      teardown();
      setState("Stopped.", false);
    }
  });

  save.addEventListener("click", () => download(new Blob([srt(turns)], { type: "text/plain" }), "live.srt"));
}
