"""The worker's HTTP/1.1 request parser: gunicorn's, with the bounds gunicorn leaves out.

gunicorn limits the request line, each header field's size and the field count, so one request's head
may still be ~800 KB (100 fields of 8 KB) and parsing it costs the worker's hub tens of milliseconds.
:class:`BoundedRequest` also bounds:

- the whole head (request line and fields), ``MAX_HEADER_BYTES``: past it the request is answered
  ``431`` at once, before anything more is read or parsed;
- the time the head may take, ``HEADER_TIMEOUT_S`` from its first byte (from the connection's start for
  its first request): past it, ``408`` and the connection closes;
- the wait for the next request on an idle keep-alive connection, ``KEEPALIVE_S``, and none at all once
  the worker is stopping: the connection closes quietly;
- a request without exactly one ``Host`` on HTTP/1.1 (at most one on HTTP/1.0): ``400``;
- a chunk size no server could take (over 2**63 - 1 bytes): ``400`` at once, not a wait for the
  bytes.

Every refusal is gunicorn's own error answer (``gunicorn_errors.py`` makes it JSON). This module is
imported by the worker: gevent and gunicorn only, never Flask.

Source: RFC 9112 §2.2, §3.2 (Host), §5, §7.1 (chunked coding: "anticipate potentially large hexadecimal
numerals"), §9.3 (persistent connections); RFC 6585 §5 (431); RFC 9110 §15.5.9 (408).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

import gevent
from gevent.socket import wait_read
from gunicorn import util as gunicorn_util
from gunicorn.http.body import Body, ChunkedReader
from gunicorn.http.errors import (
    InvalidChunkSize,
    InvalidHeader,
    LimitRequestHeaders,
    ParseException,
)
from gunicorn.http.message import Request
from gunicorn.http.parser import RequestParser


class _IdleOver(Exception):
    """No request started within the wait."""


_IDLE_OVER = _IdleOver()
# Once the worker is stopping, a new connection that has sent nothing yet gets this long for its
# first byte, seconds (a client that connected just before the stop is sending already).
STOPPING_FIRST_BYTE_S = 1.0
MAX_CHUNK_SIZE = 2**63 - 1  # bytes: larger sizes overflow every other implementation's integer
# A Host value: reg-name, IPv4 or IP-literal, then an optional port (RFC 3986 §3.2.2, §3.2.3).
_HOST_VALUE = re.compile(r"(?:\[[0-9A-Fa-f:.vV\-]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]*)?")
# Peers whose trust gunicorn's FORWARDED_ALLOW_IPS check has decided, at most this many kept.
TRUSTED_PEERS_KEPT = 4096


class HeadTimeout(ParseException):
    """The request's head did not arrive within ``HEADER_TIMEOUT_S`` (answered 408)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return f"request head not received within {self.timeout_s:g} s"


@dataclass
class HeadLimits:
    """What a worker's parsers bound, and whether the worker is stopping.

    Attributes:
        max_header_bytes: the largest request head (request line, fields, blank line), bytes.
        header_timeout_s: how long a request's head may take to arrive, seconds.
        keepalive_s: how long an idle connection waits for its next request, seconds.
        stopping: returns True once the worker is stopping (no idle wait then).
    """

    max_header_bytes: int
    header_timeout_s: float
    keepalive_s: float
    stopping: Callable[[], bool] = lambda: False


class BoundedChunkedReader(ChunkedReader):
    """gunicorn's chunked-body reader that refuses an impossible chunk size at once."""

    def parse_chunk_size(self, unreader: Any, data: bytes | None = None) -> tuple[int, Any]:
        """Return ``(size, rest)`` of the next chunk-size line.

        Raises:
            InvalidChunkSize: the size is over :data:`MAX_CHUNK_SIZE` (or malformed, as gunicorn's).
        """
        size, rest = super().parse_chunk_size(unreader, data)
        if size > MAX_CHUNK_SIZE:
            raise InvalidChunkSize("chunk size over 2**63-1 bytes")
        return size, rest


