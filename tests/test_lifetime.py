"""Stream lifetime: every path gives its slot back, and overload is an honest 429.

Each test drives a real gunicorn, then asserts via ``/debug/state`` that no slot is busy and nothing is
queued once the traffic stops.
"""

from __future__ import annotations

import json
import signal

import pytest

from model.loader import BIGRAM, LLAMA
from tests.collector import FakeCollector
from tests.server import GunicornServer, concurrently, wait_until
from tests.sse import EventReader, open_stream, sse_events

SLOW = "slow_step_s=0.02"  # 50 tokens/s: long enough streams to disconnect from, short tests


@pytest.fixture(scope="module")
def srv(succ_dir, collector, serve_module):
    """A server with slow steps, 2 slots, a queue of 2, quick heartbeats, and a collector."""
    return serve_module(
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS=SLOW,
        MAX_SLOTS="2",
        MAX_QUEUE="2",
        HEARTBEAT_S="0.2",
        SEND_TIMEOUT_S="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
    )


def test_normal_end_frees_the_slot(srv):
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 5, "stream": True})
    assert status == 200 and sse_events(body)[-1] == b"[DONE]"
    s = srv.wait_idle()
    assert s["slots"] == {"busy": 0, "total": 2}
    assert s["queue"] == {"waiting": 0, "max": 2}


def test_disconnect_mid_stream_stops_generation(srv, collector):
    body = {"model": "m", "prompt": "a", "max_tokens": 2000, "stream": True}
    reader = open_stream(srv.port, body, "disc-mid")
    assert reader.resp.status == 200
    assert reader.next_frame() == b": ok\n"
    for _ in range(5):
        assert reader.next_frame().startswith(b"data: {")
    assert srv.state()["slots"]["busy"] == 1
    reader.close()
    srv.wait_idle()
    span = collector.span_for("disc-mid")
    generated = int(span["attrs"]["gen_ai.usage.output_tokens"]["intValue"])
    # It stopped within a token or two of the disconnect, nowhere near max_tokens.
    assert 5 <= generated <= 10, generated


def test_disconnect_while_queued(srv):
    body = {"model": "m", "prompt": "a", "max_tokens": 2000, "stream": True}
    holders = [EventReader(srv.port, body) for _ in range(2)]
    for h in holders:
        h.open()
        h.next_frame()
    queued = EventReader(srv.port, body)
    assert queued.open().status == 200
    assert queued.next_frame() == b": ok\n"
    assert queued.next_frame() == b": queued\n"  # after one heartbeat, still no slot
    s = srv.state()
    assert (s["slots"]["busy"], s["queue"]["waiting"]) == (2, 1)
    queued.close()
    wait_until(lambda: srv.state()["queue"]["waiting"] == 0, what="queue to empty")
    for h in holders:
        h.close()
    srv.wait_idle()


def test_queued_plain_request_runs_when_a_slot_frees(srv):
    holder = EventReader(srv.port, {"model": "m", "prompt": "a", "max_tokens": 30, "stream": True})
    holder2 = EventReader(srv.port, {"model": "m", "prompt": "a", "max_tokens": 30, "stream": True})
    holder.open(), holder2.open()
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "bcd"
    holder.close(), holder2.close()
    srv.wait_idle()


