"""``POST /v1/completions``: validate, admit, generate, answer as JSON or as Server-Sent Events.

A streamed answer is a ``wsgi_app.streaming.StreamBody``, which owns the generation; a JSON answer is
generated here, looking for a client that left meanwhile.

Source: OpenAI API reference, "Completions" (legacy).
"""

from __future__ import annotations

import logging
import time

from flask import Blueprint, Response, g, request

from wsgi_app.body import read_body
from wsgi_app.error_handlers import error_response
from wsgi_app.errors import ApiError
from wsgi_app.generation import admit, engine_error, random_seed
from wsgi_app.pacer import ClientGone
from wsgi_app.protocol import decode_json_body, parse_completion_request
from wsgi_app.record import RequestRecord
from wsgi_app.runtime import runtime
from wsgi_app.streaming import EventStreamResponse, StreamBody, settle, wait_for_slot

log = logging.getLogger("greenserve.completions")
bp = Blueprint("completions", __name__)


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
    sock = request.environ.get("gunicorn.socket")
    completion, ticket, pacer = admit(rt, req, record, seed, sock)
    if req.stream:
        body = StreamBody(rt, completion, ticket, pacer, record)
        return EventStreamResponse(body)
    try:
        if not wait_for_slot(ticket, pacer, settings.heartbeat_s, sock):
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
        settle(completion, ticket, record)
    return Response(answer, content_type="application/json")


def _gone(record: RequestRecord, why: str) -> Response:
    """Answer a request whose client left: nobody reads it, the 499 is for the log and the span."""
    record.error = why
    return error_response(ApiError(499, "Client closed the connection.", code="client_closed"))
