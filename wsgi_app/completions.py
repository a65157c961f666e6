"""``POST /v1/completions``: validate, generate, answer as JSON or as Server-Sent Events.

Source: OpenAI API reference, "Completions" (legacy); DESIGN §5.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator

from flask import Blueprint, Response, g, request

from wsgi_app import sse
from wsgi_app.choices import Completion
from wsgi_app.errors import ApiError, json_bytes
from wsgi_app.lifecycle import RequestRecord
from wsgi_app.protocol import decode_json_body, parse_completion_request
from wsgi_app.runtime import Cooperator, runtime

log = logging.getLogger("greenserve.completions")
bp = Blueprint("completions", __name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def random_seed() -> int:
    """Return a fresh seed in 0..2**64-1 from the OS (never the global ``random`` state)."""
    return int.from_bytes(os.urandom(8), "little")


def engine_error(exc: BaseException) -> ApiError:
    """Map an exception raised while generating to its OpenAI error (500 engine, 503 memory)."""
    if isinstance(exc, MemoryError):
        return ApiError(
            503,
            "Out of memory while generating; retry later.",
            type="server_error",
            code="unavailable",
        )
    return ApiError(
        500, f"Generation failed: {type(exc).__name__}.", type="server_error", code="engine_error"
    )


def _set_nodelay(environ: dict) -> None:
    sock = environ.get("gunicorn.socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # already closed, or not TCP (a unix socket): nothing to tune
            pass


def _tracker(record: RequestRecord, cooperate: Cooperator):
    """Wrap the hub cooperator so that the first call stamps the request's TTFT."""

    def on_token() -> None:
        if record.ttft_s is None:
            record.ttft_s = time.perf_counter() - record.started
        cooperate()

    return on_token


def _settle(completion: Completion, record: RequestRecord) -> None:
    completion.close()
    record.completion_tokens = completion.completion_tokens
    record.finish_reasons = completion.finish_reasons()


def _events(completion: Completion, record: RequestRecord) -> Iterator[bytes]:
    """The SSE body: opening comment, one event per token, optional usage chunk, ``[DONE]``.

    A failure after the first byte cannot change the status: it becomes an error event before ``[DONE]``.
    A client that goes away makes gunicorn close this generator at its current ``yield``; ``finally``
    then closes the token streams, so generation stops within one token.
    """
    failure: ApiError | None = None
    try:
        yield sse.OPEN
        yield from completion.chunks()
        if completion.req.include_usage:
            yield completion.usage_chunk()
    except Exception as exc:  # noqa: BLE001 - any engine failure must end the stream cleanly
        log.exception("stream %s failed", record.request_id)
        failure = engine_error(exc)
        record.error = failure.message
    finally:
        _settle(completion, record)
    if failure is not None:
        yield sse.data_event(json_bytes(failure.envelope()))
    yield sse.DONE


@bp.post("/v1/completions")
def create_completion() -> Response:
    """Answer one completion request.

    Raises:
        ApiError: 400 for invalid input (naming ``param``), 413 for a body over ``MAX_BODY_BYTES``,
            500 ``engine_error`` / 503 when a non-streamed generation fails.
    """
    rt = runtime()
    record: RequestRecord = g.record
    req = parse_completion_request(
        decode_json_body(request.get_data(cache=False)),
        max_prompt_tokens=rt.settings.max_prompt_tokens,
        max_n=rt.settings.max_n,
    )
    record.prompt_tokens = len(req.prompt_ids)
    record.span.attributes["gen_ai.request.model"] = req.model
    record.span.attributes["gen_ai.request.max_tokens"] = req.max_tokens
    seed = req.seed if req.seed is not None else random_seed()
    completion = Completion(
        rt.engine,
        req,
        seed,
        "cmpl-" + secrets.token_hex(12),
        int(time.time()),
        _tracker(record, Cooperator()),
    )
    if req.stream:
        _set_nodelay(request.environ)
        return Response(
            _events(completion, record), content_type="text/event-stream", headers=STREAM_HEADERS
        )
    try:
        body = completion.run()
    except Exception as exc:
        log.exception("completion %s failed", record.request_id)
        raise engine_error(exc) from exc
    finally:
        _settle(completion, record)
    return Response(body, content_type="application/json")
