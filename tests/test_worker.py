"""The gevent worker's ``StreamSocket.sendall``: the same bytes, timeouts and errors as gevent's own.

Unit tests drive a ``StreamSocket`` over a gevent socket pair (greenlets, no monkey-patching); the
integration test reads a multi-megabyte stream through a tiny receive window from a real gunicorn, so
the server's writes go partly through the one-``send`` fast path and partly through the fallback.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import signal
import socket
import time
from types import SimpleNamespace

import gevent
import pytest
from gevent import socket as gsocket

from tests.server import blocked_on_its_reader, raw_request, wait_until
from wsgi_app.server.worker import GeventWorker, SendTimeout, StreamSocket

PAYLOAD = bytes(range(256)) * (8 * 4096)  # 8 MiB: far more than the kernel's socket buffers


@pytest.fixture
def pair():
    """A connected (StreamSocket sender, gevent receiver) pair with a small send buffer."""
    a, b = gsocket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = StreamSocket(a.family, a.type, a.proto, fileno=a.detach())
    yield sender, b
    sender.close()
    b.close()


def _read_n(sock, n: int, chunk: int = 1000) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(min(chunk, n - len(buf)))
        if not data:
            break
        buf += data
        gevent.sleep(0)  # a slow reader: the sender finds the buffer full again and again
    return bytes(buf)


def test_small_write_arrives_whole(pair):
    sender, receiver = pair
    assert sender.sendall(b"data: x\n\n") is None
    assert receiver.recv(100) == b"data: x\n\n"


def test_large_write_to_a_slow_reader_is_exact(pair):
    sender, receiver = pair
    sender.settimeout(20)  # a sender that wrote too much times out instead of hanging the test
    reader = gevent.spawn(_read_n, receiver, len(PAYLOAD))
    sender.sendall(PAYLOAD)
    got = reader.get(timeout=30)
    assert len(got) == len(PAYLOAD)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(PAYLOAD).hexdigest()


def test_memoryview_and_bytearray_are_sent_as_bytes(pair):
    sender, receiver = pair
    sender.sendall(memoryview(b"abcdef")[2:])
    sender.sendall(bytearray(b"gh"))
    assert _read_n(receiver, 6) == b"cdefgh"


def test_reader_that_never_reads_times_out(pair):
    sender, _receiver = pair
    sender.settimeout(0.3)
    with pytest.raises(TimeoutError):
        sender.sendall(PAYLOAD)


def test_send_timeout_cuts_a_reader_that_stops(pair):
    sender, receiver = pair
    sender.send_timeout_s = 0.3
    reader = gevent.spawn(_read_n, receiver, 100_000)  # reads a little, then stops
    with pytest.raises(SendTimeout, match="the client read nothing for 0.3 s"):
        sender.sendall(PAYLOAD)
    assert sender.stalled is True and sender.blocked is False
    assert sender.end_reason == "send_timeout"
    assert len(reader.get(timeout=5)) == 100_000


def test_a_write_the_worker_cuts_is_marked_shutdown_not_send_timeout(pair):
    sender, _ = pair
    sender.send_timeout_s = 0.3  # would fire too, had the worker not cut the write first
    writer = gevent.spawn(sender.sendall, PAYLOAD)  # nobody reads: the write blocks
    while not sender.blocked:
        gevent.sleep(0.01)
    GeventWorker.cut_blocked_writes(SimpleNamespace(connections=[sender]))
    with pytest.raises(OSError) as raised:
        writer.get(timeout=5)
    assert not isinstance(raised.value, SendTimeout)
    assert (sender.end_reason, sender.stalled, sender.blocked) == ("shutdown", False, False)


def test_send_timeout_spares_a_slow_reader_that_keeps_reading(pair):
    sender, receiver = pair
    sender.send_timeout_s = 0.3
    payload = PAYLOAD[: 2 * 1024 * 1024]

    def steady() -> bytes:
        buf = bytearray()
        while len(buf) < len(payload):
            buf += receiver.recv(65536)
            gevent.sleep(0.02)  # ~3 MB/s: the whole write takes far longer than 0.3 s
        return bytes(buf)

    reader = gevent.spawn(steady)
    sender.sendall(payload)
    assert reader.get(timeout=30) == payload
    assert sender.stalled is False


def test_send_timeout_spares_a_reader_slower_than_the_kernels_writable_mark():
    # TCP reports a socket writable only once a third of its send buffer is free. This reader takes
    # 4 KiB every 50 ms, so that mark (~40 KiB here) comes only every ~0.5 s, later than the 0.15 s
    # send timeout, yet bytes leave the queue all along: progress, not a stalled reader.
    listener = gsocket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    receiver = gsocket.socket()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    receiver.connect(listener.getsockname())
    accepted, _ = listener.accept()
    accepted.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    sender = StreamSocket(accepted.family, accepted.type, accepted.proto, fileno=accepted.detach())
    sender.send_timeout_s = 0.15
    payload = PAYLOAD[: 300 * 1024]

    def slow() -> bytes:
        buf = bytearray()
        while len(buf) < len(payload):
            buf += receiver.recv(4096)
            gevent.sleep(0.05)
        return bytes(buf)

    reader = gevent.spawn(slow)
    try:
        sender.sendall(payload)
        assert reader.get(timeout=30) == payload
        assert sender.stalled is False
    finally:
        for sock in (sender, receiver, listener):
            sock.close()


def test_send_timeout_does_not_bound_reads(pair):
    sender, receiver = pair
    sender.send_timeout_s = 0.1
    gevent.spawn_later(0.3, receiver.sendall, b"late")
    assert sender.recv(10) == b"late"  # a socket timeout would have raised after 0.1 s


def test_closed_peer_raises_oserror(pair):
    sender, receiver = pair
    receiver.close()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        sender.sendall(PAYLOAD)


def test_worker_class_is_the_configured_one(succ_server):
    assert "Using worker: wsgi_app.server.worker.GeventWorker" in succ_server.log_text()
    assert issubclass(
        GeventWorker, __import__("gunicorn.workers.ggevent").workers.ggevent.GeventWorker
    )


def _stream(port: int, body: dict, rcvbuf: int | None) -> bytes:
    """POST ``body`` and return the de-chunked SSE body, read through an ``rcvbuf``-byte window."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect()
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.sock = sock
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        out = bytearray()
        while chunk := resp.read(997):  # small reads: the server's buffer fills and drains often
            out += chunk
        return bytes(out)
    finally:
        conn.close()


