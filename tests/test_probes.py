"""Health probes answered by the worker before the app (``wsgi_app.server.probes``), on a real gunicorn:
the same bytes as the app's routes on both ports, readiness while draining and while the engine's
steps fail for real (and back once they succeed), keep-alive, and a probe served ahead of
connections accepted before it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.llamafiles import write_tiny_llama
from tests.server import GunicornServer, read_all, wait_until

MODEL_VERSION = re.compile(rb"X-Model-Version: [0-9a-f]{16}\+greenserve-[^\r]+\r\n")
DATE = re.compile(rb"Date: [^\r]+\r\n")


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection; return everything the server sent until it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def probe(method: str, path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: t", "X-Request-Id: probe-1", *headers]
    return ("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode()


def plain(answer: bytes) -> bytes:
    """``answer`` with its Date and X-Model-Version values made constant."""
    answer = DATE.sub(b"Date: D\r\n", answer)
    return MODEL_VERSION.sub(b"X-Model-Version: V\r\n", answer)


def expected(status: bytes, body: bytes, head: bool = False, version: bytes = b"1.1") -> bytes:
    return (
        b"HTTP/"
        + version
        + b" "
        + status
        + b"\r\nServer: gunicorn\r\nDate: D\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
        b"X-Model-Version: V\r\nX-Request-Id: probe-1\r\n\r\n" + (b"" if head else body)
    )


OK = b'{"status":"ok"}'
READY = b'{"status":"ready"}'
DRAINING = b'{"status":"not_ready","reason":"draining"}'
ENGINE_FAILED = b'{"status":"not_ready","reason":"engine_failed"}'


@pytest.mark.parametrize("port_name", ["port", "health_port"])
def test_probes_answer_the_routes_bytes_on_both_ports(succ_server, port_name):
    port = getattr(succ_server, port_name)
    for method in ("GET", "HEAD"):
        head = method == "HEAD"
        for path, body in (("/healthz", OK), ("/health", OK), ("/ready", READY)):
            answer = plain(exchange(port, probe(method, path)))
            assert answer == expected(b"200 OK", body, head), (method, path, answer)
            # The app's own route (an Origin sends the probe on to Flask) gives the same bytes.
            through_app = plain(exchange(port, probe(method, path, "Origin: https://a.example")))
            assert through_app == answer, (method, path, through_app)
    answer = plain(exchange(port, probe("GET", "/healthz?full=1", version="1.0")))
    assert answer == expected(b"200 OK", OK, version=b"1.0")


def test_ready_says_draining_on_both_ports_and_back(succ_server):
    status, _, _ = succ_server.post("/debug/drain", b"")
    assert status == 200
    try:
        for port in (succ_server.port, succ_server.health_port):
            answer = plain(exchange(port, probe("GET", "/ready")))
            assert answer == expected(b"503 SERVICE UNAVAILABLE", DRAINING), answer
            through_app = plain(exchange(port, probe("GET", "/ready", "Origin: https://a.example")))
            assert through_app == answer
            # Liveness is not readiness: a draining worker is alive.
            assert plain(exchange(port, probe("GET", "/healthz"))) == expected(b"200 OK", OK)
    finally:
        assert succ_server.request("DELETE", "/debug/drain")[0] == 200
    for port in (succ_server.port, succ_server.health_port):
        assert plain(exchange(port, probe("GET", "/ready"))) == expected(b"200 OK", READY)


def test_probes_keep_the_connection_alive_and_a_new_id_each(succ_server):
    with socket.create_connection(("127.0.0.1", succ_server.health_port), timeout=10) as sock:
        ids = []
        for _ in range(3):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            answer = b""
            while not answer.endswith(OK):
                answer += sock.recv(65536)
            assert b"\r\nConnection: keep-alive\r\n" in answer
            ids.append(re.search(rb"X-Request-Id: ([0-9a-f]{32})\r\n", answer).group(1))
        assert len(set(ids)) == 3


def test_a_probe_with_a_body_still_goes_to_the_app(succ_server):
    request = (
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    answer = exchange(succ_server.port, request)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(OK)


def test_probe_log_line_and_span_are_kept(serve, succ_dir, tmp_path):
    srv = serve(MODEL_DIR=str(succ_dir), LOG_LEVEL="debug")
    exchange(
        srv.health_port,
        probe("GET", "/ready", "traceparent: 00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),
    )

    def line():
        for text in srv.log_text().splitlines():
            if '"request_id": "probe-1"' in text:
                return json.loads(text)
        return None

    record = wait_until(line, 10, "the probe's log line")
    assert record["level"] == "DEBUG"
    assert (record["method"], record["path"], record["endpoint"], record["status"]) == (
        "GET",
        "/ready",
        "/ready",
        200,
    )
    assert record["trace_id"] == "ab" * 16  # the span continued the caller's trace


def test_a_probe_is_served_before_connections_accepted_ahead_of_it(serve, succ_dir):
    """A burst of requests already waiting when the worker looks, then a probe: the probe is answered
    before any of them (its log line comes first), not after all of their set-ups.

    The burst's requests are refused at once (the only slot is held, no queue), so none of them ever
    yields to the hub: through the app, the probe's greenlet ran after all 20 of them.
    """
    srv: GunicornServer = serve(
        MODEL_DIR=str(succ_dir),
        LOG_LEVEL="debug",
        MAX_SLOTS="1",
        MAX_QUEUE="0",
        GREENSERVE_FAULTS="slow_step_s=0.02",
    )
    pid = srv.state()["pid"]
    holder = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    holder.sendall(completion_request(max_tokens=500, stream=True))
    assert holder.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")  # it holds the only slot
    socks = []
    os.kill(pid, signal.SIGSTOP)  # the kernel still completes connections and buffers their bytes
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            sock.sendall(completion_request(max_tokens=1, stream=False))
            socks.append(sock)
        last = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        last.sendall(probe("GET", "/healthz"))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert plain(read_all(last)) == expected(b"200 OK", OK)
    for sock in socks:
        assert read_all(sock).startswith(b"HTTP/1.1 429 ")
    holder.close()

    def lines():
        found = [json.loads(t) for t in srv.log_text().splitlines() if '"message": "request"' in t]
        return found if sum(line["status"] == 429 for line in found) == 20 else None

    ids = [line["request_id"] for line in wait_until(lines, 10, "the request log lines")]
    refused = [i for i, line in enumerate(lines() or []) if line["status"] == 429]
    assert len(refused) == 20 and ids.index("probe-1") < refused[0], ids


def completion_request(max_tokens: int, stream: bool) -> bytes:
    body = json.dumps({"model": "m", "prompt": "a", "max_tokens": max_tokens, "stream": stream})
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    ) + body.encode()


def test_http_date_is_gunicorns_text_made_once_a_second(monkeypatch):
    from email.utils import formatdate

    from wsgi_app.server import request_head

    clock = [1_796_158_490.25]
    monkeypatch.setattr(request_head.time, "time", lambda: clock[0])
    date = request_head.HttpDate()
    assert date() == formatdate(clock[0], usegmt=True) == "Tue, 01 Dec 2026 20:54:50 GMT"
    clock[0] += 0.5
    assert date() == "Tue, 01 Dec 2026 20:54:50 GMT"
    clock[0] += 0.5
    assert date() == "Tue, 01 Dec 2026 20:54:51 GMT"
    assert date(0) == "Thu, 01 Jan 1970 00:00:00 GMT"


def test_only_a_whole_plain_probe_head_is_served_from_the_accept():
    from wsgi_app.server.probes import plain_probe_head

    assert plain_probe_head(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert plain_probe_head(b"HEAD /ready?x=1 HTTP/1.0\r\n\r\n")
    assert not plain_probe_head(
        b"GET /healthz HTTP/1.1\r\nHost: t\r\n"
    )  # the head is not all there
    assert not plain_probe_head(b"GET /healthzz HTTP/1.1\r\n\r\n")
    assert not plain_probe_head(b"POST /healthz HTTP/1.1\r\n\r\n")
    assert not plain_probe_head(b"GET /v1/models HTTP/1.1\r\n\r\n")


def tensor_bytes(weights: Path, name: str) -> tuple[int, bytes]:
    """Return the file offset of tensor ``name``'s data in a safetensors file, and its bytes (an
    8-byte little-endian header length, the JSON header, then the data at its ``data_offsets``)."""
    raw = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + header_len])[name]["data_offsets"]
    offset = 8 + header_len + begin
    return offset, raw[offset : 8 + header_len + end]


def write_in_place(path: Path, offset: int, data: bytes) -> None:
    """Overwrite ``data`` at ``offset`` of ``path``: the same file, which the server has mapped."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def assert_ready_answers(srv: GunicornServer, status: bytes, body: bytes) -> None:
    """``/ready`` gives ``status`` and ``body`` on both ports, from the worker and from the app."""
    for port in (srv.port, srv.health_port):
        answer = plain(exchange(port, probe("GET", "/ready")))
        assert answer == expected(status, body), (port, answer)
        through_app = plain(exchange(port, probe("GET", "/ready", "Origin: https://a.example")))
        assert through_app == answer, (port, through_app)
        # Liveness is not readiness: a worker whose engine fails is alive.
        assert plain(exchange(port, probe("GET", "/healthz"))) == expected(b"200 OK", OK)


