"""gunicorn's gevent worker with a cheaper ``sendall`` for the many small writes of a stream.

A token event is ~150 bytes and the kernel almost always takes it whole, yet gevent's
``socket.sendall`` pays for a general path every time: a ``getsockopt(SO_SNDBUF)`` system call to size
its slices, a deadline, a memoryview and three Python frames. On the streamed hot path that is about a
tenth of the worker's CPU. :class:`StreamSocket` tries one non-blocking ``send`` first and hands the
rest, if any, to gevent's own ``sendall``, which waits for the socket with the connection's timeout
(``SEND_TIMEOUT_S``) exactly as before. Bytes on the wire do not change.

This module is imported by the arbiter (``worker_class`` in ``gunicorn.conf.py``): it imports gevent
and gunicorn only, never Flask.
"""

from __future__ import annotations

from typing import Any

from gevent import socket as gsocket
from gunicorn.workers import ggevent


class StreamSocket(gsocket.socket):
    """A gevent TCP socket whose ``sendall`` tries one plain non-blocking ``send`` first."""

    __slots__ = ()

    def sendall(self, data: Any, flags: int = 0) -> None:
        """Send all of ``data`` (a bytes-like object, in bytes), cooperatively when the kernel is full.

        Raises:
            TimeoutError: the peer did not take the rest within the socket's timeout (gevent's).
            OSError: the connection failed (reset, broken pipe), as ``socket.sendall``.
        """
        try:
            sent = self._sock.send(data, flags)  # the real socket is non-blocking under gevent
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            super().sendall(memoryview(data)[sent:], flags)


class GeventWorker(ggevent.GeventWorker):
    """gunicorn's gevent worker whose plain TCP connections are :class:`StreamSocket`\\ s.

    TLS connections (gunicorn's ``certfile``) and anything else keep gevent's own class.
    """

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        """Serve one connection (gunicorn's ``handle``) over a :class:`StreamSocket`."""
        if type(client) is gsocket.socket:
            client = StreamSocket(client.family, client.type, client.proto, fileno=client.detach())
        super().handle(listener, client, addr)
