"""``GET /v1/completions?…``: the stream for browsers' ``EventSource`` (docs/ARCHITECTURE.md §8).

``EventSource`` can only GET and cannot send headers (besides ``Last-Event-ID``), so the request is the
query string: ``wsgi_app.http.query`` converts each parameter by its field's type, and the result is
validated exactly like a POST body (``wsgi_app.api.completions.parse_completion_request``). The
answer is always a stream that a reconnect resumes (``wsgi_app.http.event_source``), answered by the
one answer path (``wsgi_app.http.answer``).

Query values: numbers as in JSON (``0.5``, ``1e-3``; not ``nan``, ``inf`` or ``0x1``), booleans as
``true``/``false``, ``stop`` repeatable (up to 4); an empty value for a number or boolean means "absent";
every other parameter may appear once; names and values must be UTF-8 once percent-decoded (as a POST
body must be). An unknown parameter is ignored and named in ``X-Ignored-Fields``, as an unknown body
field is; the body fields a query cannot carry (``logit_bias``, ``stream_options``...) are a 400 saying
to POST them. ``api_key`` is
for the API-key check and is never logged (logs and spans carry the path, not the query).

A GET without ``Accept: text/event-stream`` is a 400: JSON answers come from ``POST``.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events"; docs/ARCHITECTURE.md §8.
"""

from __future__ import annotations

from flask import Blueprint, Response, g, request

from wsgi_app.api.completions import parse_completion_request
from wsgi_app.generation.inputs import generation_input
from wsgi_app.http.answer import answer
from wsgi_app.http.event_source import check_event_source
from wsgi_app.http.query import query_body
from wsgi_app.http.runtime import runtime

bp = Blueprint("eventsource", __name__)


@bp.get("/v1/completions")
def stream_completion() -> Response:
    """Stream a completion to an ``EventSource``.

    Raises:
        ApiError: 400 without ``Accept: text/event-stream``, for an invalid parameter (naming it), for
            a malformed ``Last-Event-ID`` or one whose seed contradicts ``seed``; 429 ``server_busy``;
            503 when stopping.
    """
    rt = runtime()
    check_event_source("/v1/completions")
    body = query_body(request.args)
    served = rt.pick(body, g.record)
    req = parse_completion_request(body, **rt.parse_limits(served))
    return answer(served, generation_input(req), g.record, query=body)
