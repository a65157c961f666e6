"""The response body of every completion stream (the POST stream and the ``EventSource`` stream).

Stream lifetime: the response body owns the generation. Its ``close()`` (called by gunicorn after the
last byte, after a failed write, or on a stalled reader's send timeout) closes the token streams and
releases the slot, whether or not the body was ever iterated. Nothing else frees a slot. It also
names why generation ended (``RequestRecord.end_reason``) when nothing before it did: the
connection's mark (``wsgi_app.server.worker.StreamSocket.end_reason``: the send timeout, the worker
stopping), else the client left.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events".
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator

from flask import Response

from wsgi_app.api.errors import ApiError, error_body
from wsgi_app.generation.admission import Ticket
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.pacer import Pacer
from wsgi_app.generation.record import CLIENT_LEFT, ENGINE_ERROR, FINISHED, STOP, RequestRecord
from wsgi_app.generation.start import engine_error
from wsgi_app.http.runtime import Runtime
from wsgi_app.server.connection import peer_closed
from wsgi_app.server.worker import StreamSocket
from wsgi_app.wire import sse

log = logging.getLogger("greenserve.completions")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def queue_heartbeats(ticket: Ticket, pacer: Pacer, heartbeat_s: float) -> Iterator[None]:
    """Wait for ``ticket``'s slot in heartbeat-long slices, yielding after each slice without one
    (the caller writes a heartbeat or looks for a client that left).

    A wait ends early at the deadline or the worker's stop time, or when the stop wakes the queue
    (``Admission.wake_queued``); the clock decides what follows, so a wake a moment before the stop
    time waits out that moment rather than sending a heartbeat. A slot granted past the stop time (a
    running stream ended by the stop freed it) starts nothing: the request ends as the stop says.

    Raises:
        ApiError: 504 past the deadline, 503 when the worker is stopping.
    """
    beat_at = time.perf_counter() + heartbeat_s
    while True:
        now = time.perf_counter()
        if ticket.wait(min(beat_at - now, pacer.time_left_s(now))):
            pacer.check(time.perf_counter())
            return
        now = time.perf_counter()
        pacer.check(now)
        if now >= beat_at:
            beat_at = now + heartbeat_s
            yield


def wait_for_slot(
    ticket: Ticket, pacer: Pacer, heartbeat_s: float, sock: socket.socket | None
) -> bool:
    """Wait for a slot without writing; False when the client went away meanwhile.

    Raises:
        ApiError: 504 past the deadline, 503 when the worker is stopping.
    """
    for _ in queue_heartbeats(ticket, pacer, heartbeat_s):
        if peer_closed(sock):
            return False
    return True


class StreamBody:
    """The SSE response body; ``close()`` always settles the request (see module docstring).

    Events: ``: ok`` at once (so the headers leave before the first token), ``: queued`` every heartbeat
    while waiting for a slot, one ``data:`` event per token, the usage chunk if asked for, ``[DONE]``. A
    failure after the first byte cannot change the status: it becomes an error event before ``[DONE]``.
    The completion's framing decides the opening bytes and the event ids (``retry:`` and ``id:`` on the
    ``EventSource`` stream).

    Args:
        rt: the worker's runtime.
        completion: the generation.
        ticket: its place in the slots or the queue (released by :func:`settle`).
        pacer: its pacer.
        record: the request's record.
        sock: the client's connection (``environ["gunicorn.socket"]``), or None: ``close()`` reads
            its ``end_reason`` mark.
    """

    def __init__(
        self,
        rt: Runtime,
        completion: Completion,
        ticket: Ticket,
        pacer: Pacer,
        record: RequestRecord,
        sock: socket.socket | None = None,
    ) -> None:
        self._rt = rt
        self._completion = completion
        self._ticket = ticket
        self._pacer = pacer
        self._record = record
        self._sock = sock
        self._events = self._generate()

    def __iter__(self) -> Iterator[bytes]:
        # The generator itself: the server's next() then skips a Python-level __next__ per event.
        # close() still reaches this object (werkzeug closes the body it was given).
        return self._events

    def __next__(self) -> bytes:
        return next(self._events)

    def _generate(self) -> Iterator[bytes]:
        failure: ApiError | None = None
        try:
            yield self._completion.framing.opening()
            for _ in queue_heartbeats(self._ticket, self._pacer, self._rt.settings.heartbeat_s):
                yield sse.QUEUED  # a write: a client that left is noticed here
            yield from self._completion.chunks()
            if self._completion.req.include_usage:
                yield self._completion.usage_chunk()
        except Exception as exc:  # noqa: BLE001 - every failure must end the stream cleanly
            failure = engine_error(self._rt, exc)
            self._record.end(ENGINE_ERROR)  # unless the pacer named it (deadline, shutdown)
            if failure.status >= 500 and failure.code not in ("timeout", "unavailable"):
                log.exception("stream %s failed", self._record.request_id)
            self._record.error = failure.message
        finally:
            settle(self._completion, self._ticket, self._record)
        if failure is not None:
            yield sse.data_event(error_body(failure))
        yield self._completion.framing.done()

    def close(self) -> None:
        """Stop generation, release the slot, record the counts and why generation ended;
        idempotent.

        A generation that ended on its own or by an error already named its end; one ended here was
        cut from outside: by the send timeout or the worker stopping (the connection's mark), else by
        the client leaving.
        """
        try:
            self._events.close()  # a suspended stream: its ``finally`` runs now, not at GC
        finally:
            settle(self._completion, self._ticket, self._record)
            self._record.end(getattr(self._sock, "end_reason", None) or CLIENT_LEFT)


class _Events:
    """The WSGI body of an :class:`EventStreamResponse`: iterating it is iterating the stream's
    generator, or, on an HTTP/1.1 connection of greenserve's worker, writing it.

    gunicorn writes each item a body yields through four Python calls (``Response.write``, its
    bookkeeping, ``util.write``, ``write_chunk``), a tenth of a token's cost. Here the first event (the
    opening comment) still goes through gunicorn, which sends the headers with it and so commits to
    chunked transfer coding; every later event is framed as one chunk here and sent straight to the
    socket (the same bytes gunicorn would send), and gunicorn ends the body with its last chunk. A
    failed write raises from this iterator, as it would from gunicorn's write, and ``close()`` is
    called the same way.

    Source: RFC 9112 §7.1 (chunked transfer coding); gunicorn's ``Response.is_chunked``.
    """

    __slots__ = ("_events", "close", "_send")

    def __init__(
        self,
        events: Iterator[bytes],
        close: Callable[[], None],
        send: Callable[[bytes], None] | None,
    ) -> None:
        self._events = events
        self.close = close
        self._send = send

    def __iter__(self) -> Iterator[bytes]:
        if self._send is None:
            return self._events
        return self._written()

    def _written(self) -> Iterator[bytes]:
        events, send = self._events, self._send
        for opening in events:
            yield opening  # gunicorn sends the headers (chunked) and this first chunk
            break
        for event in events:
            send(b"%X\r\n%b\r\n" % (len(event), event))


def _direct_send(environ: dict) -> Callable[[bytes], None] | None:
    """Return the connection's ``sendall`` when gunicorn will frame this response as chunks on a
    greenserve worker's socket (HTTP/1.1, a body, no ``Content-Length``), else None."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, StreamSocket) or not sock.http:
        return None
    return sock.sendall if environ.get("SERVER_PROTOCOL") == "HTTP/1.1" else None


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose :class:`StreamBody` gunicorn iterates directly.

    werkzeug wraps a body in two Python-level iterators (its ``ClosingIterator`` and the str-to-bytes
    ``iter_encoded``) that cost a few percent of a token's time and do nothing for a body of bytes;
    and after the first event the events are written to the socket directly (:class:`_Events`).
    ``close()`` still goes through ``Response.close``: the body's own close, then the
    ``call_on_close`` callbacks (the request's span and log line).
    """

    def __init__(self, body: StreamBody) -> None:
        super().__init__(body, content_type="text/event-stream", headers=STREAM_HEADERS)

    def get_app_iter(self, environ: dict) -> Iterable[bytes]:
        """Return the stream's events, with ``close()`` calling :meth:`Response.close`."""
        if environ["REQUEST_METHOD"] == "HEAD":
            return super().get_app_iter(environ)
        return _Events(iter(self.response), self.close, _direct_send(environ))


def settle(completion: Completion, ticket: Ticket, record: RequestRecord) -> None:
    """End a generation: close its token streams, release its slot, and write its counts, finish
    reasons, queue wait (and, with ``LOG_PROMPTS=1``, texts) on the record, and its ``end_reason``
    when every choice ended on its own (``stop`` if one stopped, else ``finished``). Called at least
    once per admitted request, from the body's ``close()`` or the non-streamed route; a second call
    is harmless."""
    completion.close()
    ticket.release()
    record.completion_tokens = completion.completion_tokens
    record.cached_tokens = completion.cached_tokens
    reasons = record.finish_reasons = completion.finish_reasons()
    if reasons and None not in reasons:
        record.end(STOP if "stop" in reasons else FINISHED)
    if record.queue_wait_s is None:  # the first settle fixes the wait (a second one may follow)
        record.slot_at = ticket.started
        record.queue_wait_s = (ticket.started or time.perf_counter()) - ticket.arrived
    if record.prompt is not None:  # LOG_PROMPTS=1
        record.texts = ["".join(c.parts) for c in completion.choices]