def test_burst_of_ten_times_capacity(srv):
    # All 40 arrive together (capacity 2 + 2); each needs 1 s of slot time (50 slow tokens).
    body = {"model": "m", "prompt": "a", "max_tokens": 50, "temperature": 0}
    results = concurrently(lambda _: srv.complete(body), 40)
    statuses = sorted(r[0] for r in results)
    # All 40 arrive within the first stream's second: 2 run, 2 queue, the other 36 are refused.
    assert statuses == [200] * 4 + [429] * 36, statuses
    for status, headers, body in results:
        if status == 200:
            assert json.loads(body)["choices"][0]["text"] == bytes(range(98, 148)).decode(
                "utf-8", "replace"
            )
        else:
            err = json.loads(body)["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "server_busy")
            assert int(headers["retry-after"]) >= 1
            assert "queued" in err["message"]
    srv.wait_idle()


def test_debug_state_lists_in_flight_requests(srv):
    body = {"model": "m", "prompt": "a", "max_tokens": 500, "stream": True}
    reader = open_stream(srv.port, body, "inflight-1")
    for _ in range(4):
        reader.next_frame()
    s = srv.state()
    (entry,) = s["requests"]
    assert entry["request_id"] == "inflight-1" and entry["state"] == "running"
    assert entry["tokens"] >= 3 and entry["age_s"] > 0 and 0 < entry["deadline_in_s"] <= 60
    reader.close()
    srv.wait_idle()


def test_startup_objects_are_frozen_out_of_the_collector(srv):
    gc_state = srv.state()["gc"]
    # The app, Flask, numpy and the model: tens of thousands of objects no full collection walks.
    assert gc_state["frozen"] > 20_000
    assert len(gc_state["counts"]) == len(gc_state["collections"]) == 3


def test_debug_endpoints_refuse_forwarded_requests(srv):
    for method, path in (("GET", "/debug/state"), ("POST", "/debug/drain")):
        status, _, body = srv.request(method, path, headers={"X-Forwarded-For": "127.0.0.1"})
        assert status == 404
        assert json.loads(body)["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:80",
        "127.0.0.1.evil.example",
        "10.0.0.1",
        "localhost.evil.example",
    ],
)
def test_debug_endpoints_answer_only_a_loopback_host(srv, host):
    # A page on another name that resolves to 127.0.0.1 (DNS rebinding) must not read them.
    for method, path in (("GET", "/debug/state"), ("POST", "/debug/drain")):
        status, _, body = srv.request(method, path, headers={"Host": host})
        assert status == 404, (host, path)
        assert json.loads(body)["error"]["type"] == "not_found_error"
    assert srv.get("/ready")[0] == 200


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}"]
)
def test_debug_state_answers_a_loopback_host(srv, host):
    status, _, body = srv.request(
        "GET", "/debug/state", headers={"Host": host.format(port=srv.port)}
    )
    assert status == 200 and "slots" in json.loads(body)


@pytest.fixture
def make_server(succ_dir, serve):
    """Return ``make(faults="", **env)``: a started succ-model server with ``GREENSERVE_FAULTS``."""

    def make(faults: str = "", **env: str) -> GunicornServer:
        if faults:
            env["GREENSERVE_FAULTS"] = faults
        return serve(MODEL_DIR=str(succ_dir), **env)

    return make


def test_reader_that_never_reads_is_cut(make_server):
    srv = make_server(SEND_TIMEOUT_S="1")
    # 8 choices of 4096 tokens: ~5 MB of events, far more than the socket buffers hold.
    reader = EventReader(
        srv.port,
        {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 8, "stream": True},
        rcvbuf=4096,
    )
    # Never read: the server's writes block and SEND_TIMEOUT_S=1 cuts the stream well before the
    # 60 s deadline; the slot comes back.
    wait_until(lambda: srv.state()["slots"]["busy"] == 1, what="stream start")
    s = srv.wait_idle(timeout_s=20)
    assert s["slots"]["busy"] == 0
    reader.close()


def test_deadline_before_first_byte_is_504(make_server):
    srv = make_server(SLOW, REQUEST_TIMEOUT_S="0.3")
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 100})
    assert status == 504
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("server_error", "timeout")
    # After the first byte: a final error event and [DONE].
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 100, "stream": True})
    assert status == 200
    payloads = sse_events(body)
    assert payloads[-1] == b"[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "timeout"
    assert 5 <= len(payloads) - 2 <= 20  # ~15 tokens at 50/s in 0.3 s
    srv.wait_idle()
    # Both log lines say why, whether the status could still change or not.
    lines = [json.loads(x) for x in srv.log_text().splitlines() if '"message": "request"' in x]
    lines = [x for x in lines if x["path"] == "/v1/completions"]
    assert [(x["status"], x["finish_reason"], x["error"]) for x in lines] == [
        (504, "error", "Request timed out after 0.3 s."),
        (200, "error", "Request timed out after 0.3 s."),
    ]


def test_engine_exception(make_server):
    srv = make_server("fail_at=3")
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 10})
    assert status == 500
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("server_error", "engine_error")
    status, _, body = srv.complete(
        {"model": "m", "prompt": "a", "max_tokens": 10, "temperature": 0, "stream": True}
    )
    payloads = sse_events(body)
    assert status == 200
    assert [json.loads(p)["choices"][0]["text"] for p in payloads[:2]] == ["b", "c"]
    assert json.loads(payloads[2])["error"]["code"] == "engine_error"
    assert payloads[3:] == [b"[DONE]"]
    # A non-fatal failure keeps the worker ready.
    assert srv.get("/ready")[0] == 200
    srv.wait_idle()


