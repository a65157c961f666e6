"""``POST /v1/completions``: validate, admit, generate, answer as JSON or as Server-Sent Events.

Stream lifetime (DESIGN §1): the response body owns the generation. Its ``close()`` (called by gunicorn
after the last byte, after a failed write, or on a stalled reader's send timeout) closes the token streams
and releases the slot, whether or not the body was ever iterated. Nothing else frees a slot.

Source: OpenAI API reference, "Completions" (legacy); DESIGN §1, §5 and §7.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator

from flask import Blueprint, Response, g, request

from wsgi_app import sse
from wsgi_app.admission import Ticket
from wsgi_app.body import read_body
from wsgi_app.choices import Completion
from wsgi_app.errors import ApiError, error_response, json_bytes
from wsgi_app.faults import EngineFailure
from wsgi_app.lifecycle import RequestRecord
from wsgi_app.protocol import CompletionRequest, decode_json_body, parse_completion_request
from wsgi_app.runtime import ClientGone, Pacer, Runtime, peer_closed, runtime, unavailable
from wsgi_app.worker import StreamSocket

log = logging.getLogger("greenserve.completions")
bp = Blueprint("completions", __name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def random_seed() -> int:
    """Return a fresh seed in 0..2**64-1 from the OS (never the global ``random`` state)."""
    return int.from_bytes(os.urandom(8), "little")


def engine_error(rt: Runtime, exc: BaseException) -> ApiError:
    """Map an exception raised while generating to its OpenAI error.

    ``ApiError`` (deadline, shutdown) passes through; ``MemoryError`` is a 503 the worker recovers from;
    anything else is a 500 ``engine_error``, and a fatal engine failure also turns readiness off.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MemoryError):
        return unavailable("Out of memory while generating; retry later.")
    if isinstance(exc, EngineFailure) and exc.fatal:
        rt.engine_ok = False
    return ApiError(
        500, f"Generation failed: {type(exc).__name__}.", type="server_error", code="engine_error"
    )


def _client_socket() -> socket.socket | None:
    return request.environ.get("gunicorn.socket")


def _tune_socket(sock: socket.socket | None, send_timeout_s: float) -> None:
    """Send each event at once, and cut a reader that stops reading for ``send_timeout_s``."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A write that waits this long without progress raises; gunicorn then closes the body,
        # freeing the slot. Under another worker class (gunicorn's own gevent worker, TLS) the
        # socket's timeout is all there is: it bounds a whole write, and reads too.
        if isinstance(sock, StreamSocket):
            sock.send_timeout_s = send_timeout_s
        else:
            sock.settimeout(send_timeout_s)
    except OSError:  # already closed, or not TCP: nothing to tune
        pass


def _wait_for_slot(ticket: Ticket, pacer: Pacer, heartbeat_s: float, sock) -> bool:
    """Wait in heartbeat-long slices for a slot; False when the client went away meanwhile.

    Raises:
        ApiError: 504 past the deadline, 503 when the worker is stopping.
    """
    while not ticket.wait(min(heartbeat_s, pacer.deadline - time.perf_counter())):
        pacer.check(time.perf_counter())
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
    """

    def __init__(
        self,
        rt: Runtime,
        completion: Completion,
        ticket: Ticket,
        pacer: Pacer,
        record: RequestRecord,
    ) -> None:
        self._rt = rt
        self._completion = completion
        self._ticket = ticket
        self._pacer = pacer
        self._record = record
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
            while not self._ticket.wait(
                min(self._rt.settings.heartbeat_s, self._pacer.deadline - time.perf_counter())
            ):
                self._pacer.check(time.perf_counter())
                yield sse.QUEUED  # a write: a client that left is noticed here
            yield from self._completion.chunks()
            if self._completion.req.include_usage:
                yield self._completion.usage_chunk()
        except Exception as exc:  # noqa: BLE001 - every failure must end the stream cleanly
            failure = engine_error(self._rt, exc)
            if failure.status >= 500 and failure.code not in ("timeout", "unavailable"):
                log.exception("stream %s failed", self._record.request_id)
            self._record.error = failure.message
        finally:
            _settle(self._completion, self._ticket, self._record)
        if failure is not None:
            yield sse.data_event(json_bytes(failure.envelope()))
        yield self._completion.framing.done()

    def close(self) -> None:
        """Stop generation, release the slot, record the counts; idempotent."""
        try:
            self._events.close()  # a suspended stream: its ``finally`` runs now, not at GC
        finally:
            _settle(self._completion, self._ticket, self._record)