def test_stream_through_a_tiny_window_is_byte_identical(serve, succ_dir):
    srv = serve(MODEL_DIR=str(succ_dir))
    body = {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 4, "seed": 7, "stream": True}
    slow = _stream(srv.port, body, rcvbuf=2048)
    fast = _stream(srv.port, body, rcvbuf=None)
    # One multi-megabyte write: the kernel takes part of it, the fallback the rest.
    plain = {**body, "stream": False, "logprobs": 5}
    slow_plain = json.loads(_stream(srv.port, plain, rcvbuf=2048))
    fast_plain = json.loads(_stream(srv.port, plain, rcvbuf=None))

    # The succ model is deterministic: the same events in the same order, except the response id and
    # creation time, which differ between two requests.
    def normal(raw: bytes) -> bytes:
        return b"\n".join(
            line.split(b'"model"', 1)[1] if line.startswith(b"data: {") else line
            for line in raw.split(b"\n")
        )

    assert (
        slow.count(b"\n\n") == fast.count(b"\n\n") == 4 * 4096 + 2
    )  # ": ok", 16,384 tokens, [DONE]
    assert normal(slow) == normal(fast)
    assert slow.endswith(b"data: [DONE]\n\n")
    assert slow_plain["choices"] == fast_plain["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in slow_plain["choices"]] == [4096] * 4


def test_slow_body_on_a_reused_connection_is_not_cut(serve, succ_dir):
    srv = serve(MODEL_DIR=str(succ_dir), SEND_TIMEOUT_S="1")
    conn = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    conn.sendall(raw_request({"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0}))
    first = _response(conn)
    # The second request on the same connection pauses longer than SEND_TIMEOUT_S mid-body.
    second = raw_request({"model": "m", "prompt": "b", "max_tokens": 2, "temperature": 0})
    conn.sendall(second[:-5])
    time.sleep(1.5)  # the client's pause is what is tested, not a wait for the server
    conn.sendall(second[-5:])
    answer = _response(conn)
    conn.close()
    assert first[0] == 200 and first[1]["choices"][0]["text"] == "bc"
    assert answer[0] == 200, answer
    assert answer[1]["choices"][0]["text"] == "cd"


def _response(conn: socket.socket) -> tuple[int, dict]:
    """Read one JSON response from a keep-alive connection."""
    resp = http.client.HTTPResponse(conn)
    resp.begin()
    return resp.status, json.loads(resp.read())


def test_reader_that_stops_is_cut_with_a_warning_not_a_traceback(serve, succ_dir):
    srv = serve(MODEL_DIR=str(succ_dir), SEND_TIMEOUT_S="1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 8, "stream": True}
        sock.sendall(raw_request(body))  # and never read
        lines = wait_until(
            lambda: [x for x in srv.log_text().splitlines() if '"message": "request"' in x],
            timeout_s=20,
            what="the request's log line",
        )
    srv.stop()  # the log is complete once the server has stopped
    (request_line,) = [json.loads(x) for x in lines]
    warnings = [json.loads(x) for x in srv.log_text().splitlines() if "client stopped reading" in x]
    assert [(w["level"], w["request_id"], w["send_timeout_s"]) for w in warnings] == [
        ("WARNING", request_line["request_id"], 1.0)
    ]
    assert (request_line["status"], request_line["finish_reason"]) == (200, "abort")
    assert "Traceback" not in srv.log_text() and "Socket error" not in srv.log_text()


def test_sigterm_cuts_a_blocked_write_before_the_worker_is_killed(serve, succ_dir):
    srv = serve(MODEL_DIR=str(succ_dir), GRACEFUL_TIMEOUT_S="3", SEND_TIMEOUT_S="60")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = {"model": "m", "prompt": "a", "max_tokens": 4096, "n": 8, "stream": True}
        sock.sendall(raw_request(body, "blocked"))
        wait_until(lambda: blocked_on_its_reader(srv, "blocked"), what="the write to block")
        srv.signal(signal.SIGTERM)
        assert srv.wait(15) == 0
    lines = [json.loads(x) for x in srv.log_text().splitlines() if '"message": "request"' in x]
    (line,) = [x for x in lines if x["request_id"] == "blocked"]
    assert (line["status"], line["finish_reason"]) == (200, "abort")