def test_fatal_engine_failure_turns_readiness_off(make_server):
    srv = make_server("fail_at=2,fatal=1")
    assert srv.complete({"model": "m", "prompt": "a", "max_tokens": 5})[0] == 500
    status, _, body = srv.get("/ready")
    assert status == 503 and json.loads(body) == {"status": "not_ready", "reason": "engine_failed"}
    assert srv.get("/health")[0] == 200  # alive, just not ready
    srv.wait_idle()


def test_memory_error_is_503_and_the_worker_recovers(make_server):
    srv = make_server("oom_at=3")
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 10})
    assert status == 503
    assert json.loads(body)["error"]["code"] == "unavailable"
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "bc"
    assert srv.get("/ready")[0] == 200
    srv.wait_idle()


def test_drain_turns_ready_off_while_serving_continues(make_server):
    srv = make_server()
    assert srv.get("/ready")[0] == 200
    status, _, body = srv.post("/debug/drain", b"")
    assert status == 200 and json.loads(body)["status"] == "draining"
    status, _, body = srv.get("/ready", port=srv.health_port)
    assert status == 503 and json.loads(body)["reason"] == "draining"
    status, _, body = srv.complete({"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "bcd"


def test_sigterm_with_streams_in_flight(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GREENSERVE_FAULTS=SLOW,
            GRACEFUL_TIMEOUT_S="3",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        readers = []
        for i in range(20):
            # Half finish within the grace period, half are ended by the final event.
            tokens = 20 if i % 2 == 0 else 1000
            body = {"model": "m", "prompt": "a", "max_tokens": tokens, "stream": True}
            r = open_stream(srv.port, body, f"term-{i}")
            assert r.next_frame() == b": ok\n"
            readers.append((tokens, r))
        wait_until(lambda: srv.state()["slots"]["busy"] == 20, what="20 streams running")
        srv.signal(signal.SIGTERM)
        for tokens, r in readers:
            body = r.resp.read()
            payloads = sse_events(b": ok\n\n" + body)
            assert payloads[-1] == b"[DONE]"
            last = json.loads(payloads[-2])
            if tokens == 20:
                assert last["choices"][0]["finish_reason"] == "length"
                assert len(payloads) == 21
            else:
                assert (last["error"]["code"], last["error"]["message"]) == (
                    "unavailable",
                    "Server is shutting down; generation was ended early.",
                )
            r.close()
        assert srv.wait(30) == 0
        for i in range(20):
            collector.span_for(f"term-{i}", timeout_s=5)


def test_default_limits_follow_the_model(serve):
    # The bigram runs inline at ~32 KiB a stream: its default slots and queue are 1024 each (a Llama
    # slot is a batched decode row: 64 slots, 256 queued; tests/test_llama_serving.py).
    srv = serve()
    s = srv.state()
    assert s["slots"] == {"busy": 0, "total": 1024}
    assert s["queue"] == {"waiting": 0, "max": 1024}
    assert LLAMA.limits(None, None) == (64, 256)
    assert BIGRAM.limits(3, 0) == (3, 0)  # MAX_SLOTS and MAX_QUEUE win when set


def test_drain_is_server_wide_survives_a_reload_and_is_undone(make_server):
    srv = make_server(WEB_CONCURRENCY="2")
    assert srv.post("/debug/drain", b"")[0] == 200

    def every_worker(draining: bool, exclude: set[int] = frozenset()) -> set[int]:
        """Poll /debug/state until two workers (none of ``exclude``) answered, each with
        ``draining``; return their pids."""
        seen: dict[int, bool] = {}

        def both() -> bool:
            s = srv.state()
            if s["pid"] not in exclude:
                seen[s["pid"]] = s["draining"]
            return len(seen) >= 2

        wait_until(both, 30, lambda: f"two workers; saw {seen}")
        assert set(seen.values()) == {draining}, seen
        return set(seen)

    first = every_worker(True)
    statuses = {srv.get("/ready", port=p)[0] for p in srv.ports for _ in range(10)}
    assert statuses == {503}
    srv.signal(signal.SIGHUP)  # new workers: still drained
    every_worker(True, exclude=first)
    status, _, body = srv.request("DELETE", "/debug/drain")
    assert status == 200 and json.loads(body)["status"] == "ready"
    every_worker(False)
    assert {srv.get("/ready", port=p)[0] for p in srv.ports for _ in range(10)} == {200}
