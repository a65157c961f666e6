"""The lifetime of one generation: admitted to a slot or the queue (:func:`admit`), waiting for its
slot, generating (streamed or not), settled. Shared by every route that generates.

Stream lifetime (docs/ARCHITECTURE.md §9): the response body owns the generation. A streamed answer's
body is the :class:`Generation` itself; its ``close()`` (called by gunicorn after the last byte, after
a failed write, or on a stalled reader's send timeout) closes the token streams and releases the
slot, whether or not the body was ever iterated. A JSON answer settles in :meth:`Generation.run`.
Nothing else frees a slot. The generation also names why it ended (``RequestRecord.end_reason``):
itself on a natural end or a failure, the pacer on a deadline, else the connection's mark
(``wsgi_app.server.stream_socket.StreamSocket.end_reason``: the send timeout, the worker stopping), else the
client left.

Source: OpenAI API reference, "Error codes"; WHATWG HTML Living Standard, §9.2 "Server-sent events".
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Generator, Iterator
from itertools import chain

from model.engine import GrammarSource
from wsgi_app.api.errors import ApiError, invalid, unavailable
from wsgi_app.generation.admission import Ticket
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.context import GenerationContext
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.pacer import ClientGone, Pacer
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.shadow import Mirror
from wsgi_app.server.connection import peer_closed, tune_socket
from wsgi_app.server.end_reason import CLIENT_LEFT, ENGINE_ERROR, FINISHED, STOP
from wsgi_app.wire import sse
from wsgi_app.wire.encoder import TEXT_COMPLETION, WireFormat
from wsgi_app.wire.sse import PLAIN, Framing

log = logging.getLogger("greenserve.completions")


def random_seed() -> int:
    """Return a fresh seed in 0..2**64-1 from the OS (never the global ``random`` state)."""
    return int.from_bytes(os.urandom(8), "little")


def engine_error(exc: BaseException) -> ApiError:
    """Map an exception raised while generating to its OpenAI error.

    ``ApiError`` (deadline, shutdown) passes through; ``MemoryError`` is a 503 the worker recovers from;
    anything else is a 500 ``engine_error``. Readiness is not decided here: the engine says whether
    the failure was its own (``model.engine.Engine.failed``, read by ``GenerationContext.engine_ok``).

    Source: OpenAI API reference, "Error codes" (500 server error, 503 overloaded).
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MemoryError):
        return unavailable("Out of memory while generating; retry later.")
    return ApiError(
        500, f"Generation failed: {type(exc).__name__}.", type="server_error", code="engine_error"
    )


def _refuse_infeasible(ctx: GenerationContext, max_tokens: int) -> None:
    """Refuse a request whose ``max_tokens`` cannot be generated before its deadline.

    Even at the best decode pace the operator set (``DECODE_TOKENS_PER_S``; unset, nothing is
    refused) such a request would run until ``REQUEST_TIMEOUT_S`` and end in a 504 (or a stream's
    error event) after a minute of work; it is a 400 before any instead. Every worker decides the
    same request the same way.

    Raises:
        ApiError: 400 naming ``max_tokens``, with the pace and the most that fits.
    """
    most = ctx.feasible_max_tokens
    if most is None or max_tokens <= most:
        return
    raise invalid(
        f"'max_tokens' {max_tokens} cannot finish within this server's deadline of "
        f"{ctx.settings.request_timeout_s:g} s (REQUEST_TIMEOUT_S): a choice decodes at most "
        f"~{ctx.decode_tokens_per_s:.1f} tokens/s here, so at most {most} tokens fit. "
        "Lower 'max_tokens' (or ask the operator to raise REQUEST_TIMEOUT_S).",
        "max_tokens",
    )


