"""The response of every completion stream (the POST stream and the ``EventSource`` stream): a
``text/event-stream`` response whose body, a ``wsgi_app.generation.lifetime.Generation``, gunicorn
iterates directly and closes (which ends the generation: docs/ARCHITECTURE.md §9), its events after
the first written straight to the socket.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events"; RFC 9112 §7.1 (chunked transfer coding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice

from flask import Response

from wsgi_app.generation.lifetime import Generation
from wsgi_app.server.stream_socket import StreamSocket

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Events:
    """The WSGI body of an :class:`EventStreamResponse`: iterating it is iterating the stream's
    generator, or, on an HTTP/1.1 connection of greenserve's worker, writing it.

    gunicorn writes each item a body yields through four Python calls (``Response.write``, its
    bookkeeping, ``util.write``, ``write_chunk``), a tenth of a token's cost. Here the first event (the
    opening comment) still goes through gunicorn, which sends the headers with it and so commits to
    chunked transfer coding; every later event is framed as one chunk and sent straight to the socket
    (``StreamSocket.write_chunks``: the same bytes gunicorn would send), and gunicorn ends the body
    with its last chunk. Both are chained in C, so no frame of this module sits between a token's
    event and its write. A failed write raises from this iterator, as it would from gunicorn's
    write, and ``close()`` is called the same way.

    Source: RFC 9112 §7.1 (chunked transfer coding); gunicorn's ``Response.is_chunked``.
    """

    __slots__ = ("_events", "close", "_sock")

    def __init__(
        self,
        events: Iterator[bytes],
        close: Callable[[], None],
        sock: StreamSocket | None,
    ) -> None:
        self._events = events
        self.close = close
        self._sock = sock

    def __iter__(self) -> Iterator[bytes]:
        if self._sock is None:
            return self._events
        return chain(islice(self._events, 1), self._sock.write_chunks(self._events))


def _direct_socket(environ: dict) -> StreamSocket | None:
    """Return the connection when gunicorn will frame this response as chunks on a greenserve
    worker's socket (HTTP/1.1, a body, no ``Content-Length``), else None."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, StreamSocket) or not sock.http:
        return None
    return sock if environ.get("SERVER_PROTOCOL") == "HTTP/1.1" else None


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose body (the :class:`Generation`) gunicorn iterates
    directly.

    werkzeug wraps a body in two Python-level iterators (its ``ClosingIterator`` and the str-to-bytes
    ``iter_encoded``) that cost a few percent of a token's time and do nothing for a body of bytes;
    and after the first event the events are written to the socket directly (:class:`_Events`).
    ``close()`` still goes through ``Response.close``: the body's own close, then the
    ``call_on_close`` callbacks (the request's span and log line).
    """

    def __init__(self, body: Generation) -> None:
        super().__init__(body, content_type="text/event-stream", headers=STREAM_HEADERS)

    def get_app_iter(self, environ: dict) -> Iterable[bytes]:
        """Return the stream's events, with ``close()`` calling :meth:`Response.close`."""
        if environ["REQUEST_METHOD"] == "HEAD":
            return super().get_app_iter(environ)
        return _Events(iter(self.response), self.close, _direct_socket(environ))
