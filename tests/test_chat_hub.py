"""Heavy chat requests never freeze a worker: the message count is bounded before any render
(``MAX_CHAT_MESSAGES``), and the template render and prompt tokenization run on native threads, so
``/healthz`` on both ports answers while they run.

Source: docs/ARCHITECTURE.md §15 (heavy work off the gevent hub); OpenAI API reference, "Chat
Completions".
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from model.chat_template import MAX_RENDER_S
from tests.server import SLACK_S, concurrently

PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server  # the session's SmolLM2 server (tests/conftest.py)


def test_too_many_messages_is_a_400_before_rendering(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}] * 30000, "max_tokens": 1}
    started = time.perf_counter()
    status, _, raw = server.post(PATH, body)
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "messages"), raw
    assert error["message"] == (
        "'messages' holds 30000 messages; the limit is 1024 (MAX_CHAT_MESSAGES)."
    )
    assert time.perf_counter() - started < MAX_RENDER_S + SLACK_S


def test_healthz_answers_while_heavy_chats_render(server):
    # Valid bodies under MAX_BODY_BYTES whose prompts take seconds to render and tokenize (and turn
    # out over MAX_PROMPT_TOKENS): one 1 MB message, and 1000 messages of 600 characters.
    heavy = [
        {"model": "m", "messages": [{"role": "user", "content": "hello world " * 85000}]},
        {"model": "m", "messages": [{"role": "user", "content": "hello " * 100}] * 1000},
    ]
    latencies: dict[int, list[float]] = {server.port: [], server.health_port: []}
    stop = threading.Event()

    def poll(port: int) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            status, _, _ = server.get("/healthz", port=port, timeout_s=30)
            assert status == 200
            latencies[port].append(time.perf_counter() - started)
            time.sleep(0.02)

    pollers = [threading.Thread(target=poll, args=(p,)) for p in latencies]
    for t in pollers:
        t.start()
    try:
        answers = concurrently(
            lambda i: server.post(PATH, heavy[i % 2], timeout_s=120), 6, timeout_s=180
        )
    finally:
        stop.set()
        for t in pollers:
            t.join()
    for status, _, raw in answers:
        error = json.loads(raw)["error"]
        assert (status, error["param"]) == (400, "messages"), raw
        assert "tokens; the limit is 32768." in error["message"]
    # Both ports kept answering while the renders ran, none held up by a render (each may run
    # for MAX_RENDER_S; the render threads share the GIL with the hub, hence the slack).
    for port, seen in latencies.items():
        assert len(seen) >= 5, (port, seen)
        assert max(seen) < MAX_RENDER_S + SLACK_S, (port, seen)
