// The page's one way to the server: the API key (kept for this browser tab's
// session), errors as the server worded them, and a reader for SSE streams.
const KEY = "encdec.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

// An HTTP error: `message` is the server's own (OpenAI's {"error": {"message"}}).
export class ServerError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return new ServerError(response.status, body.error.message);
  } catch (_) { /* not JSON: the body's text is the message */ }
  return new ServerError(response.status, text || `${response.status} ${response.statusText}`);
}

// fetch() with the API key; a non-2xx answer throws its ServerError, and a 401
// tells the page (the key form comes back) through an "encdec:unauthorized" event.
export async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...init, headers });
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401) window.dispatchEvent(new CustomEvent("encdec:unauthorized", { detail: error.message }));
    throw error;
  }
  return response;
}

export function postJSON(path, body, init = {}) {
  return api(path, { ...init, method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

// The JSON events of a text/event-stream body, up to "data: [DONE]"; an in-band
// {"error": {...}} event throws its message.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ServerError(event.error.code || 500, event.error.message);
      yield event;
    }
  }
}

// Seconds -> "HH:MM:SS,mmm" (SRT; sep "." for VTT) or "M:SS.ss" for the page.
export function clock(seconds, sep = ",") {
  const ms = Math.round(seconds * 1000);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(Math.floor(ms / 3600000))}:${pad(Math.floor(ms / 60000) % 60)}:${pad(Math.floor(ms / 1000) % 60)}${sep}${pad(ms % 1000, 3)}`;
}

export function shortClock(seconds) {
  const m = Math.floor(seconds / 60);
  return `${m}:${(seconds - m * 60).toFixed(2).padStart(5, "0")}`;
}

// Offer `blob` as a download named `name` (an <a download> the page clicks).
export function download(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

export function showError(element, error) {
  element.textContent = error ? (error.message || String(error)) : "";
}