class _Events:
    """The WSGI body of an :class:`EventStreamResponse`: iterating it is iterating the stream's generator."""

    __slots__ = ("_events", "close")

    def __init__(self, events: Iterator[bytes], close: Callable[[], None]) -> None:
        self._events = events
        self.close = close

    def __iter__(self) -> Iterator[bytes]:
        return self._events


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose :class:`StreamBody` gunicorn iterates directly.

    werkzeug wraps a body in two Python-level iterators (its ``ClosingIterator`` and the str-to-bytes
    ``iter_encoded``) that cost a few percent of a token's time and do nothing for a body of bytes.
    ``close()`` still goes through ``Response.close``: the body's own close, then the
    ``call_on_close`` callbacks (the request's span and log line).
    """

    def __init__(self, body: StreamBody) -> None:
        super().__init__(body, content_type="text/event-stream", headers=STREAM_HEADERS)

    def get_app_iter(self, environ: dict) -> Iterable[bytes]:
        """Return the stream's events, with ``close()`` calling :meth:`Response.close`."""
        if environ["REQUEST_METHOD"] == "HEAD":
            return super().get_app_iter(environ)
        return _Events(iter(self.response), self.close)


def _settle(completion: Completion, ticket: Ticket, record: RequestRecord) -> None:
    completion.close()
    ticket.release()
    record.completion_tokens = completion.completion_tokens
    record.finish_reasons = completion.finish_reasons()
    if record.queue_wait_s is None:  # the first settle fixes the wait (a second one may follow)
        record.slot_at = ticket.started
        record.queue_wait_s = (ticket.started or time.perf_counter()) - ticket.arrived
    if record.prompt is not None:  # LOG_PROMPTS=1
        record.texts = ["".join(c.parts) for c in completion.choices]


@bp.post("/v1/completions")
def create_completion() -> Response:
    """Answer one completion request.

    Raises:
        ApiError: 400 for invalid input (naming ``param``), 413 for a body over ``MAX_BODY_BYTES``,
            429 ``server_busy`` when slots and queue are full, 503 when stopping or out of memory,
            504 when the deadline passes before the answer, 500 ``engine_error``.
    """
    rt = runtime()
    settings = rt.settings
    record: RequestRecord = g.record
    req = parse_completion_request(
        decode_json_body(
            read_body(
                request.environ,
                settings.max_body_bytes,
                record.started + settings.request_timeout_s - time.perf_counter(),
            )
        ),
        **rt.parse_limits,
    )
    seed = req.seed if req.seed is not None else random_seed()
    completion, ticket, pacer = admit(rt, req, record, seed)
    if req.stream:
        body = StreamBody(rt, completion, ticket, pacer, record)
        return EventStreamResponse(body)
    sock = _client_socket()
    try:
        if not _wait_for_slot(ticket, pacer, settings.heartbeat_s, sock):
            return _gone(record, "client disconnected while queued")
        pacer.peer = sock  # no write until the end: look for a vanished client while generating
        answer = completion.run()
    except ClientGone:
        return _gone(record, "client disconnected while generating")
    except ApiError:
        raise
    except Exception as exc:
        err = engine_error(rt, exc)
        if err.status == 500:
            log.exception("completion %s failed", record.request_id)
        raise err from exc
    finally:
        _settle(completion, ticket, record)
    return Response(answer, content_type="application/json")


def _gone(record: RequestRecord, why: str) -> Response:
    """Answer a request whose client left: nobody reads it, the 499 is for the log and the span."""
    record.error = why
    return error_response(ApiError(499, "Client closed the connection.", code="client_closed"))


def admit(
    rt: Runtime,
    req: CompletionRequest,
    record: RequestRecord,
    seed: int,
    framing: sse.Framing = sse.PLAIN,
) -> tuple[Completion, Ticket, Pacer]:
    """Take a place in the worker's slots or queue for ``req`` and set up its generation.

    The caller owns the returned ticket: a :class:`StreamBody` or ``_settle`` must release it.

    Args:
        rt: the worker's runtime.
        req: the validated request.
        record: the request's record (counts and span attributes are stamped on it).
        seed: the effective seed, 0..2**64-1.
        framing: the SSE framing of a streamed answer.

    Raises:
        ApiError: 400 when the request's KV cache could never fit the budget, 429 ``server_busy`` when
            slots and queue are full, 503 when the worker is stopping.
    """
    settings = rt.settings
    record.prompt_tokens = len(req.prompt_ids)
    record.model = req.model
    if settings.log_prompts:
        record.prompt = req.prompt_text
    record.span.attributes["gen_ai.request.model"] = req.model
    record.span.attributes["gen_ai.request.max_tokens"] = req.max_tokens
    # A worker that is stopping still serves what reaches it during the grace period (a reload's old
    # workers accept for a moment after SIGTERM); only past the stop time is it too late.
    if rt.stop_at is not None and time.perf_counter() >= rt.stop_at:
        raise unavailable("Server is shutting down.")
    deadline = record.started + settings.request_timeout_s
    kv_bytes = rt.model.kv_reservation_bytes(len(req.prompt_ids), req.max_tokens, req.n)
    ticket = rt.admission.admit(record.request_id, deadline, kv_bytes)
    _tune_socket(_client_socket(), settings.send_timeout_s)
    pacer = Pacer.make(rt, record, deadline)
    try:
        completion = Completion(
            rt.engine,
            req,
            seed,
            "cmpl-" + secrets.token_hex(12),
            int(time.time()),
            pacer,
            framing,
            on_tick=pacer.tick,
            heartbeat_s=settings.heartbeat_s,
            tokenizer=rt.model.tokenizer,
        )
    except BaseException:
        ticket.release()
        raise
    ticket.progress = completion
    record.span.attributes["gen_ai.request.seed"] = str(seed)
    return completion, ticket, pacer
