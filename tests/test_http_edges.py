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

from tests.server import GunicornServer, concurrently

FIELD = b"a" * 8000  # under gunicorn's per-field limit (8190 bytes)


@pytest.fixture(scope="module")
def edge_server(succ_dir, tmp_path_factory):
    """One worker on the succ model with a 2 s request deadline."""
    env = {"MODEL_DIR": str(succ_dir), "REQUEST_TIMEOUT_S": "2"}
    with GunicornServer(tmp_path_factory.mktemp("edges"), env) as srv:
        yield srv


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
