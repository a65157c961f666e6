"""Server-Sent Events for tests: one strict parser of a whole body, and a reader of a live stream.

``frames`` is the one parser; ``sse_events`` and ``sse_json`` read a POST stream (``data:`` lines only),
``events`` reads a stream the way ``EventSource`` does (ids carry over, blocks without data skipped).

Source: WHATWG HTML Living Standard, "Server-sent events" (9.2).
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

# The end of a stream, byte for byte: ``[DONE]``, and before it the error event of a stream that the
# server's stop ended early (the OpenAI error envelope, code ``unavailable``).
DONE = b"data: [DONE]\n\n"
SHUTDOWN_END = (
    b'data: {"error":{"message":"Server is shutting down; generation was ended early.",'
    b'"type":"server_error","param":null,"code":"unavailable"}}\n\n' + DONE
)


def frames(body: bytes) -> list[dict[str, str]]:
    """Split an event stream into frames of ``{field: value}``, comment lines and empty frames dropped.

    The framing is checked as greenserve writes it: the body ends with a blank line, every line is
    ``name: value`` and no field repeats within a frame (the server never splits data over lines).

    Raises:
        AssertionError: the body breaks that framing.
    """
    assert body.endswith(b"\n\n"), body[-40:]
    out = []
    for block in body[:-2].decode().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            name, sep, value = line.partition(": ")
            assert sep and name not in fields, block
            fields[name] = value
        if fields:
            out.append(fields)
    return out


def events(body: bytes) -> list[dict[str, Any]]:
    """Return the events ``EventSource`` would dispatch: ``{"data", "event", "id"?, "retry"?}`` each."""
    out, last_id = [], None
    for frame in frames(body):
        last_id = frame.get("id", last_id)
        if "data" not in frame:
            continue
        event: dict[str, Any] = {"data": frame["data"], "event": frame.get("event", "message")}
        if last_id is not None:
            event["id"] = last_id
        if "retry" in frame:
            event["retry"] = int(frame["retry"])
        out.append(event)
    return out


def sse_events(body: bytes) -> list[bytes]:
    """Return the ``data:`` payloads of a POST stream, checking that every frame is one ``data:`` line."""
    payloads = []
    for frame in frames(body):
        assert list(frame) == ["data"], frame
        payloads.append(frame["data"].encode())
    return payloads


def sse_json(body: bytes) -> list[dict]:
    """Return the JSON payloads of a POST stream; asserts it ends with exactly one ``[DONE]``."""
    payloads = sse_events(body)
    assert payloads[-1] == b"[DONE]", payloads[-3:]
    assert b"[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


class EventReader:
    """Read an SSE response frame by frame over a real connection (http.client decodes chunking).

    Args:
        port: the server's API port.
        body: the JSON request body (a dict).
        headers: extra request headers.
        rcvbuf: a small ``SO_RCVBUF`` in bytes, to make a non-reading client block the server sooner.
        timeout_s: the socket timeout, in seconds.
        path: the route POSTed to.
    """

    def __init__(
        self,
        port: int,
        body: dict,
        headers: dict[str, str] | None = None,
        rcvbuf: int | None = None,
        timeout_s: float = 30.0,
        path: str = "/v1/completions",
    ) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        if rcvbuf is not None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Before connect(), so the advertised window stays small.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.settimeout(timeout_s)
            sock.connect(("127.0.0.1", port))
            self.conn.sock = sock
        self.conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        self.sock = self.conn.sock
        self.resp: http.client.HTTPResponse | None = None

    def open(self) -> http.client.HTTPResponse:
        """Read the status line and headers."""
        self.resp = self.conn.getresponse()
        return self.resp

    def next_frame(self) -> bytes:
        """Return the next frame (event or comment) without its blank line; b"" at the end."""
        assert self.resp is not None
        lines = []
        while True:
            line = self.resp.readline()
            if not line or line == b"\n":
                return b"".join(lines)
            lines.append(line)

    def close(self) -> None:
        """Close the connection abruptly (as a client that goes away)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.resp is not None:
            self.resp.close()
        self.conn.close()
        self.sock.close()


def open_stream(port: int, body: dict, request_id: str | None = None) -> EventReader:
    """POST ``body`` (a streamed request, with ``X-Request-Id: request_id`` when given) to
    ``/v1/completions`` and read the answer's status line and headers; return the reader."""
    reader = EventReader(port, body, {"X-Request-Id": request_id} if request_id else None)
    reader.open()
    return reader
