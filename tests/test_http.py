"""Health on both ports, request ids, model version, hub responsiveness, SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest

from tests.server import GunicornServer, ServerDied


def test_healthz_on_both_ports(succ_server):
    for port in (succ_server.port, succ_server.health_port):
        status, headers, body = succ_server.get("/healthz", port=port)
        assert (status, body) == (200, b'{"status":"ok"}')
        assert headers["content-type"] == "application/json"


def test_request_id_is_echoed(succ_server):
    rid = "abc-123_!~" + "x" * 118  # 128 visible ASCII characters
    _, headers, _ = succ_server.get("/healthz", headers={"X-Request-Id": rid})
    assert headers["x-request-id"] == rid


def test_request_id_is_generated_when_absent_or_invalid(succ_server):
    seen = set()
    for value in (None, "", "has space", "x" * 129, "tab\there"):
        hdrs = {} if value is None else {"X-Request-Id": value}
        _, headers, _ = succ_server.complete(
            {"model": "m", "prompt": "a", "max_tokens": 1}, headers=hdrs
        )
        rid = headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", rid), rid
        seen.add(rid)
    assert len(seen) == 5


def test_model_version_on_every_response(succ_server, succ_dir):
    from model.files import file_sha256

    expected = file_sha256(succ_dir / "model.safetensors")[:16] + "+greenserve-0.1.0"
    for status, headers, _ in (
        succ_server.get("/healthz"),
        succ_server.get("/missing"),
        succ_server.complete({"model": "m", "prompt": "a", "max_tokens": 1}),
        succ_server.complete({"model": "m"}),
    ):
        assert headers["x-model-version"] == expected, status


def test_half_sent_request_does_not_delay_healthz(succ_server):
    stalled = socket.create_connection(("127.0.0.1", succ_server.port))
    try:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        # No pause needed: the kernel hands connections to accept() in order, and the stalled one's
        # head is already buffered, so its greenlet is waiting on the body before /healthz is read.
        started = time.perf_counter()
        status, _, _ = succ_server.get("/healthz")
        elapsed = time.perf_counter() - started
        assert status == 200
        # Not a timing assertion on speed: a stalled hub would block for the whole keep-alive/body
        # wait (seconds); one greenlet per connection answers at once.
        assert elapsed < 2.0
    finally:
        stalled.close()


def test_long_stream_does_not_starve_healthz(succ_server):
    # A 4096-token greedy stream keeps its greenlet busy; the hub must still serve /healthz.
    conn = socket.create_connection(("127.0.0.1", succ_server.port))
    body = json.dumps(
        {"model": "m", "prompt": "a", "max_tokens": 4096, "temperature": 0, "stream": True}
    ).encode()
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    try:
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        status, _, _ = succ_server.get("/healthz", port=succ_server.health_port)
        assert status == 200
    finally:
        conn.close()


def test_sigterm_exits_zero(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), workers=2)
    assert srv.complete({"model": "m", "prompt": "a", "max_tokens": 1})[0] == 200
    srv.signal(signal.SIGTERM)
    assert srv.wait(30) == 0
    assert "Shutting down: Master" in srv.log_text()


def test_bad_model_dir_fails_at_start_naming_the_field(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"tl_arch":"llama","tl_tokenizer":"bytes","vocab_size":256}'
    )
    srv = GunicornServer(tmp_path / "run", {"MODEL_DIR": str(tmp_path / "m")})
    with pytest.raises(ServerDied):  # a failed start leaves nothing running
        srv.start(timeout_s=20)
    (line,) = [x for x in srv.log_text().splitlines() if "cannot start" in x]
    assert line.startswith(f"greenserve: cannot start: MODEL_DIR ({tmp_path / 'm'}): ")
    assert "tl_arch" in line
