"""Why a generation ended: every way is named in the request's log line (``end_reason``), in the
``end_reason`` label of ``greenserve_requests_total`` and in the span (``greenserve.end_reason``), and a
stream the server ends while its socket can still take bytes ends with an error event and ``[DONE]``.

Each test drives a real gunicorn; the shutdown tests stop the worker alone (SIGTERM), so that the
master's next worker serves ``/metrics`` with the stopped worker's counts.

Source: docs/ARCHITECTURE.md §9 (admission and stream lifetime); OpenAI API reference, "Error codes".
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import re
import signal
import socket
import time
from collections.abc import Iterator

import gevent
import pytest

from tests.collector import FakeCollector
from tests.loglines import request_line
from tests.scrape import scrape
from tests.server import (
    SLACK_S,
    GunicornServer,
    blocked_on_its_reader,
    raw_request,
    read_all,
    wait_until,
)
from tests.sse import DONE, SHUTDOWN_END, EventReader, open_stream, sse_events
from wsgi_app.generation.admission import Admission

# Final events, byte for byte: the OpenAI error envelope, then [DONE] (a stop's: tests.sse).
DEADLINE_END = (
    b'data: {"error":{"message":"Request timed out after 2 s.","type":"server_error",'
    b'"param":null,"code":"timeout"}}\n\n' + DONE
)
ENGINE_ERROR_END = (
    b'data: {"error":{"message":"Generation failed: EngineFailure.","type":"server_error",'
    b'"param":null,"code":"engine_error"}}\n\n' + DONE
)
# A stream of 8 choices of 4096 tokens: ~5 MB of events, more than the socket buffers hold.
FLOOD = {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 8, "stream": True}


def counted(srv: GunicornServer, **labels: str) -> float:
    """``greenserve_requests_total`` summed over the series that carry ``labels``."""
    samples = scrape(srv, srv.health_port).get("greenserve_requests", {})
    return sum(
        value
        for (name, series), value in samples.items()
        if name == "greenserve_requests_total" and labels.items() <= dict(series).items()
    )


def wait_counted(srv: GunicornServer, n: float, **labels: str) -> None:
    """Wait until ``greenserve_requests_total`` of ``labels`` is ``n`` (requests are counted on the
    event loop's next turn after their close)."""
    seen: list[float] = []
    wait_until(
        lambda: seen.append(counted(srv, **labels)) or seen[-1] == n,
        10,
        lambda: f"{n} requests with {labels}; counted {seen[-1:]}",
    )


def end_attr(collector: FakeCollector, request_id: str) -> dict:
    """The ``greenserve.end_reason`` attribute of request ``request_id``'s span."""
    return collector.span_for(request_id)["attrs"].get("greenserve.end_reason")


def line_of(srv: GunicornServer, request_id: str) -> tuple:
    """The request line's ``(status, finish_reason, end_reason, error)``."""
    line = request_line(srv, request_id)
    return line["status"], line["finish_reason"], line["end_reason"], line["error"]


@contextlib.contextmanager
def ends_as(
    srv: GunicornServer, collector: FakeCollector, request_id: str, line: tuple
) -> Iterator[None]:
    """Around the block that makes request ``request_id``: assert after it that the request's log
    line is ``line`` (``(status, finish_reason, end_reason, error)``), that
    ``greenserve_requests_total`` of its labels (``end_reason`` "none" for None) rose by one, and
    that its span's ``greenserve.end_reason`` is ``end_reason`` (absent for None)."""
    status, finish_reason, end_reason, _ = line
    labels = {"status": str(status), "finish_reason": finish_reason}
    labels["end_reason"] = end_reason or "none"
    before = counted(srv, **labels)
    yield
    assert line_of(srv, request_id) == line
    wait_counted(srv, before + 1, **labels)
    if end_reason is None:
        assert "greenserve.end_reason" not in collector.span_for(request_id)["attrs"]
    else:
        assert end_attr(collector, request_id) == {"stringValue": end_reason}


def stop_worker(srv: GunicornServer) -> int:
    """SIGTERM the worker (not the master); return its pid. The master starts another."""
    pid = srv.state()["pid"]
    os.kill(pid, signal.SIGTERM)
    return pid


def next_worker(srv: GunicornServer, old_pid: int) -> None:
    """Wait until a worker other than ``old_pid`` answers (the stopped one has exited)."""
    wait_until(lambda: srv.state()["pid"] != old_pid, 30, "the next worker")


# -- one server for the ends of a single request ------------------------------------------------


@pytest.fixture(scope="module")
def srv(succ_dir, collector, serve_module):
    """50 tokens/s, a 2 s deadline, and an engine failure at every choice's 30th token."""
    return serve_module(
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS="slow_step_s=0.02,fail_at=30",
        REQUEST_TIMEOUT_S="2",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
    )


def test_finished(srv, collector):
    body = {"model": "m", "prompt": "a", "max_tokens": 3, "n": 2, "stream": True}
    with ends_as(srv, collector, "end-finished", (200, "length", "finished", None)):
        status, _, raw = srv.complete(body, headers={"X-Request-Id": "end-finished"})
        assert status == 200 and sse_events(raw)[-1] == b"[DONE]"


def test_stop(srv, collector):
    # "a" generates "bcd…": the stop string "c" ends the choice after "b".
    body = {"model": "m", "prompt": "a", "max_tokens": 5, "stop": ["c"], "temperature": 0}
    with ends_as(srv, collector, "end-stop", (200, "stop", "stop", None)):
        status, _, raw = srv.complete(body, headers={"X-Request-Id": "end-stop"})
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == "b"


def test_client_left(srv, collector):
    left_json = (499, "abort", "client_left", "client disconnected while generating")
    with (
        ends_as(srv, collector, "end-left-stream", (200, "abort", "client_left", None)),
        ends_as(srv, collector, "end-left-json", left_json),
    ):
        # A stream whose client leaves after five tokens.
        body = {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
        reader = open_stream(srv.port, body, "end-left-stream")
        for _ in range(6):
            reader.next_frame()
        reader.close()
        # A non-streamed answer whose client leaves while it is generated: a 499 for the log.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            body = {"model": "m", "prompt": "a", "max_tokens": 1000}
            sock.sendall(raw_request(body, "end-left-json"))
            wait_until(lambda: (r := srv.in_flight("end-left-json")) and r["tokens"] > 0)


def test_deadline(srv, collector):
    # Four choices share the 50 tokens/s: none reaches the failure at token 30 within the 2 s.
    body = {"model": "m", "prompt": "a", "max_tokens": 1000, "n": 4, "stream": True}
    timed_out = (200, "error", "deadline", "Request timed out after 2 s.")
    with ends_as(srv, collector, "end-deadline", timed_out):
        status, _, raw = srv.complete(body, headers={"X-Request-Id": "end-deadline"})
        assert status == 200 and raw.endswith(DEADLINE_END), raw[-300:]
        assert sse_events(raw[: -len(DEADLINE_END)])[-1].startswith(b'{"id":"cmpl-')


def test_engine_error(srv, collector):
    message = "Generation failed: EngineFailure."
    body = {"model": "m", "prompt": "a", "max_tokens": 100, "temperature": 0}
    with (
        ends_as(srv, collector, "end-fail", (200, "error", "engine_error", message)),
        ends_as(srv, collector, "end-fail-json", (500, "error", "engine_error", message)),
    ):
        status, _, raw = srv.complete(
            {**body, "stream": True}, headers={"X-Request-Id": "end-fail"}
        )
        assert status == 200 and raw.endswith(ENGINE_ERROR_END), raw[-300:]
        texts = [json.loads(p)["choices"][0]["text"] for p in sse_events(raw)[:-2]]
        assert "".join(texts) == bytes(range(98, 98 + 29)).decode()  # 29 tokens, then the failure
        status, _, raw = srv.complete(body, headers={"X-Request-Id": "end-fail-json"})
        assert status == 500 and json.loads(raw)["error"]["code"] == "engine_error"


def test_nothing_generated_has_no_end_reason(srv, collector):
    with ends_as(srv, collector, "end-none", (400, "none", None, None)):
        body = {"model": "m", "prompt": ""}
        status, _, _ = srv.complete(body, headers={"X-Request-Id": "end-none"})
        assert status == 400


# -- the client stops reading -------------------------------------------------------------------


def test_send_timeout(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir), SEND_TIMEOUT_S="0.5", OTEL_EXPORTER_OTLP_ENDPOINT=collector.url
        )
        reader = EventReader(srv.port, FLOOD, {"X-Request-Id": "end-stalled"}, rcvbuf=4096)
        # Never read: the writes block and the send timeout cuts the stream.
        assert line_of(srv, "end-stalled") == (200, "abort", "send_timeout", None)
        reader.close()
        wait_counted(srv, 1, status="200", finish_reason="abort", end_reason="send_timeout")
        assert end_attr(collector, "end-stalled") == {"stringValue": "send_timeout"}


# -- the worker stops ---------------------------------------------------------------------------


def test_shutdown_ends_running_and_queued_streams_with_a_final_event(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GREENSERVE_FAULTS="slow_step_s=0.02",
            GRACEFUL_TIMEOUT_S="2",  # streams are told to end 0.5 s after SIGTERM
            MAX_SLOTS="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        body = {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
        running = open_stream(srv.port, body, "end-stop-running")
        assert running.next_frame() == b": ok\n"
        queued = open_stream(srv.port, body, "end-stop-queued")
        assert queued.next_frame() == b": ok\n"
        wait_until(lambda: srv.state()["queue"]["waiting"] == 1, what="the second stream queued")
        pid = stop_worker(srv)
        started = time.monotonic()
        rest = running.resp.read()
        assert rest.endswith(SHUTDOWN_END), rest[-300:]
        assert sse_events(rest[: -len(SHUTDOWN_END)])[-1].startswith(b'{"id":"cmpl-')
        # Nothing but its waiting heartbeats (every 0.5 s) and the final event after ": ok".
        assert re.fullmatch(rb"(: queued\n\n)*" + re.escape(SHUTDOWN_END), queued.resp.read())
        # At the stop time (0.5 s after SIGTERM): woken by the stop (``Admission.wake_queued``).
        assert time.monotonic() - started < 0.5 + SLACK_S
        running.close(), queued.close()
        next_worker(srv, pid)
        message = "Server is shutting down; generation was ended early."
        for rid in ("end-stop-running", "end-stop-queued"):
            assert line_of(srv, rid) == (200, "error", "shutdown", message)
            assert end_attr(collector, rid) == {"stringValue": "shutdown"}
        wait_counted(srv, 2, status="200", finish_reason="error", end_reason="shutdown")


def test_shutdown_cuts_a_blocked_write_without_an_event(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GRACEFUL_TIMEOUT_S="2",  # blocked writes are cut 1 s after SIGTERM
            SEND_TIMEOUT_S="60",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(10)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(raw_request(FLOOD, "end-stop-cut"))
            wait_until(lambda: blocked_on_its_reader(srv, "end-stop-cut"), what="a blocked write")
            pid = stop_worker(srv)
            # Still not reading: the write is cut 1 s later (the request's line is then written).
            assert line_of(srv, "end-stop-cut") == (200, "abort", "shutdown", None)
            received = read_all(sock)  # what the buffers held, then the end: no error event
        assert received.startswith(b"HTTP/1.1 200 OK\r\n") and b'{"error"' not in received
        next_worker(srv, pid)
        assert end_attr(collector, "end-stop-cut") == {"stringValue": "shutdown"}
        wait_counted(srv, 1, status="200", finish_reason="abort", end_reason="shutdown")


def test_shutdown_ends_a_stream_that_never_reached_its_pacer(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GREENSERVE_FAULTS="slow_step_s=5",  # the first token takes 5 s: no pacer call before
            GRACEFUL_TIMEOUT_S="2",  # what still runs is ended 1.25 s after SIGTERM
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        body = {"model": "m", "prompt": "a", "max_tokens": 10, "stream": True}
        reader = open_stream(srv.port, body, "end-stop-killed")
        assert reader.next_frame() == b": ok\n"
        wait_until(lambda: srv.state()["slots"]["busy"] == 1, what="the stream's slot")
        pid = stop_worker(srv)
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):  # no final chunk
            reader.resp.read()
        reader.close()
        next_worker(srv, pid)
        assert line_of(srv, "end-stop-killed") == (200, "abort", "shutdown", None)
        assert end_attr(collector, "end-stop-killed") == {"stringValue": "shutdown"}
        wait_counted(srv, 1, status="200", finish_reason="abort", end_reason="shutdown")
        assert "Worker graceful timeout" in srv.log_text()


# -- a queued wait woken by the stop ------------------------------------------------------------


def test_wake_queued_ends_a_queued_wait_without_a_slot():
    admission = Admission(max_slots=1, max_queue=1)
    holder = admission.admit("holder", math.inf)
    queued = admission.admit("queued", math.inf)
    gevent.spawn_later(0.05, admission.wake_queued)
    started = time.perf_counter()
    assert queued.wait(5.0) is False and time.perf_counter() - started < 5.0 / 2  # woken, not out
    started = time.perf_counter()
    assert queued.wait(0.1) is False and time.perf_counter() - started >= 0.1  # woken once only
    holder.release()
    assert queued.wait(0.0) is True
    queued.release()
    assert (admission.busy, admission.queued) == (0, 0)
