// The demo page: stream a completion through EventSource on GET /v1/completions, or, in chat mode
// (shown when the model has a chat template), a conversation's next answer on GET
// /v1/chat/completions with the conversation as the JSON query parameter `messages`.
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
  outputHeading: $("output-heading"),
  // Chat mode; all null when the page has no chat mode.
  system: $("system"),
  message: $("message"),
  conversation: $("conversation"),
  newChat: $("new-chat"),
};
const modes = [...document.querySelectorAll('input[name="mode"]')];
// gunicorn refuses request lines over 8190 bytes; keep the stream's URL well below that.
const MAX_URL_BYTES = 8000;

// The current stream; exposed for tests and the console (readyState 2 = closed for good).
const run = { source: null, opened: 0, first: 0, lastToken: 0, tokens: 0, seed: null };
window.greenserve = run;
// The conversation so far: {role, content} turns, user and assistant (the system message is sent
// from its field each time); the answer being streamed joins it when its stream ends.
const chat = { messages: [], answer: null };
run.chat = chat;

const mode = () => root.dataset.mode;

function setState(state, message) {
  root.dataset.state = state;
  ui.state.textContent = message;
  const busy = state === "connecting" || state === "streaming";
  ui.generate.disabled = busy;
  ui.stop.disabled = !busy;
  for (const m of modes) m.disabled = busy;
  if (ui.newChat) ui.newChat.disabled = busy || chat.messages.length === 0;
}

function setMode(next) {
  root.dataset.mode = next;
  for (const el of document.querySelectorAll("[data-for]")) el.hidden = el.dataset.for !== next;
  ui.prompt.required = next === "complete";
  if (ui.message) ui.message.required = next === "chat";
  ui.generate.textContent = next === "chat" ? "Send" : "Generate";
  ui.outputHeading.textContent = next === "chat" ? "Conversation" : "Continuation";
  const ready = next === "chat" ? "Ready: write a message and press Send." : "Ready: press Generate.";
  if (root.dataset.state !== "streaming" && root.dataset.state !== "connecting") setState("idle", ready);
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

// The messages of the next chat request: the system message, the conversation, the new message.
function chatMessages(message) {
  const system = ui.system.value.trim() ? [{ role: "system", content: ui.system.value }] : [];
  return [...system, ...chat.messages, { role: "user", content: message }];
}

// The URL of the stream: the request's fields (empty seed = the server picks one).
function streamUrl(messages) {
  const params = new URLSearchParams({ model: root.dataset.model });
  if (messages) params.set("messages", JSON.stringify(messages));
  else params.set("prompt", ui.prompt.value);
  params.set("max_tokens", ui.maxTokens.value);
  params.set("temperature", ui.temperature.value);
  if (ui.seed.value.trim()) params.set("seed", ui.seed.value.trim());
  if (ui.apiKey.value) params.set("api_key", ui.apiKey.value);
  return `/v1/${messages ? "chat/completions" : "completions"}?${params}`;
}

function invalidField() {
  const text = mode() === "chat" ? [ui.system, ui.message] : [ui.prompt];
  for (const input of [...text, ui.temperature, ui.maxTokens, ui.seed, ui.apiKey]) {
    if (!input.checkValidity()) return input;
  }
  return null;
}

// One turn of the conversation on the page: its role and its text (a text node, never HTML).
function addTurn(role, content) {
  const item = document.createElement("li");
  item.className = `turn turn-${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = { user: "You", assistant: "Assistant", system: "System" }[role];
  const text = document.createElement("p");
  text.className = "content";
  text.textContent = content;
  item.append(label, text);
  ui.conversation.append(item);
  return item;
}

function scrollConversation() {
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

function newConversation() {
  chat.messages = [];
  chat.answer = null;
  ui.conversation.textContent = "";
  showError("");
  Object.assign(run, { tokens: 0, first: 0, seed: null });
  updateMeters();
  setState("idle", "Ready: write a message and press Send.");
}

function finish(state, message) {
  if (run.source) run.source.close();
  if (chat.answer) endAnswer(state);
  updateMeters();
  setState(state, message);
}

// The streamed answer joins the conversation when it ended or was stopped (what was said stays said);
// with no token (refused, or stopped at once), the question goes back into the message box to retry.
function endAnswer(state) {
  const { item, text, message } = chat.answer;
  chat.answer = null;
  item.classList.remove("pending");
  if (state !== "done" && !run.tokens) {
    item.previousElementSibling.remove();
    item.remove();
    ui.message.value = message;
    return;
  }
  chat.messages.push({ role: "user", content: message }, { role: "assistant", content: text.textContent });
  if (state !== "done") {
    const note = document.createElement("span");
    note.className = "note";
    note.textContent = state === "stopped" ? "Stopped." : "Interrupted by an error.";
    item.append(note);
  }
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
  if (!choice) return; // a usage chunk
  if (choice.finish_reason) run.finishReason = choice.finish_reason;
  // A chat stream opens with a role chunk and ends with an empty delta: neither is a token.
  const delta = choice.delta;
  if (delta && (delta.role || delta.content === undefined)) return;
  if (!run.first) run.first = now;
  run.lastToken = now;
  run.tokens += 1;
  const text = delta ? delta.content : choice.text;
  if (text) {
    if (delta) {
      chat.answer.text.append(text);
      scrollConversation();
    } else ui.completion.append(text);
  }
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
  const message = mode() === "chat" ? ui.message.value : null;
  const url = streamUrl(message === null ? null : chatMessages(message));
  if (new TextEncoder().encode(url).length > MAX_URL_BYTES) {
    showError(
      message === null
        ? "The prompt is too long for a streamed GET request; shorten it."
        : "The conversation is too long for a streamed GET request; start a new conversation.",
    );
    (message === null ? ui.prompt : ui.message).focus();
    return;
  }
  showError("");
  Object.assign(run, { opened: performance.now(), first: 0, lastToken: 0, tokens: 0, seed: null });
  run.finishReason = null;
  if (message === null) {
    ui.promptEcho.textContent = ui.prompt.value;
    ui.completion.textContent = "";
  } else {
    addTurn("user", message);
    const item = addTurn("assistant", "");
    item.classList.add("pending");
    chat.answer = { item, text: item.querySelector(".content"), message };
    ui.message.value = "";
    scrollConversation();
  }
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
// Ctrl+Enter (or Cmd+Enter) in the prompt or the message starts a run, as in most playgrounds.
for (const box of [ui.prompt, ui.message]) {
  box?.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });
}
for (const m of modes) m.addEventListener("change", () => setMode(m.value));
ui.newChat?.addEventListener("click", newConversation);
if (modes.length) setMode(modes.find((m) => m.checked).value); // a reload keeps the checked mode
