"""Serving a Llama model: converted stories260K behind the real gunicorn, continuous batching
on a native thread, the hub never blocked (gevent's monitor thread watches), the same HTTP contract."""

from __future__ import annotations

import json
import signal

import pytest

from tests.collector import FakeCollector
from tests.llamafiles import expected_greedy
from tests.server import HUB_MONITOR_ENV, GunicornServer, assert_hub_never_blocked, concurrently
from tests.sse import EventReader, sse_events, sse_json


@pytest.fixture(scope="module")
def llama(stories_dir, tmp_path_factory):
    with FakeCollector() as collector:
        env = {
            "MODEL_DIR": str(stories_dir),
            **HUB_MONITOR_ENV,
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        }
        with GunicornServer(tmp_path_factory.mktemp("llama-server"), env) as srv:
            yield srv, collector
        assert_hub_never_blocked(srv)


def plain(srv, body):
    status, _, raw = srv.complete(body)
    assert status == 200, raw
    return json.loads(raw)


def test_greedy_matches_llama2c(llama):
    srv, _ = llama
    case = expected_greedy()["once_upon_a_time_256_steps"]
    n = len(case["generated_tokens"])
    doc = plain(
        srv,
        {
            "model": "stories",
            "prompt": case["prompt"],
            "max_tokens": n,
            "temperature": 0,
            "echo": True,
        },
    )
    assert doc["choices"][0]["text"] == case["text"]
    assert doc["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": n,
        "total_tokens": 5 + n,
        "prompt_tokens_details": {"cached_tokens": 0},  # a Llama has a prefix cache
    }
    _, _, raw = srv.complete(
        {
            "model": "stories",
            "prompt": case["prompt"],
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
        }
    )
    chunks = sse_json(raw)
    assert case["prompt"] + "".join(c["choices"][0]["text"] for c in chunks) == case["text"]


def test_eos_ends_with_stop_unless_ignored(llama):
    srv, _ = llama
    body = {"model": "s", "prompt": "Once upon a time", "max_tokens": 400, "seed": 133742}
    doc = plain(srv, body)
    assert doc["choices"][0]["finish_reason"] == "stop"
    assert doc["usage"]["completion_tokens"] < 400
    doc = plain(srv, {**body, "ignore_eos": True, "max_tokens": 300})
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 300


def test_alone_equals_beside_seven_others(llama):
    srv, _ = llama
    prompts = [
        "Once upon a time",
        "The cat",
        "Lily had a ball",
        "Tom was",
        "One day",
        "She ran",
        "The sun was",
        "Ben and Mia",
    ]
    bodies = [
        {
            "model": "s",
            "prompt": p,
            "max_tokens": 60,
            "seed": i,
            "ignore_eos": True,
            "temperature": 0 if i % 2 else 0.9,
        }
        for i, p in enumerate(prompts)
    ]
    alone = [plain(srv, b)["choices"][0]["text"] for b in bodies]
    together = concurrently(lambda i: plain(srv, bodies[i])["choices"][0]["text"], 8)
    assert together == alone
    assert len(set(alone)) == 8


