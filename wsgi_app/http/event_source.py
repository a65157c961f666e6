"""The ``EventSource`` side of the ``GET`` streams (``GET /v1/completions``, ``GET
/v1/chat/completions``; docs/ARCHITECTURE.md §8): who may ask for one, and how a reconnect resumes.

``EventSource`` can only GET and cannot send headers (besides ``Last-Event-ID``), so the request is the
query string. The answer is always a stream, framed by :class:`~wsgi_app.wire.sse.EventIds`:
``retry:``, ``id: <seed>-<index>`` on every data event, ``[DONE]`` with ``id: <seed>-done``. A
reconnect sends ``Last-Event-ID``: the same seed regenerates the same stream, which resumes after that
event, or the request gets a ``204`` (which stops the browser) when it names ``done``. The completion
``id`` is a hash of the seed and the request, so a resumed stream carries the same one.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events"; docs/ARCHITECTURE.md §8.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from flask import Response, request

from wsgi_app.api.errors import invalid
from wsgi_app.api.fields import SEED_LIMIT
from wsgi_app.http.query import check_query_utf8

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
        body: the request as its query string gave it (``api_key`` is not in it).
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


def check_event_source(path: str) -> None:
    """Refuse an ``EventSource`` request without ``Accept: text/event-stream`` or whose query string
    is not UTF-8.

    Args:
        path: the route's path, for the message.

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
