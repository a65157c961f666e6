"""Strict input: body limits for every framing, malformed chunking, strict JSON; never HTML, never 5xx.

Raw sockets, because client libraries neither send malformed chunking nor show what the server does to
the connection afterwards.
"""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import GunicornServer
from wsgi_app.api.errors import ApiError
from wsgi_app.http.body import read_body

LIMIT = 2048
OK = b'{"model":"m","prompt":"a","max_tokens":2,"temperature":0}'
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def small_server(succ_dir: Path, serve_module) -> GunicornServer:
    """The succ model with ``MAX_BODY_BYTES=2048``."""
    return serve_module(MODEL_DIR=str(succ_dir), MAX_BODY_BYTES=str(LIMIT), health_port=False)


def chunked(body: bytes, size: int = 500) -> bytes:
    """Encode ``body`` in the chunked transfer coding (RFC 9112 §7.1), ``size`` bytes a chunk."""
    out = b""
    for i in range(0, len(body), size):
        part = body[i : i + size]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


def padded(size: int) -> bytes:
    """A valid request body of exactly ``size`` bytes (JSON whitespace before the closing brace)."""
    return OK[:-1] + b" " * (size - len(OK)) + b"}"


class Exchange:
    """One HTTP/1.1 exchange over a raw socket: the response, and whether the server then closed.

    Its socket is closed by :meth:`closed_by_server`, else at the end of the test (``opened``).
    """

    opened: list[socket.socket] = []

    def __init__(self, port: int, data: bytes, shut_write: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        Exchange.opened.append(self.sock)
        self.sock.sendall(data)
        if shut_write:
            self.sock.shutdown(socket.SHUT_WR)
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        length = int(self.headers["content-length"])
        while len(self.buf) < length:
            self._recv()
        self.body, self.rest = self.buf[:length], self.buf[length:]

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        assert data, f"connection closed early after {self.buf!r}"
        self.buf += data

    def closed_by_server(self, wait_s: float = 3.0) -> bool:
        """True when the server closes the connection (EOF) and sends nothing more."""
        self.sock.settimeout(wait_s)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return False
        finally:
            self.sock.close()
        assert self.rest + data == b"", data  # never a second, unsolicited response
        return True


@pytest.fixture(autouse=True)
def close_exchanges() -> Iterator[None]:
    """Close every test's exchange sockets (an unclosed socket is a ResourceWarning: an error)."""
    yield
    while Exchange.opened:
        Exchange.opened.pop().close()


def error_of(ex: Exchange) -> dict:
    assert ex.headers["content-type"] == "application/json"
    doc = json.loads(ex.body)
    assert list(doc["error"]) == ["message", "type", "param", "code"]
    return doc["error"]


# -- body size limit ------------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_body_of_exactly_the_limit_is_read_whole(small_server, framing):
    body = padded(LIMIT)
    if framing == "chunked":
        data = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body)
    else:
        data = HEAD + b"Content-Length: %d\r\n\r\n" % LIMIT + body
    ex = Exchange(small_server.port, data)
    assert ex.status == 200, ex.body
    assert json.loads(ex.body)["choices"][0]["text"] == "bc"


