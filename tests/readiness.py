"""Readiness probes over raw sockets, shared by the probe tests and the several-models tests: the
exact bytes of a probe's answer (its Date and X-Model-Version made constant), ``/ready`` on both
ports, and a tiny Llama's weights overwritten in place under a running worker (its engine's own
failure, no fault injected)."""

from __future__ import annotations

import json
import re
import socket
import struct
from pathlib import Path

from tests.server import GunicornServer

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
    """Return a probe's request bytes (``X-Request-Id: probe-1``, ``Connection: close``)."""
    lines = [f"{method} {path} HTTP/{version}", "Host: t", "X-Request-Id: probe-1", *headers]
    return ("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode()


def plain(answer: bytes) -> bytes:
    """``answer`` with its Date and X-Model-Version values made constant."""
    answer = DATE.sub(b"Date: D\r\n", answer)
    return MODEL_VERSION.sub(b"X-Model-Version: V\r\n", answer)


def expected(status: bytes, body: bytes, head: bool = False, version: bytes = b"1.1") -> bytes:
    """Return a probe's whole answer as :func:`plain` shows it (no body for ``head``)."""
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