def admit(
    ctx: GenerationContext,
    req: GenerationInput,
    record: RequestRecord,
    seed: int,
    sock: socket.socket | None,
    framing: Framing = PLAIN,
    wire: WireFormat = TEXT_COMPLETION,
    completion_id: str | None = None,
    cache_salt: str = "",
    grammar: GrammarSource | None = None,
    mirror: Mirror | None = None,
) -> Generation:
    """Take a place in the worker's slots or queue for ``req`` and set up its generation.

    The caller owns the returned generation: its ``close()`` (a streamed answer's body) or its
    :meth:`~Generation.run` (a JSON answer) ends it and releases the ticket.

    Args:
        ctx: what the worker's generations run with.
        req: the request's generation input.
        record: the request's record (counts and span attributes are stamped on it).
        seed: the effective seed, 0..2**64-1.
        sock: the client's connection (tuned for streaming), or None.
        framing: the SSE framing of a streamed answer.
        wire: the wire format of the answer (``TEXT_COMPLETION``, the chat completion's).
        completion_id: the answer's id; None for a fresh random one.
        cache_salt: the prefix-cache salt of its choices (``wsgi_app.http.auth.cache_salt``).
        grammar: the request's compiled output constraint (``GrammarService.prepare``), or None.
        mirror: the shadow variants that mirror the request once it is answered in full
            (``wsgi_app.generation.shadow``), or None: its choices' token ids are kept for them.

    Raises:
        ApiError: 400 when the request's KV cache could never fit the budget, 429 ``server_busy`` when
            slots and queue are full, 503 when the worker is stopping.
    """
    settings = ctx.settings
    record.prompt_tokens = req.prompt_tokens
    record.model = req.model
    record.ignored_fields = req.ignored_fields
    if settings.log_prompts:
        record.prompt = req.prompt_text
    record.span.attributes["gen_ai.request.model"] = req.model
    record.span.attributes["gen_ai.request.max_tokens"] = req.max_tokens
    # A worker that is stopping still serves what reaches it during the grace period (a reload's old
    # workers accept for a moment after SIGTERM); only past the stop time is it too late.
    if ctx.stop.passed(time.perf_counter()):
        raise unavailable("Server is shutting down.")
    deadline = record.started + settings.request_timeout_s
    if req.max_tokens_asked:  # a chat answer's default is a cap, not what the client needs
        _refuse_infeasible(ctx, req.max_tokens)
    # Every prompt of a batch runs its n choices at once: the reservation is their sum.
    kv_bytes = sum(
        ctx.model.kv_reservation_bytes(len(p.ids), req.max_tokens, req.n) for p in req.prompts
    )
    ticket = ctx.admission.admit(record.request_id, deadline, kv_bytes)
    if req.max_tokens_asked:
        ticket.latest_start = ctx.latest_start(deadline, req.max_tokens)
    tune_socket(sock, settings.send_timeout_s)
    pacer = Pacer.make(record, deadline, ctx.stop, ctx.admission, settings.request_timeout_s)
    try:
        completion = Completion(
            ctx.engine,
            req,
            seed,
            completion_id or wire.new_id(),
            int(time.time()),
            pacer,
            framing,
            heartbeat_s=settings.heartbeat_s,
            tokenizer=ctx.model.tokenizer,
            wire=wire,
            fingerprint=ctx.model_version,
            cache_salt=cache_salt,
            grammar=grammar,
            trace=mirror is not None,
        )
    except BaseException:
        ticket.release()
        raise
    ticket.progress = completion
    record.span.attributes["gen_ai.request.seed"] = str(seed)
    return Generation(completion, ticket, pacer, record, sock, mirror)


def queue_heartbeats(ticket: Ticket, pacer: Pacer, heartbeat_s: float) -> Iterator[None]:
    """Wait for ``ticket``'s slot in heartbeat-long slices, yielding after each slice without one
    (the caller writes a heartbeat or looks for a client that left).

    A wait ends early at the deadline or the worker's stop time, or when the stop wakes the queue
    (``Admission.wake_queued``); the clock decides what follows, so a wake a moment before the stop
    time waits out that moment rather than sending a heartbeat. A slot granted past the stop time (a
    running stream ended by the stop freed it) starts nothing: the request ends as the stop says. A
    request still queued at its ``latest_start`` (its deadline unreachable at the operator's pace,
    ``DECODE_TOKENS_PER_S``) leaves the queue then, as a 504, instead of holding its place until
    the deadline.

    Raises:
        ApiError: 504 past the deadline or the latest start, 503 when the worker is stopping.
    """
    beat_at = time.perf_counter() + heartbeat_s
    latest = ticket.latest_start
    while True:
        now = time.perf_counter()
        wait_s = min(beat_at - now, pacer.time_left_s(now))
        if latest is not None:
            wait_s = min(wait_s, latest - now)
        if ticket.wait(wait_s):
            pacer.check(time.perf_counter())
            return
        now = time.perf_counter()
        pacer.check(now)
        if latest is not None and now >= latest:
            pacer.unreachable()
        if now >= beat_at:
            beat_at = now + heartbeat_s
            yield


