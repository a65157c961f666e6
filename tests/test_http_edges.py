"""HTTP/1.1 at the edges: the request head's size, ``Host``, a body that stops, an impossible chunk size.

Each is answered in the OpenAI error envelope (gunicorn's own refusals included), and where the rest of
the connection cannot be trusted it is answered ``Connection: close`` and closed.

Source: RFC 9112 §3.2 (Host), §7.1 (chunked coding), §9.6 (tear-down); RFC 6585 §5 (431); RFC 9110
§15.5.9 (408).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server import concurrently

FIELD = b"a" * 8000  # under gunicorn's per-field limit (8190 bytes)


@pytest.fixture(scope="module")
def edge_server(succ_dir, serve_module):
    """One worker on the succ model with a 2 s request deadline."""
    return serve_module(MODEL_DIR=str(succ_dir), REQUEST_TIMEOUT_S="2")


class Answer:
    """Send ``data`` on a new connection and read until the server closes it (or ``wait_s`` passes).

    Attributes:
        status: the answer's status; headers: lower-case names; body: the body bytes.
        closed: True when the server closed the connection after answering.
    """

    def __init__(self, port: int, data: bytes, wait_s: float = 10.0) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
            sock.sendall(data)
            raw, self.closed = b"", False
            try:
                while chunk := sock.recv(65536):
                    raw += chunk
                self.closed = True
            except TimeoutError:
                pass
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}

    def error(self) -> dict:
        assert self.headers["content-type"] == "application/json"
        return json.loads(self.body)["error"]


def head_with(fields: int, host: bytes = b"Host: t\r\n") -> bytes:
    return (
        b"GET /healthz HTTP/1.1\r\n"
        + host
        + b"".join(b"X-Pad-%d: %s\r\n" % (i, FIELD) for i in range(fields))
    )


def test_head_over_max_header_bytes_is_431_in_the_error_envelope(edge_server):
    answer = Answer(edge_server.port, head_with(5) + b"\r\n")  # ~40 KB, over 32 KiB
    assert answer.status == 431
    assert answer.headers["connection"] == "close" and answer.closed
    assert answer.error() == {
        "message": "Request Header Fields Too Large: Error parsing headers: "
        "'request head over 32768 bytes'",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_pipelined_requests_are_each_answered(edge_server):
    get = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    answer = Answer(edge_server.port, get + get + get[:-2] + b"Connection: close\r\n\r\n")
    assert answer.status == 200 and answer.closed
    assert answer.body.count(b'{"status":"ok"}') == 3 and b" 500 " not in answer.body


def test_head_under_max_header_bytes_is_served(edge_server):
    answer = Answer(edge_server.port, head_with(3) + b"Connection: close\r\n\r\n")  # ~24 KB
    assert (answer.status, answer.body) == (200, b'{"status":"ok"}')


def test_huge_heads_keep_healthz_answering(edge_server):
    # 300 clients each sending 95 fields of 8 KB (~770 KB of head); /healthz on the API port keeps
    # answering meanwhile (how fast is measured in the closing note, not asserted here).
    def attack(i: int) -> int:
        if i % 30 == 0:  # every 30th client probes /healthz instead
            return edge_server.get("/healthz")[0]
        try:
            return Answer(edge_server.port, head_with(95) + b"\r\n").status
        except (ConnectionResetError, BrokenPipeError):
            return 431  # refused while still sending: the 431 was written, the rest reset

    statuses = concurrently(attack, 300)
    assert {s for i, s in enumerate(statuses) if i % 30 == 0} == {200}
    assert {s for i, s in enumerate(statuses) if i % 30} == {431}
    assert edge_server.get("/healthz")[0] == 200


@pytest.mark.parametrize(
    "host", [b"", b"Host: a\r\nHost: b\r\n", b"Host: a b\r\n"], ids=["none", "two", "invalid"]
)
def test_http11_request_without_exactly_one_valid_host_is_400(edge_server, host):
    answer = Answer(edge_server.port, b"GET /healthz HTTP/1.1\r\n" + host + b"\r\n")
    assert answer.status == 400 and answer.closed
    assert answer.error()["type"] == "invalid_request_error"
    assert "host" in answer.error()["message"].lower()


def test_http10_request_without_host_is_served(edge_server):
    answer = Answer(edge_server.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert (answer.status, answer.body) == (200, b'{"status":"ok"}')


def test_body_that_stops_arriving_is_408_and_the_connection_closes(edge_server):
    started = time.monotonic()
    answer = Answer(
        edge_server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{",
    )
    assert answer.status == 408
    assert answer.error()["code"] == "request_timeout"
    assert answer.headers["connection"] == "close"
    assert answer.closed and time.monotonic() - started < 4  # closed with the 408, not later


def test_impossible_chunk_size_is_400_at_once(edge_server):
    answer = Answer(
        edge_server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFFFFFF\r\n{",
    )
    # Not the 408 of the 2 s deadline: refused as soon as the size line is read.
    assert answer.status == 400
    assert answer.error()["message"] == (
        "Malformed request body: Invalid chunk size: 'chunk size over 2**63-1 bytes'."
    )


STREAM_BODY = json.dumps(
    {"model": "succ", "prompt": "a", "max_tokens": 3, "temperature": 0, "stream": True}
).encode()


def stream_request(version: bytes) -> bytes:
    return (
        b"POST /v1/completions " + version + b"\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(STREAM_BODY)).encode() + b"\r\n\r\n" + STREAM_BODY
    )


def read_chunked(sock: socket.socket, buf: bytes) -> tuple[list[bytes], bytes]:
    """Read one chunked body from ``buf`` + ``sock``; return its chunks and what follows it."""
    chunks = []
    while True:
        while b"\r\n" not in buf:
            buf += sock.recv(65536)
        size_line, _, buf = buf.partition(b"\r\n")
        assert size_line == size_line.upper() and size_line.strip() == size_line  # as gunicorn
        size = int(size_line, 16)
        while len(buf) < size + 2:
            buf += sock.recv(65536)
        assert buf[size : size + 2] == b"\r\n"
        if size == 0:
            return chunks, buf[2:]
        chunks.append(buf[:size])
        buf = buf[size + 2 :]


def test_a_stream_is_one_chunk_per_event_and_the_connection_is_kept(edge_server):
    # After the first event the stream writes its chunks itself: the framing must be gunicorn's.
    with socket.create_connection(("127.0.0.1", edge_server.port), timeout=10) as sock:
        rest = b""
        for _ in range(2):  # the second request proves the body ended exactly where it should
            sock.sendall(stream_request(b"HTTP/1.1"))
            while b"\r\n\r\n" not in rest:
                rest += sock.recv(65536)
            head, _, rest = rest.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"Transfer-Encoding: chunked" in head
            chunks, rest = read_chunked(sock, rest)
            assert chunks[0] == b": ok\n\n"
            assert chunks[-1] == b"data: [DONE]\n\n"
            texts = [json.loads(c[len(b"data: ") :])["choices"][0]["text"] for c in chunks[1:-1]]
            assert texts == ["b", "c", "d"]
            assert all(c.startswith(b"data: {") and c.endswith(b"}\n\n") for c in chunks[1:-1])
        assert rest == b""


def test_an_http10_stream_is_not_chunked_and_ends_with_the_connection(edge_server):
    answer = Answer(edge_server.port, stream_request(b"HTTP/1.0"))
    assert answer.status == 200 and answer.closed
    assert "transfer-encoding" not in answer.headers
    events = answer.body.split(b"\n\n")
    assert events[0] == b": ok" and events[-2:] == [b"data: [DONE]", b""]
    texts = [json.loads(e[len(b"data: ") :])["choices"][0]["text"] for e in events[1:-2]]
    assert texts == ["b", "c", "d"]
