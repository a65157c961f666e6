"""Every timeout the README documents fires when it says, within a second.

A timeout's firing time is behaviour, so these tests measure it (small settings keep them short): the
send timeout, the request deadline, the header deadline, the keep-alive, the heartbeat and the graceful
timeout. Each drives a real gunicorn over plain sockets.

Source: RFC 9112 §9.3 (persistent connections), §9.6 (tear-down); RFC 9110 §15.5.9 (408).
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import time

import pytest

from tests.server import blocked_on_its_reader, raw_request, server_read_all, wait_until
from tests.sse import EventReader
from wsgi_app.generation.completion import WAITING_HEARTBEAT_S

TOLERANCE_S = 1.0


def test_send_timeout_cuts_a_stopped_reader_one_timeout_after_its_last_read(serve, succ_dir):
    srv = serve(MODEL_DIR=str(succ_dir), SEND_TIMEOUT_S="3")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect()
        sock.settimeout(10)
        sock.connect(("127.0.0.1", srv.port))
        body = {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 8, "stream": True}
        sock.sendall(raw_request(body, "stall"))
        wait_until(lambda: b"data: {" in sock.recv(4096, socket.MSG_PEEK), what="the first token")
        wait_until(lambda: blocked_on_its_reader(srv, "stall"), what="the write to block")
        # One last read while the server's write waits (the server sees its queue shrink), then
        # the reader stops for good: it is cut one SEND_TIMEOUT_S later, not two.
        assert len(sock.recv(65536)) > 0
        last_read = time.monotonic()
        wait_until(lambda: srv.in_flight("stall") is None, 15, "the stream to be cut")
        cut_after_s = time.monotonic() - last_read
    assert abs(cut_after_s - 3.0) <= TOLERANCE_S, cut_after_s


@pytest.fixture(scope="module")
def timed(succ_dir, serve_module):
    """One worker, one slot, 50 tokens/s, and short, distinct timeouts."""
    return serve_module(
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS="slow_step_s=0.02",
        MAX_SLOTS="1",
        HEADER_TIMEOUT_S="2",
        KEEPALIVE_S="3",
        HEARTBEAT_S="2",
        REQUEST_TIMEOUT_S="4",
    )


def until_closed(sock: socket.socket) -> bytes:
    """Read until the server closes ``sock``; return what came."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_header_deadline_answers_408_when_the_head_is_late(timed):
    with socket.create_connection(("127.0.0.1", timed.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # the blank line never comes
        answer = until_closed(sock)
        fired_s = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:80]
    assert abs(fired_s - 2.0) <= TOLERANCE_S, fired_s


def test_keepalive_closes_an_idle_connection(timed):
    with socket.create_connection(("127.0.0.1", timed.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += sock.recv(65536)
        answered = time.monotonic()
        assert until_closed(sock) == b""
        fired_s = time.monotonic() - answered
    assert abs(fired_s - 3.0) <= TOLERANCE_S, fired_s


def test_heartbeat_while_queued_is_the_waiting_heartbeat(timed):
    # Until its first token a stream writes every WAITING_HEARTBEAT_S (0.5 s), not HEARTBEAT_S (2 s).
    body = {"model": "m", "prompt": "a", "max_tokens": 150, "stream": True}
    holder = EventReader(timed.port, body)  # 3 s of tokens: holds the only slot
    holder.open()
    assert holder.next_frame() == b": ok\n"
    queued = EventReader(timed.port, {**body, "max_tokens": 1})
    queued.open()
    assert queued.next_frame() == b": ok\n"
    opened = time.monotonic()
    assert queued.next_frame() == b": queued\n"
    fired_s = time.monotonic() - opened
    holder.close()
    queued.close()
    assert abs(fired_s - WAITING_HEARTBEAT_S) <= TOLERANCE_S, fired_s


def test_request_deadline_ends_a_stream_with_an_error_event(timed):
    timed.wait_idle()
    started = time.monotonic()
    reader = EventReader(
        timed.port, {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
    )
    reader.open()
    frame = reader.next_frame()
    while not frame.startswith(b'data: {"error"'):
        frame = reader.next_frame()
    fired_s = time.monotonic() - started
    reader.close()
    assert json.loads(frame[len(b"data: ") :])["error"]["code"] == "timeout"
    assert abs(fired_s - 4.0) <= TOLERANCE_S, fired_s


def test_graceful_timeout_ends_streams_then_the_server(serve, succ_dir):
    srv = serve(
        MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="slow_step_s=0.02", GRACEFUL_TIMEOUT_S="3"
    )
    reader = EventReader(
        srv.port, {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
    )
    reader.open()
    assert reader.next_frame() == b": ok\n"
    srv.signal(signal.SIGTERM)
    stopped = time.monotonic()
    frame = reader.next_frame()
    while not frame.startswith(b'data: {"error"'):
        frame = reader.next_frame()
    ended_s = time.monotonic() - stopped
    reader.close()
    assert srv.wait(10) == 0
    exited_s = time.monotonic() - stopped
    assert json.loads(frame[len(b"data: ") :])["error"]["code"] == "unavailable"
    # Streams end END_STREAMS_S (1.5 s) before the grace period does; the master is gone by its end.
    assert abs(ended_s - 1.5) <= TOLERANCE_S, ended_s
    assert ended_s < exited_s <= 3.0 + TOLERANCE_S, exited_s


def test_a_client_that_resets_during_its_body_is_a_499_not_a_server_error(default_server):
    # Half a body, then a reset (SO_LINGER 0): the read fails with ECONNRESET. Nobody reads the
    # answer; the request is logged 499 at INFO, with no traceback (it was a 500 with one).
    body = json.dumps({"model": "bigram", "prompt": "x" * 200, "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: reset-mid-body\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", default_server.port), timeout=5)
    sock.sendall(head + body[:-10])
    # The server has read the head and the body's start: its next read, of the rest, is reset.
    wait_until(lambda: server_read_all(sock), 10, "the server to read the body's start")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    wait_until(lambda: "reset-mid-body" in default_server.log_text(), 10, "the request's log line")
    line = next(ln for ln in default_server.log_text().splitlines() if "reset-mid-body" in ln)
    record = json.loads(line)
    assert (record["status"], record["level"], record["endpoint"]) == (
        499,
        "INFO",
        "/v1/completions",
    )
    assert "Traceback" not in default_server.log_text()
    assert "Connection reset by peer" not in default_server.log_text()