def test_disconnect_cancels_only_that_sequence(llama):
    srv, collector = llama
    body = {
        "model": "s",
        "prompt": "Once upon a time",
        "max_tokens": 450,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    leaver = EventReader(srv.port, body, headers={"X-Request-Id": "llama-leaver"})
    stayer = EventReader(srv.port, body, headers={"X-Request-Id": "llama-stayer"})
    leaver.open(), stayer.open()
    for _ in range(4):
        leaver.next_frame()
    leaver.close()
    rest = stayer.resp.read()
    assert sse_events(b": ok\n\n" + rest)[-1] == b"[DONE]"

    def tokens(rid):
        return int(collector.span_for(rid)["attrs"]["gen_ai.usage.output_tokens"]["intValue"])

    assert tokens("llama-stayer") == 450
    assert tokens("llama-leaver") < 450
    stayer.close()


def test_context_limit_is_400_and_models_reports_it(llama):
    srv, _ = llama
    status, _, raw = srv.get("/v1/models")
    assert status == 200
    card = json.loads(raw)["data"][0]
    assert card["context_length"] == 512
    status, _, raw = srv.complete({"model": "s", "prompt": "Once upon a time", "max_tokens": 508})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    assert srv.complete({"model": "s", "prompt": "Once upon a time", "max_tokens": 507})[0] == 200
    status, _, raw = srv.complete({"model": "s", "prompt": [1] * 512, "max_tokens": 1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    status, _, raw = srv.complete({"model": "s", "prompt": [512], "max_tokens": 1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"


def test_logprobs_and_echo_scoring(llama):
    srv, _ = llama
    doc = plain(
        srv,
        {
            "model": "s",
            "prompt": "Once upon",
            "max_tokens": 3,
            "temperature": 0,
            "echo": True,
            "logprobs": 2,
        },
    )
    lp = doc["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == ["<s>", " Once", " upon"]  # BOS, then the prompt pieces
    assert lp["token_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) == 6 and all(len(t) == 2 for t in lp["top_logprobs"][1:])


def test_healthz_answers_while_the_engine_is_busy(llama):
    srv, _ = llama
    readers = [
        EventReader(
            srv.port,
            {"model": "s", "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True},
        )
        for _ in range(8)
    ]
    for r in readers:
        r.open()
        r.next_frame()
    for _ in range(20):
        assert srv.get("/healthz", port=srv.health_port)[0] == 200
    for r in readers:
        assert sse_events(b": ok\n\n" + r.resp.read())[-1] == b"[DONE]"
        r.close()
    assert_hub_never_blocked(srv)


def test_sigterm_drains_engine_streams(stories_dir, serve):
    # 50 tokens/s: 500 tokens take 10 s, so every stream is still running when the grace period
    # (3 s, streams end 1 s before it) runs out.
    srv = serve(
        MODEL_DIR=str(stories_dir), GRACEFUL_TIMEOUT_S="3", GREENSERVE_FAULTS="slow_step_s=0.02"
    )
    body = {"model": "s", "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
    readers = [EventReader(srv.port, body) for _ in range(6)]
    for r in readers:
        r.open()
        assert r.next_frame() == b": ok\n"
    srv.signal(signal.SIGTERM)
    for r in readers:
        payloads = sse_events(b": ok\n\n" + r.resp.read())
        assert payloads[-1] == b"[DONE]"
        last = json.loads(payloads[-2])
        assert (last["error"]["code"], last["error"]["message"]) == (
            "unavailable",
            "Server is shutting down; generation was ended early.",
        )
        assert 0 < len(payloads) - 2 < 500  # some tokens, then the final event
        r.close()
    assert srv.wait(30) == 0


def test_a_leaving_client_frees_its_batch_places_for_the_next(stories_dir, serve):
    # One slot: A streams 8 choices, B waits in the queue; A hangs up; B must be served, not refused
    # by a batch that still counts A's cancelled sequences.
    srv = serve(MODEL_DIR=str(stories_dir), MAX_SLOTS="1")
    for _ in range(3):
        a = EventReader(
            srv.port,
            {
                "model": "s",
                "prompt": "Once upon a time",
                "n": 8,
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            },
        )
        a.open()
        for _ in range(3):
            a.next_frame()
        b = EventReader(
            srv.port,
            {
                "model": "s",
                "prompt": "Once",
                "max_tokens": 20,
                "ignore_eos": True,
                "stream": True,
            },
        )
        b.open()
        a.close()
        payloads = sse_events(b": ok\n\n" + b.resp.read())
        b.close()
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert payloads[-1] == b"[DONE]" and "error" not in chunks[-1], chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in srv.log_text()


def test_default_slots_are_batch_rows(llama):
    srv, _ = llama
    s = srv.state()
    assert s["slots"]["total"] == 64 and s["queue"]["max"] == 256
