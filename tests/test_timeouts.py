"""Every timeout the README documents fires when it says, within a second.

A timeout's firing time is behaviour, so these tests measure it (small settings keep them short): the
send timeout, the request deadline, the header deadline, the keep-alive, the heartbeat and the graceful
timeout. Each drives a real gunicorn over plain sockets.

Source: RFC 9112 §9.3 (persistent connections), §9.6 (tear-down); RFC 9110 §15.5.9 (408).
"""

from __future__ import annotations

import json
import socket
import time

from tests.server import GunicornServer, wait_until

TOLERANCE_S = 1.0


def raw_request(body: dict, request_id: str, path: str = "/v1/completions") -> bytes:
    """Return a complete HTTP/1.1 POST of ``body`` as JSON."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def blocked_on_its_reader(srv: GunicornServer, request_id: str) -> bool:
    """True when request ``request_id`` is in flight and made no token in 0.2 s (its write blocks)."""
    before = srv.in_flight(request_id)
    time.sleep(0.2)
    after = srv.in_flight(request_id)
    return bool(before and after and 0 < before["tokens"] == after["tokens"])


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
