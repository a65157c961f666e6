"""A gevent TCP socket whose writes are cheap on the streamed hot path and bounded by progress.

A token event is ~150 bytes and the kernel almost always takes it whole, yet gevent's
``socket.sendall`` pays for a general path every time: a ``getsockopt(SO_SNDBUF)`` system call to size
its slices, a deadline, a memoryview and three Python frames. On the streamed hot path that was about a
tenth of the worker's CPU. :class:`StreamSocket` tries one non-blocking ``send`` first.

When the kernel's buffer is full the rest waits for the socket to drain, and the send timeout
(``SEND_TIMEOUT_S``, set per request by the app) bounds a wait *without progress* (the kernel's send
queue did not shrink: ``SIOCOUTQ``), not the whole write: a slow reader that keeps reading is never
cut, one that stops is cut after that long (:class:`SendTimeout`). The timeout is for writes only,
so reading the next request on a keep-alive connection is not affected by it.

Imported by the worker (every plain TCP connection is one) and by the app, which sets each request's
send timeout: gevent only, never Flask.
"""

from __future__ import annotations

import fcntl
import struct
import termios
import time
from collections.abc import Iterator
from typing import Any

from gevent import socket as gsocket

from wsgi_app.server.end_reason import SEND_TIMEOUT

# How often a blocked write looks at the kernel's send queue for progress, seconds: a reader that
# stops is cut at most this long after ``SEND_TIMEOUT_S``.
PROGRESS_CHECK_S = 0.25


class SendTimeout(TimeoutError):
    """A write made no progress for the connection's send timeout: the client stopped reading."""


class StreamSocket(gsocket.socket):
    """A gevent TCP socket whose ``sendall`` tries one plain non-blocking ``send`` first.

    Attributes:
        send_timeout_s: the longest a write may wait for the peer to take more bytes, seconds; None
            falls back to gevent's ``sendall`` and the socket's own timeout.
        stalled: True once a write was cut by ``send_timeout_s``.
        end_reason: who ended the connection's request, when the server did: ``"send_timeout"``
            (its reader stopped), ``"shutdown"`` (the worker stopping cut or ended it), else None.
        blocked: True while a write waits for the peer.
        idle: True while the connection waits for a request to start.
        request: the request being answered (gunicorn's ``Request``), or None.
        http: True when the connection speaks HTTP/1.x (gunicorn's ``protocol`` is ``http``, not
            ``uwsgi``), so gunicorn frames a body of unknown length as chunks on HTTP/1.1.
    """

    __slots__ = ("send_timeout_s", "stalled", "end_reason", "blocked", "idle", "request", "http")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout_s: float | None = None
        self.stalled = False
        self.end_reason: str | None = None
        self.blocked = False
        self.idle = False
        self.request: Any = None
        self.http = True

    def close_after_response(self) -> None:
        """Answer the current request with ``Connection: close`` and close the connection after it
        (when its headers are still unsent; otherwise just close after it)."""
        if self.request is not None:
            self.request.force_close()

    def sendall(self, data: Any, flags: int = 0) -> None:
        """Send all of ``data`` (a bytes-like object), cooperatively when the kernel is full.

        Raises:
            SendTimeout: the peer took nothing for ``send_timeout_s`` seconds.
            OSError: the connection failed (reset, broken pipe), as ``socket.sendall``.
        """
        try:
            sent = self._sock.send(data, flags)  # the real socket is non-blocking under gevent
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send_rest(memoryview(data).cast("B")[sent:], flags)

    def write_chunks(self, events: Iterator[bytes]) -> Iterator[bytes]:
        """Send each of ``events`` as one chunk of a chunked body (the bytes gunicorn's
        ``write_chunk`` sends, without its four Python calls an event); yields nothing, so that a
        body ending with it writes every event within one request of the server for its next item.

        Raises:
            SendTimeout, OSError: as :meth:`sendall`, out of the body, as from gunicorn's write.

        Source: RFC 9112 §7.1 (chunked transfer coding).
        """
        send = self.sendall
        for event in events:
            send(b"%X\r\n%b\r\n" % (len(event), event))
        yield from ()

    def _send_rest(self, view: memoryview, flags: int) -> None:
        timeout = self.send_timeout_s
        if timeout is None:
            super().sendall(view, flags)
            return
        # One bound, counted from the last progress seen: a wait is cut into slices, and each slice
        # looks at the send queue. Restarting a whole timeout after a wait that saw progress (the
        # queue shrank at its very start, say) would let a reader that stopped hold on for twice it.
        check_s = min(PROGRESS_CHECK_S, timeout)
        self.blocked = True
        try:
            queued = _queued_bytes(self)
            progress_at = time.monotonic()
            while view:
                left = progress_at + timeout - time.monotonic()
                if left <= 0:
                    self.stalled = True
                    if self.end_reason is None:  # not if the worker cut it first
                        self.end_reason = SEND_TIMEOUT
                    raise _timeout_exc(timeout)
                try:
                    gsocket.wait_write(self.fileno(), min(check_s, left), _timeout_exc(timeout))
                except SendTimeout:
                    # The kernel reports a socket writable only once a third of its (autotuned, up
                    # to megabytes) buffer is free: a slow reader can take bytes all along and
                    # still never get there within the timeout. Progress is what counts.
                    now_queued = _queued_bytes(self)
                    if 0 <= now_queued < queued:
                        progress_at = time.monotonic()
                    queued = now_queued
                    continue
                try:
                    view = view[self._sock.send(view, flags) :]
                except BlockingIOError:  # woken, but another writer got there first
                    continue
                # The kernel took bytes: the peer made room.
                progress_at = time.monotonic()
                queued = _queued_bytes(self)
        finally:
            self.blocked = False


def _queued_bytes(sock: StreamSocket) -> int:
    """Bytes in the socket's send queue not yet taken by the peer (Linux ``SIOCOUTQ``); -1 where
    the system does not tell, which counts as no progress."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError):
        return -1
    return struct.unpack("i", raw)[0]


def _timeout_exc(timeout_s: float) -> SendTimeout:
    return SendTimeout(f"the client read nothing for {timeout_s:g} s")
