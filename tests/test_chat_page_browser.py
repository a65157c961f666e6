"""The demo page's chat mode in a real browser (``tests.browser``: Debian's headless Chromium driven by
Playwright): a conversation whose answers stream in on ``GET /v1/chat/completions`` (``EventSource``),
Stop, the seed shown, and what the page shows when the server refuses.

Every answer the page shows is compared with the same request POSTed from Python (streamed), so the
page neither drops nor adds a byte. The server streams slowly (``slow_step_s``) so that each token is
its own update, and requires an API key (sent as ``api_key``). Screenshots go to ``test-artifacts/``.

Source: OpenAI API reference, "Chat Completions" (streamed ``chat.completion.chunk``); WHATWG HTML
Living Standard §9.2 (``EventSource``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import quote_plus, urlencode

import pytest
from playwright.sync_api import Browser, Page

from tests.browser import (
    NARROW,
    Watch,
    check_page,
    needs_chromium,
    new_page,
    screenshot,
    stop_running,
)
from tests.server import GunicornServer
from tests.sse import sse_json

KEY = "chat-key-1"
SLOW_STEP_S = 0.05
MODEL = "bigram"
PATH = "/v1/chat/completions"

pytestmark = [pytest.mark.browser, needs_chromium]

# Record every change of the answer being streamed (its length and the page's state at that moment),
# from its first character on (the empty answer is added while connecting).
RECORD = """() => {
  window.samples = [];
  window.recorder?.disconnect();
  const list = document.getElementById("conversation");
  window.recorder = new MutationObserver(() => {
    const answer = list.querySelector(".turn.pending .content");
    if (answer?.textContent) window.samples.push({
      length: answer.textContent.length,
      state: document.getElementById("demo").dataset.state,
    });
  });
  window.recorder.observe(list, { childList: true, characterData: true, subtree: true });
}"""

# The conversation as the page shows it: (role label, text) per turn.
TURNS = """() => [...document.querySelectorAll("#conversation .turn")].map((t) => [
  t.querySelector(".role").textContent, t.querySelector(".content").textContent,
])"""


@pytest.fixture(scope="module")
def server(serve_module) -> GunicornServer:
    return serve_module(GREENSERVE_FAULTS=f"slow_step_s={SLOW_STEP_S}", API_KEYS=KEY)


@pytest.fixture
def page(browser: Browser, server: GunicornServer) -> Iterator[tuple[Page, Watch]]:
    for pg, watch in new_page(browser):
        pg.goto(server.url + "/")
        pg.click("label[for=mode-chat]")
        yield pg, watch


def streamed_answer(server: GunicornServer, messages: list[dict], **params) -> tuple[str, int, str]:
    """POST the chat request the page makes, streamed; return (answer, content chunks, finish reason)."""
    body = {"model": MODEL, "messages": messages, "stream": True, **params}
    status, _, raw = server.post(PATH, body, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, raw
    chunks = sse_json(raw)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    pieces = [d["content"] for d in deltas[1:-1]]
    return "".join(pieces), len(pieces), chunks[-1]["choices"][0]["finish_reason"]


def page_url(server: GunicornServer, messages: list[dict], **params) -> str:
    """The stream URL the page opens: its fields in the page's order, form-encoded like URLSearchParams."""
    query = {"model": MODEL, "messages": json.dumps(messages, separators=(",", ":"))}
    query.update({k: str(v) for k, v in params.items()})
    # URLSearchParams leaves * - . _ unescaped and writes a space as +.
    return f"{server.url}{PATH}?{urlencode(query, quote_via=quote_plus, safe='*')}"


def send(pg: Page, message: str, max_tokens: int, seed: int | None, key: str = KEY) -> None:
    pg.fill("#message", message)
    pg.fill("#temperature", "0.8")
    pg.fill("#max_tokens", str(max_tokens))
    pg.fill("#seed", "" if seed is None else str(seed))
    pg.fill("#api_key", key)
    pg.click("#generate")


