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

// One panel, one session at a time: the WebSocket, the microphone graph, the turns.
class LivePanel {
  constructor(status) {
    const $ = (id) => document.getElementById(id);
    this.status = status;
    this.el = { start: $("live-start"), stop: $("live-stop"), save: $("live-srt"), state: $("live-state"),
      error: $("live-error"), list: $("live-turns"), language: $("live-language"), panel: $("panel-live") };
    this.ws = null;
    this.audio = null;
    this.turns = [];
    this.byId = new Map();
    this.el.start.addEventListener("click", () => this.start());
    this.el.stop.addEventListener("click", () => this.stop());
    this.el.save.addEventListener("click", () => download(new Blob([srt(this.turns)], { type: "text/plain" }), "live.srt"));
  }

  setState(text, running) {
    const { state, start, stop, save, panel } = this.el;
    state.textContent = text;
    start.disabled = running;
    stop.disabled = !running;
    save.disabled = running || !this.turns.some((t) => t.final);
    panel.dataset.state = running ? "running" : "stopped";
  }

  stopAudio() {
    if (!this.audio) return;
    this.audio.stream.getTracks().forEach((t) => t.stop());
    this.audio.context.close();
    this.audio = null;
  }

  teardown(text = "Stopped.") {
    this.stopAudio();
    const ws = this.ws;
    this.ws = null;  // first: its close event is then ours, not an error
    if (ws && ws.readyState <= WebSocket.OPEN) ws.close();
    this.setState(text, false);
  }

  async startAudio(rate) {
    const stream = await navigator.mediaDevices.getUserMedia(
      { audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    const context = new AudioContext({ sampleRate: rate });  // the browser resamples the microphone
    await context.audioWorklet.addModule("/ui/pcm-worklet.js");
    const node = new AudioWorkletNode(context, "pcm16", { processorOptions: { chunk: Math.round(rate * CHUNK_S) } });
    const mute = context.createGain();  // the graph must reach the destination to run; silently
    mute.gain.value = 0;
    context.createMediaStreamSource(stream).connect(node).connect(mute).connect(context.destination);
    node.port.onmessage = (e) => {
      if (this.ws && this.ws.readyState === WebSocket.OPEN) {
        this.ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(e.data) }));
      }
    };
    this.audio = { stream, context };
  }

  async onSessionCreated(event) {
    const rate = event.session.audio.input.format.rate;
    const language = this.el.language.value.trim();
    if (language) {
      this.ws.send(JSON.stringify({ type: "session.update", session: { type: "transcription",
        audio: { input: { transcription: { model: this.status.model, language } } } } }));
    }
    await this.startAudio(rate);
    this.setState(`Listening (${rate} Hz).`, true);
  }

  async onEvent(event) {
    const turn = this.byId.get(event.item_id);
    switch (event.type) {
      case "session.created":
        return this.onSessionCreated(event);
      case "input_audio_buffer.speech_started": {
        const t = new Turn(this.el.list, event.item_id, event.audio_start_ms);
        this.turns.push(t);
        this.byId.set(event.item_id, t);
        return;
      }
      case "input_audio_buffer.speech_stopped":
        if (turn) { turn.endMs = event.audio_end_ms; turn.stoppedAt = performance.now(); }
        return;
      case "input_audio_buffer.committed":
        if (turn) turn.committed = true;
        return;
      case "conversation.item.input_audio_transcription.delta":
        if (turn) turn.delta(event.delta);
        return;
      case "conversation.item.input_audio_transcription.completed":
        if (turn) turn.complete(event.transcript);
        return;
      case "conversation.item.input_audio_transcription.failed":
        if (turn) turn.meta.textContent = ` (failed: ${event.error.message})`;
        return;
      case "error":
        this.el.error.textContent = event.error.message;
        return;
      case "session.closed":
        this.teardown();
    }
  }

  async start() {
    showError(this.el.error, null);
    this.turns = [];
    this.byId = new Map();
    this.el.list.replaceChildren();
    try {
      if (this.status.api_key_required) await api("/v1/models");  // a refused key: the server's words, not a bare 1006
    } catch (err) {
      showError(this.el.error, err);
      return;
    }
    const key = apiKey();
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime` +
      `?intent=transcription&model=${encodeURIComponent(this.status.model)}`;
    const ws = key ? new WebSocket(url, ["realtime", `openai-insecure-api-key.${key}`]) : new WebSocket(url);
    this.ws = ws;
    this.setState("Connecting…", true);
    ws.onmessage = (m) => this.onEvent(JSON.parse(m.data)).catch((err) => {
      showError(this.el.error, err);
      this.teardown();
    });
    ws.onclose = (e) => {
      if (this.ws !== ws) return;  // closed by us
      if (e.code !== 1000) this.el.error.textContent = `The connection closed (code ${e.code}${e.reason ? `: ${e.reason}` : ""}).`;
      this.teardown();
    };
  }

  stop() {
    this.stopAudio();  // no more audio; the server finishes the open turn, then says session.closed
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: "session.close" }));
      this.el.state.textContent = "Finishing the last turn…";
    } else {
      this.teardown();
    }
  }
}

export function initLive(status) {
  return new LivePanel(status);
}
