"""Setting up a generation: the seed, admission to a slot, the completion and its pacer, and what a
failure while generating is answered with. Shared by every route that generates.

Source: OpenAI API reference, "Error codes".
"""

from __future__ import annotations

import os
import socket
import time

from wsgi_app.api.completions import CompletionRequest
from wsgi_app.api.errors import ApiError, unavailable
from wsgi_app.generation.admission import Ticket
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.faults import EngineFailure
from wsgi_app.generation.pacer import Pacer
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.runtime import Runtime
from wsgi_app.server.connection import tune_socket
from wsgi_app.wire.encoder import TEXT_COMPLETION, WireFormat
from wsgi_app.wire.sse import PLAIN, Framing


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


def admit(
    rt: Runtime,
    req: CompletionRequest,
    record: RequestRecord,
    seed: int,
    sock: socket.socket | None,
    framing: Framing = PLAIN,
    wire: WireFormat = TEXT_COMPLETION,
    completion_id: str | None = None,
    cache_salt: str = "",
) -> tuple[Completion, Ticket, Pacer]:
    """Take a place in the worker's slots or queue for ``req`` and set up its generation.

    The caller owns the returned ticket: a ``wsgi_app.http.stream_body.StreamBody`` or
    ``wsgi_app.http.stream_body.settle`` must release it.

    Args:
        rt: the worker's runtime.
        req: the validated request.
        record: the request's record (counts and span attributes are stamped on it).
        seed: the effective seed, 0..2**64-1.
        sock: the client's connection (tuned for streaming), or None.
        framing: the SSE framing of a streamed answer.
        wire: the wire format of the answer (``TEXT_COMPLETION``, the chat completion's).
        completion_id: the answer's id; None for a fresh random one.
        cache_salt: the prefix-cache salt (``wsgi_app.http.auth.cache_salt``).

    Raises:
        ApiError: 400 when the request's KV cache could never fit the budget, 429 ``server_busy`` when
            slots and queue are full, 503 when the worker is stopping.
    """
    settings = rt.settings
    record.prompt_tokens = req.prompt_tokens
    record.model = req.model
    record.ignored_fields = req.ignored_fields
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
    tune_socket(sock, settings.send_timeout_s)
    pacer = Pacer.make(rt, record, deadline)
    try:
        completion = Completion(
            rt.engine,
            req,
            seed,
            completion_id or wire.new_id(),
            int(time.time()),
            pacer,
            framing,
            heartbeat_s=settings.heartbeat_s,
            tokenizer=rt.model.tokenizer,
            wire=wire,
            fingerprint=rt.model_version,
            cache_salt=cache_salt,
        )
    except BaseException:
        ticket.release()
        raise
    ticket.progress = completion
    record.span.attributes["gen_ai.request.seed"] = str(seed)
    return completion, ticket, pacer