class Generation:
    """One admitted request's generation, from :func:`admit` to :meth:`close`: the typed home of
    what it holds, and the one place that ends it.

    Streamed, it is the response body: iterating it gives the SSE events (``: ok`` at once, so the
    headers leave before the first token; ``: queued`` while waiting for a slot and ``: ping`` while
    the prompt is read, every ``WAITING_HEARTBEAT_S`` (writes: a client that left is found by one
    that fails, and its work stops); one ``data:`` event per token; the usage chunk if asked for;
    ``[DONE]``), and gunicorn's ``close()`` ends it. A failure after the first byte cannot change the
    status: it becomes an error event before ``[DONE]`` (the wire format's: the Messages stream's
    is an ``event: error`` and no ``[DONE]``, ``ChunkEncoder.end_events``). The completion's
    framing decides the opening bytes and the event ids (``retry:`` and ``id:`` on the
    ``EventSource`` stream). Not streamed, :meth:`run` generates the JSON answer and ends it.

    Attributes:
        completion: the ``n`` choices and their token loop.
        ticket: its place in the slots or the queue (released by :meth:`settle`).
        pacer: its pacer.
        record: the request's record.
        sock: the client's connection (``environ["gunicorn.socket"]``), or None: :meth:`close`
            reads its ``end_reason`` mark.
        mirror: the request's shadow variants (handed its choices' token ids by the first
            :meth:`settle` if every choice ended on its own), or None.
    """

    __slots__ = ("completion", "ticket", "pacer", "record", "sock", "mirror", "_events")

    def __init__(
        self,
        completion: Completion,
        ticket: Ticket,
        pacer: Pacer,
        record: RequestRecord,
        sock: socket.socket | None = None,
        mirror: Mirror | None = None,
    ) -> None:
        self.completion = completion
        self.ticket = ticket
        self.pacer = pacer
        self.record = record
        self.sock = sock
        self.mirror = mirror
        # Made on first iteration: a JSON answer's generation holds no generator (whose frame would
        # refer back to it, a cycle keeping the choices alive until the collector runs).
        self._events: Generator[bytes, None, None] | None = None

    def __iter__(self) -> Iterator[bytes]:
        # The generator itself: the server's next() then skips a Python-level __next__ per event.
        # close() still reaches this object (werkzeug closes the body it was given).
        if self._events is None:
            self._events = self._stream()
        return self._events

    def __next__(self) -> bytes:
        return next(iter(self))

    def _stream(self) -> Generator[bytes, None, None]:
        completion, record = self.completion, self.record
        failure: ApiError | None = None
        try:
            yield completion.framing.opening()
            self.pacer.start_stream(self.sock)  # a closed end seen on a tick is written to at once
            for _ in queue_heartbeats(self.ticket, self.pacer, completion.waiting_heartbeat_s):
                yield sse.QUEUED  # a write: a client that left is noticed here
            yield from completion.chunks()
            if completion.req.include_usage:
                yield completion.usage_chunk()
        except ClientGone as exc:  # its prompt's scoring saw it leave: nobody reads the rest
            record.end(CLIENT_LEFT)
            record.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure must end the stream cleanly
            failure = engine_error(exc)
            record.end(ENGINE_ERROR)  # unless the pacer named it (deadline, shutdown)
            if failure.status >= 500 and failure.code not in ("timeout", "unavailable"):
                log.exception("stream %s failed", record.request_id)
            record.error = failure.message
        finally:
            self.settle()
        end = completion.end_events(failure)
        if end:  # an empty event would be the chunked body's last chunk
            yield end

    def run(self) -> list[bytes]:
        """Generate the JSON answer: wait for the slot (looking for a client that left meanwhile,
        and once more when the slot comes), generate every choice to its end (looking again every
        ``PEER_CHECK_S``), and settle. A client whose end closed counts as gone, a half-close
        (``SHUT_WR``) too: nothing can be written to it before the answer (docs/ARCHITECTURE.md §9).

        Returns:
            The answer's byte strings (``ChunkEncoder.answer``).

        Raises:
            ClientGone: the client left (the record names it, ``client_left``, and why); nobody
                reads the answer, the caller's 499 is for the log and the span.
            ApiError: 504 past the deadline, 503 when stopping or out of memory, 500
                ``engine_error``.
        """
        record = self.record
        try:
            # No byte can be written before the answer: a client whose end closed (its FIN, a
            # half-close included) is gone, as nginx's proxy takes it. Looked for every waiting
            # heartbeat in the queue, and once more when the slot comes, before any work.
            waits = queue_heartbeats(self.ticket, self.pacer, self.completion.waiting_heartbeat_s)
            for _ in chain(waits, [None]):
                if peer_closed(self.sock):
                    raise ClientGone("client disconnected while queued")
            self.pacer.peer = self.sock  # no write until the end: look for a vanished client
            return self.completion.run()
        except ClientGone as exc:
            record.end(CLIENT_LEFT)
            record.error = str(exc)
            raise
        except ApiError as exc:
            # The pacer's deadline or shutdown (named by it), or a constraint that failed.
            record.end(ENGINE_ERROR)
            record.error = record.error or exc.message
            raise
        except Exception as exc:
            record.end(ENGINE_ERROR)
            err = engine_error(exc)
            if err.status == 500:
                log.exception("completion %s failed", record.request_id)
            raise err from exc
        finally:
            self.settle()

    def settle(self) -> None:
        """End the generation: close its token streams, release its slot, and write its counts,
        finish reasons, tool calls, time to first token, queue wait (and, with ``LOG_PROMPTS=1``,
        texts) on the record, and its ``end_reason`` when every choice ended on its own (``stop`` if
        one stopped: a stop string, its end, its tool calls; else ``finished``); then, for a
        mirrored request answered so, hand its shadows their jobs (queued: they run later, when
        the worker is idle). Runs at least once per admitted request, from :meth:`close` or
        :meth:`run`; a second call is harmless."""
        completion, ticket, record = self.completion, self.ticket, self.record
        completion.close()
        ticket.release()
        record.completion_tokens = completion.completion_tokens
        record.cached_tokens = completion.cached_tokens
        record.tool_calls = completion.tool_calls()
        reasons = record.finish_reasons = completion.finish_reasons()
        if reasons and None not in reasons:  # a choice that ended before max_tokens stopped
            record.end(FINISHED if all(r == "length" for r in reasons) else STOP)
        if self.mirror is not None:  # only the first settle knows how the generation ended
            mirror, self.mirror = self.mirror, None
            if record.end_reason in (FINISHED, STOP) and None not in reasons:
                mirror.submit(completion.traces or [])
        if record.ttft_s is None and record.token_times:
            record.ttft_s = record.token_times[0] - record.started
        if record.queue_wait_s is None:  # the first settle fixes the wait (a second one may follow)
            record.slot_at = ticket.started
            record.queue_wait_s = (ticket.started or time.perf_counter()) - ticket.arrived
        if record.prompt is not None:  # LOG_PROMPTS=1
            record.texts = ["".join(c.parts) for c in completion.choices]

    def close(self) -> None:
        """Stop generating, release the slot, record the counts and why generation ended;
        idempotent.

        A generation that ended on its own or by an error already named its end; one ended here was
        cut from outside: by the send timeout or the worker stopping (the connection's mark), else by
        the client leaving.
        """
        try:
            if self._events is not None:
                self._events.close()  # a suspended stream: its ``finally`` runs now, not at GC
        finally:
            self.settle()
            self.record.end(getattr(self.sock, "end_reason", None) or CLIENT_LEFT)