@pytest.mark.parametrize("size", [LIMIT + 1, 5 * LIMIT])
def test_chunked_body_over_the_limit_is_413(small_server, size):
    ex = Exchange(
        small_server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(padded(size))
    )
    assert ex.status == 413
    assert error_of(ex) == {
        "message": f"Request body is larger than {LIMIT} bytes.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }


def test_content_length_over_the_limit_is_413_before_the_body_arrives(small_server):
    # Only the headers are sent: the answer must not wait for a gigabyte that never comes.
    ex = Exchange(small_server.port, HEAD + b"Content-Length: 1000000000\r\n\r\n")
    assert ex.status == 413
    assert error_of(ex)["code"] == "request_too_large"


def test_content_length_one_past_the_limit_is_413(small_server):
    body = padded(LIMIT + 1)
    ex = Exchange(small_server.port, HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert ex.status == 413


def test_small_chunks_reassemble(small_server):
    ex = Exchange(small_server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(OK, 3))
    assert ex.status == 200
    assert json.loads(ex.body)["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
    }


# -- malformed chunking ---------------------------------------------------------------------------

MALFORMED = {
    "size-not-hex": (
        b"zz\r\nabc\r\n0\r\n\r\n",
        "Malformed request body: Invalid chunk size: b'zz'.",
    ),
    "data-longer-than-size": (
        b"5\r\nabcdefgh\r\n0\r\n\r\n",
        "Malformed request body: Invalid chunk terminator is not '\\r\\n': b'fg'.",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_chunked_body_is_400_and_the_connection_closes(small_server, name):
    raw, message = MALFORMED[name]
    ex = Exchange(small_server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + raw)
    assert ex.status == 400
    assert error_of(ex) == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    # Where a next request would start is unknown: gunicorn closes, with no stray second answer.
    assert ex.closed_by_server()


def test_chunked_body_cut_short_is_400(small_server):
    ex = Exchange(
        small_server.port, HEAD + b'Transfer-Encoding: chunked\r\n\r\n10\r\n{"mo', shut_write=True
    )
    assert ex.status == 400
    assert error_of(ex)["message"] == "Request body ended before its last chunk."


# -- strict JSON ----------------------------------------------------------------------------------

STRICT = [
    (b'{"model":"m","prompt":"a","temperature":NaN}', "NaN is not valid JSON"),
    (b'{"model":"m","prompt":"a","temperature":Infinity}', "Infinity is not valid JSON"),
    (b'{"model":"m","prompt":"a","temperature":-Infinity}', "-Infinity is not valid JSON"),
    (b'{"model":"m","prompt":"a","prompt":"b"}', "duplicate key 'prompt'"),
    (b'{"model":"m","prompt":"a","stream_options":{"x":1,"x":2}}', "duplicate key 'x'"),
]


@pytest.mark.parametrize(("raw", "problem"), STRICT)
def test_strict_json_names_the_problem(succ_server, raw, problem):
    status, _, body = succ_server.post("/v1/completions", raw)
    assert status == 400
    assert json.loads(body)["error"] == {
        "message": f"Request body is not valid JSON: {problem}.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


GARBAGE = [
    (b"model=m&prompt=a", {"Content-Type": "application/x-www-form-urlencoded"}),
    (b'{"model":"m","prompt":"a","max_tokens":1e999}', {}),
    (b'{"model":"m","prompt":"a","max_tokens":' + b"9" * 5000 + b"}", {}),
    (b"[" * 100_000, {}),
    (b'{"model":"m","prompt":"\\ud800"}', {}),
    (b"\xef\xbb\xbf" + OK, {}),
    (OK, {"Content-Type": "text/plain"}),
    (b'{"model":"m","prompt":{"a":1}}', {}),
    (b'{"model":"m","prompt":"a","logit_bias":{"-1":1}}', {}),
    (b'{"model":"m","prompt":"a","stop":[null]}', {}),
]


@pytest.mark.parametrize(("raw", "headers"), GARBAGE)
def test_odd_input_is_a_json_4xx_never_html_nor_5xx(succ_server, raw, headers):
    status, got, body = succ_server.post("/v1/completions", raw, headers=headers)
    if raw == OK:  # the Content-Type header is not needed to read JSON
        assert status == 200
        return
    assert status == 400, body
    assert got["content-type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


# -- read_body, in process ------------------------------------------------------------------------


def test_read_body_reads_to_the_end_of_a_terminated_stream():
    body = b"x" * 200_000
    assert read_body({"wsgi.input": io.BytesIO(body)}, 200_000) == body
    assert read_body({"wsgi.input": io.BytesIO(b""), "CONTENT_LENGTH": "0"}, 10) == b""


def test_read_body_refuses_one_byte_past_the_limit_without_reading_further():
    stream = io.BytesIO(b"x" * 100_000)
    with pytest.raises(ApiError) as info:
        read_body({"wsgi.input": stream}, 70_000)
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert stream.tell() == 70_001


def test_read_body_refuses_a_declared_length_over_the_limit_before_reading():
    stream = io.BytesIO(b"{}")
    with pytest.raises(ApiError):
        read_body({"wsgi.input": stream, "CONTENT_LENGTH": "11"}, 10)
    assert stream.tell() == 0


# -- requests gunicorn refuses before the app -----------------------------------------------------

UNPARSEABLE = [
    (
        b"GARBAGE\r\n\r\n",
        400,
        "Bad Request: Invalid Request Line 'Invalid HTTP request line: 'GARBAGE''",
    ),
    (b"GET /healthz HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n", 400, None),
    (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, None),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, None),
    (HEAD + b"Transfer-Encoding: gzip\r\n\r\n", 400, None),
    (HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n{}", 400, None),
]


@pytest.mark.parametrize(("raw", "status", "message"), UNPARSEABLE)
def test_requests_gunicorn_refuses_get_a_json_error(small_server, raw, status, message):
    ex = Exchange(small_server.port, raw)
    assert ex.status == status
    err = error_of(ex)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, None)
    if message is not None:
        assert err["message"] == message
    assert len(ex.headers["x-request-id"]) == 32
    assert ex.headers["x-model-version"].endswith("+greenserve-0.1.0")
    assert ex.closed_by_server()
