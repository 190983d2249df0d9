// "Transcribe a file": the file (picked or dropped) to /v1/audio/transcriptions
// (or /translations) as verbose_json; the transcript with its segment times (a
// segment plays the audio from its start); downloads in the server's formats.
import { api, download, shortClock, showError } from "./api.js";

const EXTENSIONS = { text: "txt", srt: "srt", vtt: "vtt", verbose_json: "json" };

function form(status, fields, format) {
  const data = new FormData();
  data.append("file", fields.file, fields.file.name);
  data.append("model", status.model);
  data.append("response_format", format);
  if (fields.language && !fields.translate) data.append("language", fields.language);
  if (fields.prompt) data.append("prompt", fields.prompt);
  data.append("temperature", String(fields.temperature));
  if (fields.beamSize !== 1) data.append("beam_size", String(fields.beamSize));
  if (fields.vad) data.append("vad_filter", "true");
  if (format === "verbose_json") {
    data.append("timestamp_granularities[]", "segment");
    if (fields.words) data.append("timestamp_granularities[]", "word");
  }
  return data;
}

function endpoint(fields) {
  return fields.translate ? "/v1/audio/translations" : "/v1/audio/transcriptions";
}

function readFields(file) {
  const $ = (id) => document.getElementById(id);
  return {
    file,
    language: $("tr-language").value.trim(),
    translate: $("tr-translate").checked,
    words: $("tr-words").checked,
    temperature: Number($("tr-temperature").value || 0),
    prompt: $("tr-prompt").value,
    beamSize: Number($("tr-beam-size").value || 1),  // the server refuses a bad one, naming beam_size
    vad: $("tr-vad").checked,
  };
}

function showSegments(result, audio) {
  const list = document.getElementById("tr-segments");
  list.replaceChildren();
  for (const seg of result.segments || []) {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.type = "button";
    b.className = "segment";
    b.dataset.start = seg.start;
    b.dataset.end = seg.end;
    b.setAttribute("aria-label", `Play from ${shortClock(seg.start)}: ${seg.text.trim()}`);
    const time = document.createElement("span");
    time.className = "time";
    time.textContent = `${shortClock(seg.start)} – ${shortClock(seg.end)}`;
    b.append(time, document.createTextNode(` ${seg.text.trim()}`));
    b.addEventListener("click", () => {
      audio.currentTime = seg.start;
      audio.play().catch(() => {});
    });
    li.append(b);
    list.append(li);
  }
}

// Word timestamps, when asked for: each word's times on hover; a click plays from it
// (the segments above are the keyboard's way to a place in the audio).
function showWords(result, audio) {
  const box = document.getElementById("tr-wordlist");
  box.replaceChildren();
  box.hidden = !(result.words && result.words.length);
  for (const w of result.words || []) {
    const span = document.createElement("span");
    span.className = "word";
    span.textContent = w.word;
    span.title = `${shortClock(w.start)} – ${shortClock(w.end)}`;
    span.addEventListener("click", () => { audio.currentTime = w.start; audio.play().catch(() => {}); });
    box.append(span, " ");
  }
}

export function initTranscribe(status) {
  const $ = (id) => document.getElementById(id);
  const input = $("tr-file"), drop = $("tr-drop"), audio = $("tr-audio"), error = $("tr-error");
  let last = null;  // the fields of the transcript shown (for its downloads)
  $("tr-vad-label").hidden = !status.vad;  // vad_filter only where the server has the VAD extra

  const useFile = (file) => {
    if (!file) return;
    audio.src = URL.createObjectURL(file);
    audio.hidden = false;
  };
  input.addEventListener("change", () => useFile(input.files[0]));
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    if (!e.dataTransfer.files.length) return;
    input.files = e.dataTransfer.files;
    useFile(input.files[0]);
  });

  $("tr-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const fields = readFields(input.files[0]);
    const progress = $("tr-progress"), elapsed = $("tr-elapsed"), run = $("tr-run");
    const t0 = performance.now();
    const timer = setInterval(() => { elapsed.textContent = `${((performance.now() - t0) / 1000).toFixed(0)} s`; }, 500);
    showError(error, null);
    elapsed.textContent = "";
    progress.hidden = false;
    run.disabled = true;
    try {
      const response = await api(endpoint(fields), { method: "POST", body: form(status, fields, "verbose_json") });
      const result = await response.json();
      $("tr-text").textContent = result.text;
      showSegments(result, audio);
      showWords(result, audio);
      $("tr-result").hidden = false;
      elapsed.textContent = `done in ${((performance.now() - t0) / 1000).toFixed(1)} s`;
      last = fields;
    } catch (err) {
      $("tr-result").hidden = true;
      elapsed.textContent = "";
      showError(error, err);
    } finally {
      clearInterval(timer);
      progress.hidden = true;
      run.disabled = false;
    }
  });

  for (const b of document.querySelectorAll("#tr-result .downloads button")) {
    b.addEventListener("click", async () => {
      if (!last) return;
      const format = b.dataset.format;
      try {
        const response = await api(endpoint(last), { method: "POST", body: form(status, last, format) });
        const stem = last.file.name.replace(/\.[^.]*$/, "") || "transcript";
        download(await response.blob(), `${stem}.${EXTENSIONS[format]}`);
      } catch (err) {
        showError(error, err);
      }
    });
  }
}