def test_chat_mode_streams_each_answer_of_a_conversation(server, page):
    pg, watch = page
    assert pg.text_content("#output-heading") == "Conversation"
    assert pg.text_content("#generate") == "Send"
    assert pg.is_hidden("#prompt") and pg.is_visible("#message") and pg.is_hidden("#output")
    pg.fill("#system", "Speak as a king.")
    messages = [{"role": "system", "content": "Speak as a king."}]
    for turn, (message, seed) in enumerate([("Who goes there?", 11), ("Speak louder!", 12)]):
        messages.append({"role": "user", "content": message})
        expected, tokens, finish = streamed_answer(
            server, messages, max_tokens=30, temperature=0.8, seed=seed
        )
        assert tokens >= 10  # enough updates to see it stream
        pg.evaluate(RECORD)
        send(pg, message, 30, seed)
        assert pg.input_value("#message") == ""  # the message moved into the conversation
        pg.wait_for_selector('#demo[data-state="done"]')

        answer = pg.text_content("#conversation .turn:last-child .content")
        assert answer == expected
        lengths = [s["length"] for s in pg.evaluate("window.samples")]
        # The answer grew in many separate updates, all while the page said it was streaming.
        assert len(lengths) >= 10 and lengths == sorted(set(lengths))
        assert lengths[-1] == len(expected)
        assert {s["state"] for s in pg.evaluate("window.samples")} == {"streaming"}
        assert pg.text_content("#tokens") == str(tokens)
        assert pg.text_content("#seed-used") == str(seed)
        assert pg.text_content("#state") == f"Done: {tokens} tokens, finish reason “{finish}”."
        assert re.fullmatch(r"\d+\.\d", pg.text_content("#tps"))
        assert pg.evaluate("window.greenserve.source.readyState") == 2  # closed on [DONE]
        streams = [u for u in watch.urls if PATH in u]
        assert streams[turn] == page_url(
            server, messages, max_tokens=30, temperature=0.8, seed=seed, api_key=KEY
        )
        messages.append({"role": "assistant", "content": expected})

    assert pg.evaluate(TURNS) == [
        ["You", "Who goes there?"],
        ["Assistant", messages[2]["content"]],
        ["You", "Speak louder!"],
        ["Assistant", messages[4]["content"]],
    ]
    assert len([u for u in watch.urls if PATH in u]) == 2
    check_page(pg, watch, server.url)
    screenshot(pg, "chat.png")
    pg.set_viewport_size(NARROW)
    check_page(pg, watch, server.url)
    screenshot(pg, "chat-narrow.png")
    pg.emulate_media(color_scheme="dark")
    check_page(pg, watch, server.url)
    screenshot(pg, "chat-dark.png")

    pg.click("#new-chat")
    assert pg.evaluate(TURNS) == [] and pg.evaluate("window.greenserve.chat.messages") == []
    assert pg.is_disabled("#new-chat")


def test_the_seed_the_server_picked_is_shown_and_reproduces_the_answer(server, page):
    pg, _ = page
    send(pg, "Hello!", 20, None)
    pg.wait_for_selector('#demo[data-state="done"]')
    seed = pg.text_content("#seed-used")
    assert re.fullmatch(r"\d+", seed)
    answer = pg.text_content("#conversation .turn:last-child .content")
    expected, _, _ = streamed_answer(
        server,
        [{"role": "user", "content": "Hello!"}],
        max_tokens=20,
        temperature=0.8,
        seed=int(seed),
    )
    assert answer == expected


def test_stop_ends_the_answer_and_frees_the_slot(server, page):
    pg, watch = page
    send(pg, "Tell me a long story.", 4096, 3)  # about 200 s of tokens at the injected pace
    pg.wait_for_function(
        "() => document.querySelector('#conversation .pending .content').textContent.length >= 5"
    )
    text = stop_running(pg, server, "#conversation .turn:last-child .content", SLOW_STEP_S)
    assert len(text) >= 5
    assert pg.text_content("#conversation .turn:last-child .note") == "Stopped."
    # What was said stays in the conversation: the next request carries it.
    assert pg.evaluate("window.greenserve.chat.messages") == [
        {"role": "user", "content": "Tell me a long story."},
        {"role": "assistant", "content": text},
    ]
    assert pg.is_enabled("#generate") and not pg.is_enabled("#stop")
    assert pg.is_enabled("#mode-complete") and pg.is_enabled("#new-chat")
    assert watch.errors == []


def test_a_refused_request_shows_the_servers_message_and_keeps_the_question(server, page):
    pg, _ = page
    send(pg, "Are you there?", 5, 1, key="wrong")
    pg.wait_for_selector('#demo[data-state="error"]')
    pg.wait_for_selector("#error:not([hidden])")
    assert pg.text_content("#error") == "401: Invalid API key."
    assert pg.text_content("#state") == "The server refused the request."
    assert pg.evaluate(TURNS) == [] and pg.evaluate("window.greenserve.chat.messages") == []
    assert pg.input_value("#message") == "Are you there?"  # back in the box, to send again


def test_switching_back_to_complete_mode_keeps_the_conversation(server, page):
    pg, _ = page
    send(pg, "Hi.", 3, 5)
    pg.wait_for_selector('#demo[data-state="done"]')
    pg.click("label[for=mode-complete]")
    assert pg.text_content("#output-heading") == "Continuation"
    assert pg.text_content("#generate") == "Generate"
    assert pg.is_visible("#prompt") and pg.is_hidden("#conversation")
    # The mode switch is a radio group: arrow keys move between the modes.
    pg.focus("#mode-complete")
    pg.keyboard.press("ArrowRight")
    assert pg.get_attribute("#demo", "data-mode") == "chat" and pg.is_visible("#conversation")
    assert [role for role, _ in pg.evaluate(TURNS)] == ["You", "Assistant"]
