"""Answer an admitted generation request: a Server-Sent Events stream or one JSON document.

Shared by ``POST /v1/completions`` and ``POST /v1/chat/completions``: a streamed answer is a
``wsgi_app.http.stream_body.StreamBody``, which owns the generation; a JSON answer is generated here, looking
for a client that left meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Response, request

from wsgi_app.api.completions import CompletionRequest
from wsgi_app.api.errors import ApiError
from wsgi_app.api.fields import decode_json_body
from wsgi_app.generation.pacer import ClientGone
from wsgi_app.generation.record import CLIENT_LEFT, ENGINE_ERROR, RequestRecord
from wsgi_app.generation.start import admit, engine_error, random_seed
from wsgi_app.http.auth import cache_salt
from wsgi_app.http.body import read_body
from wsgi_app.http.error_handlers import error_response
from wsgi_app.http.runtime import Runtime
from wsgi_app.http.stream_body import EventStreamResponse, StreamBody, settle, wait_for_slot
from wsgi_app.wire.encoder import TEXT_COMPLETION, WireFormat

log = logging.getLogger("greenserve.completions")


def json_body(rt: Runtime, record: RequestRecord) -> dict[str, Any]:
    """Read and decode the request's JSON object body within the request's deadline.

    Raises:
        ApiError: 413 over ``MAX_BODY_BYTES``, 400 for a body that is not a UTF-8 JSON object.
    """
    settings = rt.settings
    deadline_s = record.started + settings.request_timeout_s - time.perf_counter()
    return decode_json_body(read_body(request.environ, settings.max_body_bytes, deadline_s))


def answer(
    rt: Runtime, req: CompletionRequest, record: RequestRecord, wire: WireFormat = TEXT_COMPLETION
) -> Response:
    """Admit ``req`` and answer it in ``wire``'s format, streamed when ``req.stream``.

    Raises:
        ApiError: 429 ``server_busy`` when slots and queue are full, 503 when stopping or out of
            memory, 504 when the deadline passes before the answer, 500 ``engine_error``.
    """
    seed = req.seed if req.seed is not None else random_seed()
    sock = request.environ.get("gunicorn.socket")
    salt = cache_salt(req.cache_salt)
    completion, ticket, pacer = admit(rt, req, record, seed, sock, wire=wire, cache_salt=salt)
    if req.stream:
        return EventStreamResponse(StreamBody(rt, completion, ticket, pacer, record, sock))
    try:
        if not wait_for_slot(ticket, pacer, rt.settings.heartbeat_s, sock):
            return _gone(record, "client disconnected while queued")
        pacer.peer = sock  # no write until the end: look for a vanished client while generating
        body = completion.run()
    except ClientGone:
        return _gone(record, "client disconnected while generating")
    except ApiError:
        raise  # the pacer's deadline or shutdown, named by it
    except Exception as exc:
        record.end(ENGINE_ERROR)
        err = engine_error(rt, exc)
        if err.status == 500:
            log.exception("completion %s failed", record.request_id)
        raise err from exc
    finally:
        settle(completion, ticket, record)
    return Response(body, content_type="application/json")


def _gone(record: RequestRecord, why: str) -> Response:
    """Answer a request whose client left: nobody reads it, the 499 is for the log and the span."""
    record.end(CLIENT_LEFT)
    record.error = why
    return error_response(ApiError(499, "Client closed the connection.", code="client_closed"))