def ready_on_both_ports(srv: GunicornServer) -> bool:
    """True once ``/ready`` answers 200 on both ports."""
    return all(
        exchange(port, probe("GET", "/ready")).startswith(b"HTTP/1.1 200 OK\r\n")
        for port in (srv.port, srv.health_port)
    )


NAN_LOGITS = (
    b'{"error":{"message":"Generation failed: ValueError.","type":"server_error","param":null,'
    b'"code":"engine_error"}}'
)


def test_ready_follows_a_real_engine_failure_and_its_recovery(serve, tmp_path):
    """A tiny Llama whose weights file is overwritten in place while it serves: its weights are
    memory-mapped, so the final RMSNorm weight becomes NaN under the running worker, every logit
    of every step is NaN and the sampler refuses them (``ValueError: all logits are NaN``). No
    fault is injected: this is the engine thread's own failed step.

    The request in flight gets its 500 ``engine_error``; ``/ready`` answers 503 ``engine_failed`` on
    both ports (the worker's answer and the app's alike) and keeps answering it while the engine's
    own checks fail; once the weights are whole again the next check succeeds and ``/ready`` says
    ready without any request; a request's good step brings it back too.
    """
    model_dir = write_tiny_llama(tmp_path / "tiny")
    weights = model_dir / "model.safetensors"
    offset, good = tensor_bytes(weights, "model.norm.weight")
    nan = np.full(len(good) // 4, np.nan, "<f4").tobytes()
    srv = serve(MODEL_DIR=str(model_dir))
    body = {"model": "m", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
    assert srv.complete(body)[0] == 200
    assert_ready_answers(srv, b"200 OK", READY)

    write_in_place(weights, offset, nan)
    try:
        status, headers, answer = srv.complete(body)
        assert (status, headers["content-type"], answer) == (500, "application/json", NAN_LOGITS)
        assert_ready_answers(srv, b"503 SERVICE UNAVAILABLE", ENGINE_FAILED)
        # A stream's status is sent before the step fails: its error event says it.
        status, _, answer = srv.complete({**body, "stream": True})
        assert status == 200
        assert answer.endswith(b"data: " + NAN_LOGITS + b"\n\ndata: [DONE]\n\n"), answer
        # The engine checks itself while idle and fails again: still not ready.
        wait_until(lambda: "engine self-check failed" in srv.log_text(), 30, "a failed self-check")
        assert_ready_answers(srv, b"503 SERVICE UNAVAILABLE", ENGINE_FAILED)
    finally:
        write_in_place(weights, offset, good)
    # Whole again: the engine's next check succeeds, with no request sent.
    wait_until(
        lambda: ready_on_both_ports(srv), 30, lambda: "/ready 200 again; log:\n" + srv.log_tail()
    )
    assert_ready_answers(srv, b"200 OK", READY)
    assert "engine recovered" in srv.log_text()

    # A request's own good step turns readiness back on just as well.
    write_in_place(weights, offset, nan)
    try:
        assert srv.complete(body)[0] == 500
        assert_ready_answers(srv, b"503 SERVICE UNAVAILABLE", ENGINE_FAILED)
    finally:
        write_in_place(weights, offset, good)
    status, _, answer = srv.complete(body)
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 4
    assert_ready_answers(srv, b"200 OK", READY)
