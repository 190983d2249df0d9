// The page: the server's status line, the API key form, and the panels the
// loaded model serves (GET /ui/status says which), as keyboard-usable tabs.
import { apiKey, setApiKey, api, showError } from "./api.js";
import { initTranscribe } from "./transcribe.js";
import { initLive } from "./live.js";
import { initText } from "./text.js";

const TITLES = { transcribe: "Transcribe a file", live: "Live microphone", text: "Text" };
const INIT = { transcribe: initTranscribe, live: initLive, text: initText };

function statusLine(s) {
  const pct = s.kv_cache_usage === undefined ? "?" : `${(100 * s.kv_cache_usage).toFixed(1)}%`;
  return `${s.model} · ${s.device} · ${s.precision} · running ${s.running ?? 0}, ` +
    `waiting ${s.waiting ?? 0} · KV ${pct}` + (s.engine_running === false ? " · engine stopped" : "");
}

async function refreshStatus(el) {
  try {
    const s = await (await fetch("/ui/status")).json();
    el.textContent = statusLine(s);
    return s;
  } catch (e) {
    el.textContent = `The server does not answer: ${e.message}`;
    return null;
  }
}

function buildTabs(panels) {
  const nav = document.getElementById("tabs");
  const tabs = panels.map((name) => {
    const b = document.createElement("button");
    b.type = "button";
    b.id = `tab-${name}`;
    b.setAttribute("role", "tab");
    b.setAttribute("aria-controls", `panel-${name}`);
    b.textContent = TITLES[name];
    nav.append(b);
    return b;
  });
  const select = (i) => tabs.forEach((b, j) => {
    b.setAttribute("aria-selected", String(i === j));
    b.tabIndex = i === j ? 0 : -1;
    document.getElementById(b.getAttribute("aria-controls")).hidden = i !== j;
  });
  tabs.forEach((b, i) => {
    b.addEventListener("click", () => select(i));
    b.addEventListener("keydown", (e) => {  // arrow keys move between tabs (WAI-ARIA tabs)
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (step === undefined) return;
      const j = (i + step + tabs.length) % tabs.length;
      select(j);
      tabs[j].focus();
    });
  });
  select(0);
}

function initKeyForm(required) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  const error = document.getElementById("key-error");
  form.hidden = !required || Boolean(apiKey());
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    setApiKey(input.value.trim());
    try {
      await api("/v1/models");  // the server's own answer to the key
      showError(error, null);
      form.hidden = true;
      input.value = "";
    } catch (err) {
      showError(error, err);
    }
  });
  window.addEventListener("encdec:unauthorized", (e) => {
    setApiKey("");
    form.hidden = false;
    error.textContent = e.detail;
    input.focus();
  });
}

async function main() {
  const line = document.getElementById("status");
  const status = await refreshStatus(line);
  if (!status) return;
  document.title = `encdec · ${status.model}`;
  initKeyForm(status.api_key_required);
  if (status.speech_languages) {  // Whisper: language choices only where the model has languages
    const list = document.getElementById("speech-languages");
    for (const code of status.speech_languages) list.append(new Option(code, code));
    for (const el of document.querySelectorAll(".multilingual")) el.hidden = !status.speech_languages.length;
  }
  buildTabs(status.panels);
  for (const name of status.panels) INIT[name](status);
  document.body.dataset.ready = "true";
  setInterval(() => refreshStatus(line), 2000);
}

main();
