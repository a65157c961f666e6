// The demo page: stream a completion through EventSource on GET /v1/completions.
//
// One stream at a time. The page closes the stream itself on [DONE] (otherwise the browser would
// reconnect when the server ends the response), on an error event, and when Stop is pressed (the
// server notices at its next write and frees the slot). TTFT is measured from opening the stream to
// the first token event; speed is tokens after the first over the time since the first.

const root = document.getElementById("demo");
const form = document.getElementById("request");
const $ = (id) => document.getElementById(id);
const ui = {
  prompt: $("prompt"),
  temperature: $("temperature"),
  maxTokens: $("max_tokens"),
  seed: $("seed"),
  apiKey: $("api_key"),
  generate: $("generate"),
  stop: $("stop"),
  state: $("state"),
  error: $("error"),
  promptEcho: $("prompt-echo"),
  completion: $("completion"),
  ttft: $("ttft"),
  tps: $("tps"),
  tokens: $("tokens"),
  seedUsed: $("seed-used"),
};
// gunicorn refuses request lines over 8190 bytes; keep the stream's URL well below that.
const MAX_URL_BYTES = 8000;

// The current stream; exposed for tests and the console (readyState 2 = closed for good).
const run = { source: null, opened: 0, first: 0, lastToken: 0, tokens: 0, seed: null };
window.greenserve = run;

function setState(state, message) {
  root.dataset.state = state;
  ui.state.textContent = message;
  const busy = state === "connecting" || state === "streaming";
  ui.generate.disabled = busy;
  ui.stop.disabled = !busy;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

function formatMs(seconds) {
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  return `${seconds.toFixed(2)} s`;
}

function updateMeters() {
  ui.tokens.textContent = String(run.tokens);
  ui.ttft.textContent = run.first ? formatMs((run.first - run.opened) / 1000) : "—";
  const span = (run.lastToken - run.first) / 1000;
  ui.tps.textContent = run.tokens > 1 && span > 0 ? ((run.tokens - 1) / span).toFixed(1) : "—";
  ui.seedUsed.textContent = run.seed ?? "—";
}

// The query string of the stream: the request's fields (empty seed = the server picks one).
function streamUrl() {
  const params = new URLSearchParams({
    model: root.dataset.model,
    prompt: ui.prompt.value,
    max_tokens: ui.maxTokens.value,
    temperature: ui.temperature.value,
  });
  if (ui.seed.value.trim()) params.set("seed", ui.seed.value.trim());
  if (ui.apiKey.value) params.set("api_key", ui.apiKey.value);
  return `/v1/completions?${params}`;
}

function invalidField() {
  for (const input of [ui.prompt, ui.temperature, ui.maxTokens, ui.seed, ui.apiKey]) {
    if (!input.checkValidity()) return input;
  }
  return null;
}

function finish(state, message) {
  if (run.source) run.source.close();
  updateMeters();
  setState(state, message);
}

// EventSource hides the status and body of a refused stream: ask once more with fetch to show the
// server's error message (a 200 this time is cancelled at once).
async function explainRefusal(url) {
  const abort = new AbortController();
  try {
    const response = await fetch(url, { headers: { Accept: "text/event-stream" }, signal: abort.signal });
    if (response.ok) {
      abort.abort();
      return "The stream was interrupted; try again.";
    }
    const body = await response.json().catch(() => null);
    const detail = body?.error?.message ?? response.statusText;
    return `${response.status}: ${detail}`;
  } catch (err) {
    return `Could not reach the server (${err.message}).`;
  }
}

function onMessage(event) {
  if (event.data === "[DONE]") {
    // Close before the browser sees the end of the response and reconnects.
    if (root.dataset.state === "streaming" || root.dataset.state === "connecting") {
      finish("done", `Done: ${run.tokens} tokens, finish reason “${run.finishReason ?? "—"}”.`);
    } else {
      run.source.close();
    }
    return;
  }
  const now = performance.now();
  run.seed = event.lastEventId.split("-")[0] || run.seed;
  const chunk = JSON.parse(event.data);
  if (chunk.error) {
    showError(`The server stopped the stream: ${chunk.error.message}`);
    finish("error", "Stopped by a server error.");
    return;
  }
  const choice = chunk.choices[0];
  if (!run.first) run.first = now;
  run.lastToken = now;
  run.tokens += 1;
  if (choice.text) ui.completion.append(choice.text);
  if (choice.finish_reason) run.finishReason = choice.finish_reason;
  if (root.dataset.state !== "streaming") setState("streaming", "Streaming…");
  updateMeters();
}

function start(event) {
  event.preventDefault();
  const bad = invalidField();
  if (bad) {
    showError(`${bad.labels[0].firstChild.textContent.trim()}: ${bad.validationMessage}`);
    bad.focus();
    return;
  }
  const url = streamUrl();
  if (new TextEncoder().encode(url).length > MAX_URL_BYTES) {
    showError("The prompt is too long for a streamed GET request; shorten it.");
    ui.prompt.focus();
    return;
  }
  showError("");
  Object.assign(run, { opened: performance.now(), first: 0, lastToken: 0, tokens: 0, seed: null });
  run.finishReason = null;
  ui.promptEcho.textContent = ui.prompt.value;
  ui.completion.textContent = "";
  updateMeters();
  setState("connecting", "Waiting for the first token…");

  const source = new EventSource(url);
  run.source = source;
  source.onmessage = (e) => {
    if (run.source === source) onMessage(e);
  };
  source.onerror = async () => {
    if (run.source !== source) return;
    if (source.readyState === EventSource.CONNECTING) {
      // A dropped connection: the browser resumes after the last event id it got.
      setState("streaming", "Connection lost; resuming…");
      return;
    }
    // CLOSED: the server refused the stream (4xx, 5xx) and the browser will not retry.
    finish("error", "The server refused the request.");
    showError(await explainRefusal(url));
  };
}

function stop() {
  if (!run.source) return;
  finish("stopped", `Stopped after ${run.tokens} tokens.`);
}

form.addEventListener("submit", start);
ui.stop.addEventListener("click", stop);
// Ctrl+Enter (or Cmd+Enter) in the prompt starts a run, as in most playgrounds.
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
});