class BoundedRequest(Request):
    """gunicorn's request, its head bounded in bytes and time (see the module docstring).

    ``limits`` is the worker's, set once by :func:`install`.
    """

    limits = HeadLimits(32_768, 10.0, 5.0)
    # (peer address, FORWARDED_ALLOW_IPS) -> whether gunicorn trusts the peer's forwarding headers.
    _trusted_peers: dict[tuple[str, tuple[str, ...]], bool] = {}

    def __init__(self, cfg: Any, unreader: Any, peer_addr: Any, req_number: int = 1) -> None:
        self._head_deadline: float | None = None
        if req_number == 1:  # a new connection: its first request's head is due from now
            self._head_deadline = time.monotonic() + self.limits.header_timeout_s
        super().__init__(cfg, unreader, peer_addr, req_number)

    def _peer_is_trusted_proxy(self) -> bool:
        """gunicorn's check of the peer against ``FORWARDED_ALLOW_IPS``, decided once per address
        (it parses the address, ~2 % of a short request; the answer depends on nothing else)."""
        peer = self.peer_addr
        if not isinstance(peer, tuple):  # a UNIX socket: gunicorn trusts it
            return True
        key = (peer[0], tuple(self.cfg.forwarded_allow_ips))
        known = self._trusted_peers
        trusted = known.get(key)
        if trusted is None:
            if len(known) >= TRUSTED_PEERS_KEPT:
                known.clear()
            trusted = known[key] = super()._peer_is_trusted_proxy()
        return trusted

    def read_into(self, unreader: Any, buf: bytearray, stop: bool = False) -> None:
        """Read more of the head into ``buf``, within the byte and time bounds.

        Raises:
            StopIteration: no request came (idle keep-alive over, worker stopping): close quietly.
            HeadTimeout: the head is late (408).
            LimitRequestHeaders: the head is over ``MAX_HEADER_BYTES`` (431).
        """
        limits = self.limits
        if stop and not buf and not unreader.buf.tell():  # waiting for a request to start
            self._await_first_byte(getattr(unreader, "sock", None))
        if self._head_deadline is None:  # a pipelined request: its head is due from now
            self._head_deadline = time.monotonic() + limits.header_timeout_s
        left = self._head_deadline - time.monotonic()
        timer = gevent.Timeout(max(left, 0.0))
        try:
            with timer:
                super().read_into(unreader, buf, stop)
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            if not buf:
                raise StopIteration() from None  # nothing was sent: no answer is owed
            raise HeadTimeout(limits.header_timeout_s) from None
        if len(buf) > limits.max_header_bytes:
            # buf may hold body bytes read with the head's end: only a head still open counts.
            if buf.find(b"\r\n\r\n", 0, limits.max_header_bytes + 4) < 0:
                raise LimitRequestHeaders(f"request head over {limits.max_header_bytes} bytes")

    def _await_first_byte(self, sock: Any) -> None:
        """Wait for a request to start: up to ``KEEPALIVE_S`` on a kept-alive connection (not at all
        once the worker is stopping), up to the head's deadline on a new one, and at most
        ``STOPPING_FIRST_BYTE_S`` on a new one once the worker is stopping (a connection accepted
        just before a stop still gets its answer: its client has sent, or is sending, a request).
        Meanwhile the connection is marked idle: a worker that starts stopping shuts it down
        unless bytes are waiting on it (``wsgi_app.server.worker``).

        Raises:
            StopIteration: no request came, or the kept-alive connection's worker is stopping.
        """
        limits = self.limits
        kept_alive = self._head_deadline is None
        if kept_alive and limits.stopping():
            raise StopIteration()
        if kept_alive:
            wait_s = limits.keepalive_s
        else:
            wait_s = self._head_deadline - time.monotonic()
            if limits.stopping():
                wait_s = min(wait_s, STOPPING_FIRST_BYTE_S)
        idle = hasattr(sock, "idle")
        if sock is not None and hasattr(sock, "fileno") and not _bytes_waiting(sock):
            if idle:
                sock.idle = True  # a stopping worker shuts it down (wsgi_app.server.worker)
            try:
                wait_read(sock.fileno(), max(wait_s, 0.0), _IDLE_OVER)
            except _IdleOver:
                raise StopIteration() from None
            finally:
                if idle:
                    sock.idle = False
        if kept_alive and limits.stopping():
            raise StopIteration()

    def set_body_reader(self) -> None:
        """Check ``Host`` (the head is parsed), then frame the body as gunicorn does, with the
        chunk size bounded.

        Raises:
            InvalidHeader: no ``Host`` on HTTP/1.1, several, or an invalid value (400).
        """
        hosts = [value for name, value in self.headers if name == "HOST"]
        if self.version >= (1, 1) and not hosts:
            raise InvalidHeader("HTTP/1.1 request without Host", req=self)
        if len(hosts) > 1:
            raise InvalidHeader("more than one Host", req=self)
        if hosts and not _HOST_VALUE.fullmatch(hosts[0]):
            raise InvalidHeader("invalid Host", req=self)
        super().set_body_reader()
        if isinstance(self.body.reader, ChunkedReader):
            self.body = Body(BoundedChunkedReader(self, self.unreader))


def _bytes_waiting(sock: Any) -> bool:
    """True when bytes wait on ``sock`` (a non-blocking peek; an end of file is left to the wait). A new
    connection's request is usually there when its greenlet starts; waiting for the hub to report
    it readable would cost that connection a whole turn of the hub (every running stream's slice)."""
    try:
        return bool(getattr(sock, "_sock", sock).recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:  # nothing yet
        return False
    except OSError:  # failed: let the read report it
        return True


class HttpDate:
    """gunicorn's ``util.http_date`` made once a second: every response's ``Date`` header cost an
    ``email.utils.formatdate`` call, ~2 % of a short request. The same text (IMF-fixdate, GMT).

    Source: RFC 9110 §5.6.7 (HTTP-date), §6.6.1 (Date).
    """

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second = -1
        self.text = ""

    def __call__(self, timestamp: float | None = None) -> str:
        """Return ``timestamp`` (Unix seconds; now when None) as an HTTP-date."""
        if timestamp is not None:
            return formatdate(timestamp, usegmt=True)
        second = int(time.time())
        if second != self.second:
            self.text = formatdate(second, usegmt=True)
            self.second = second
        return self.text


def install(limits: HeadLimits) -> None:
    """Make this worker's gunicorn parse HTTP/1.x requests with :class:`BoundedRequest` under
    ``limits``, and date its responses with :class:`HttpDate` (call once per worker; HTTP/2 and
    uWSGI keep gunicorn's parsers)."""
    BoundedRequest.limits = limits
    RequestParser.mesg_class = BoundedRequest
    gunicorn_util.http_date = HttpDate()
