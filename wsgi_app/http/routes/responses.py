"""``/v1/responses``: ``POST`` (JSON, or Server-Sent Events with named events), and ``GET`` and
``DELETE`` of a stored response.

A ``POST`` is validated (``wsgi_app.api.responses``), its stored conversation put first and rendered
by the chat's path (``wsgi_app.http.responses``), and answered by the pipeline every generation goes
through (admission, slots, deadlines, streaming: ``wsgi_app.http.answer``) in the Responses wire
format (``wsgi_app.wire.responses``). ``GET`` and ``DELETE`` see only the responses the request's
API key stored (``wsgi_app.http.response_store``).

Source: OpenAI API reference, "Responses" (create, retrieve, delete).
"""

from __future__ import annotations

from flask import Blueprint, Response, g

from wsgi_app.api.responses import parse_responses_request
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.answer import answer
from wsgi_app.http.body import json_body
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.lifecycle import note_user
from wsgi_app.http.responses import (
    not_found,
    owner,
    response_store,
    responses_input,
    store_errors,
)
from wsgi_app.http.runtime import runtime

bp = Blueprint("responses", __name__)

PATH = "/v1/responses"


@bp.post(PATH)
def create_response() -> Response:
    """Answer one Responses request.

    Raises:
        ApiError: 400 for invalid input (naming ``param``), an unknown ``previous_response_id``
            or a conversation too long; 413 for a body over ``MAX_BODY_BYTES``; 429
            ``server_busy``; 503 when stopping or out of memory; 504 past the deadline; 500
            ``engine_error``. After a stream's first byte, a failure is its ``response.failed``.
    """
    rt = runtime()
    record: RequestRecord = g.record
    settings = rt.settings
    body = json_body(rt, record)
    served = rt.pick(body, record)
    req = parse_responses_request(
        body,
        vocab_size=served.model.tokenizer.vocab_size,
        max_items=settings.max_chat_messages,
    )
    note_user(record, settings.client_hash_salt, req.user)
    generation, wire = responses_input(rt, served, record, req)
    return answer(served, generation, record, wire)


@bp.get(f"{PATH}/<response_id>")
def retrieve_response(response_id: str) -> Response:
    """Return a stored response, as it was answered.

    Raises:
        ApiError: 404 when this API key stored no response with this id (or it expired, or was
            evicted or deleted); 503 ``store_unavailable`` when the store cannot be reached.
    """
    with store_errors():
        kept = response_store(runtime()).get(owner(g.record), response_id)
    if kept is None:
        raise not_found(response_id)
    return json_response(kept["response"])


@bp.delete(f"{PATH}/<response_id>")
def delete_response(response_id: str) -> Response:
    """Delete a stored response: ``{"id", "object": "response", "deleted": true}``.

    Raises:
        ApiError: 404 when this API key stored no response with this id; 503
            ``store_unavailable`` when the store cannot be reached.
    """
    with store_errors():
        deleted = response_store(runtime()).delete(owner(g.record), response_id)
    if not deleted:
        raise not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
