"""``GET /v1/completions?…``: the stream for browsers' ``EventSource`` (docs/ARCHITECTURE.md §8).

``EventSource`` can only GET and cannot send headers (besides ``Last-Event-ID``), so the request is the
query string: ``wsgi_app.http.query`` converts each parameter by its field's type, and the result is
validated exactly like a POST body (``wsgi_app.api.completions.parse_completion_request``). The
answer is always a stream, framed by :class:`~wsgi_app.wire.sse.EventIds`: ``retry:``,
``id: <seed>-<index>`` on every data event, ``[DONE]`` with ``id: <seed>-done``. A reconnect sends
``Last-Event-ID``: the same seed regenerates the same stream, which resumes after that event, or the
request gets a ``204`` (which stops the browser) when it names ``done``. The completion ``id`` is a
hash of the seed and the request, so a resumed stream carries the same one.

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

import hashlib
import json
import re
from typing import Any

from flask import Blueprint, Response, g, request

from wsgi_app.api.completions import CompletionRequest, parse_completion_request
from wsgi_app.api.errors import invalid
from wsgi_app.api.fields import SEED_LIMIT
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.start import admit, random_seed
from wsgi_app.http.auth import cache_salt
from wsgi_app.http.query import check_query_utf8, query_body
from wsgi_app.http.runtime import Runtime, runtime
from wsgi_app.http.stream_body import STREAM_HEADERS, EventStreamResponse, StreamBody
from wsgi_app.wire.encoder import TEXT_COMPLETION, WireFormat
from wsgi_app.wire.sse import EventIds

bp = Blueprint("eventsource", __name__)

RETRY_MS = 3000  # EventSource's reconnection delay after a dropped stream, in milliseconds
_EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,10}|done)")


def parse_last_event_id(value: str | None) -> tuple[int, int | None] | None:
    """Parse ``Last-Event-ID`` into ``(seed, index)``; ``index`` is None for the ``done`` event.

    Returns:
        None when the header is absent or empty (a fresh stream).

    Raises:
        ApiError: 400 when it is not an id this server sent (``<seed>-<index>`` or ``<seed>-done``).
    """
    if not value:
        return None
    match = _EVENT_ID.fullmatch(value.strip())
    if match is None or int(match.group(1)) >= SEED_LIMIT:
        raise invalid(
            "'Last-Event-ID' must be an event id of this stream: <seed>-<index> or <seed>-done.",
            "Last-Event-ID",
        )
    index = match.group(2)
    return int(match.group(1)), None if index == "done" else int(index)


def stream_id(seed: int, body: dict[str, Any], prefix: str = "cmpl-") -> str:
    """Return the completion id of the stream of ``body`` with ``seed``: ``prefix`` and 24 hex digits
    of a hash of both.

    A reconnect knows exactly these two (the same URL, the seed in ``Last-Event-ID``), so the events of
    a resumed stream carry the id of the stream they continue.

    Args:
        seed: the effective seed, 0..2**64-1.
        body: the request as :func:`query_body` made it (``api_key`` is not in it).
    """
    key = json.dumps([seed, body], sort_keys=True, ensure_ascii=False).encode()
    return prefix + hashlib.blake2b(key, digest_size=12).hexdigest()


def no_content() -> Response:
    """Return an empty ``204`` (without the default ``Content-Type`` of a body it does not have)."""
    response = Response(status=204)
    del response.headers["Content-Type"]
    return response


def wants_event_stream() -> bool:
    """True when the client named ``text/event-stream`` in ``Accept`` (as ``EventSource`` does)."""
    return any(mime == "text/event-stream" and q > 0 for mime, q in request.accept_mimetypes)


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
    req = parse_completion_request(body, **rt.parse_limits)
    return event_stream(rt, req, g.record, body)


def check_event_source(path: str) -> None:
    """Refuse an ``EventSource`` request without ``Accept: text/event-stream`` or whose query string
    is not UTF-8.

    Raises:
        ApiError: 400 (the query parameter named, for bad UTF-8).
    """
    if not wants_event_stream():
        raise invalid(
            f"GET {path} is the EventSource stream: send 'Accept: text/event-stream', "
            "or POST a JSON body for a JSON answer.",
            None,
        )
    check_query_utf8(request.environ.get("QUERY_STRING", ""))


def event_stream(
    rt: Runtime,
    req: CompletionRequest,
    record: RequestRecord,
    body: dict[str, Any],
    wire: WireFormat = TEXT_COMPLETION,
) -> Response:
    """Stream ``req`` to an ``EventSource`` in ``wire``'s format, resuming after ``Last-Event-ID``.

    ``body`` is the request as the query string gave it: with the seed it names the completion id,
    so a resumed stream continues the same completion (:func:`stream_id`).

    Raises:
        ApiError: 400 for a malformed ``Last-Event-ID`` or one whose seed contradicts ``seed``;
            429 ``server_busy``; 503 when stopping.
    """
    last = parse_last_event_id(request.headers.get("Last-Event-ID"))
    if last is not None and req.seed is not None and last[0] != req.seed:
        raise invalid("'Last-Event-ID' names another seed than 'seed'.", "Last-Event-ID")
    if last is not None and last[1] is None:
        return no_content()  # the stream had ended: 204 tells EventSource to stop
    if req.seed is not None:
        seed = req.seed
    else:
        seed = last[0] if last is not None else random_seed()
    if request.method == "HEAD":  # headers only: no generation for a body nobody gets
        return Response(content_type="text/event-stream", headers=STREAM_HEADERS)
    framing = EventIds(seed, RETRY_MS, resume_after=-1 if last is None else last[1])
    sock = request.environ.get("gunicorn.socket")
    completion_id = stream_id(seed, body, wire.id_prefix)
    completion, ticket, pacer = admit(
        rt,
        req,
        record,
        seed,
        sock,
        framing,
        wire,
        completion_id=completion_id,
        cache_salt=cache_salt(req.cache_salt),
    )
    return EventStreamResponse(StreamBody(rt, completion, ticket, pacer, record, sock))
