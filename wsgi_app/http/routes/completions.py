"""``POST /v1/completions``: validate, admit, generate, answer as JSON or as Server-Sent Events.

The answer, streamed or not, is ``wsgi_app.http.answer``'s (shared with the chat route).

Source: OpenAI API reference, "Completions" (legacy).
"""

from __future__ import annotations

from flask import Blueprint, Response, g

from wsgi_app.api.completions import parse_completion_request
from wsgi_app.generation.inputs import generation_input
from wsgi_app.generation.record import RequestRecord
from wsgi_app.http.answer import answer
from wsgi_app.http.body import json_body
from wsgi_app.http.runtime import runtime

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
    record: RequestRecord = g.record
    body = json_body(rt, record)
    served = rt.pick(body, record)
    req = parse_completion_request(body, **rt.parse_limits(served))
    return answer(served, generation_input(req), record)
