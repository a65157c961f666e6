"""Server-Sent Events framing for the completion streams.

POST streams carry only ``data:`` events and comment lines; the GET stream for ``EventSource`` adds ``id:``
and ``retry:`` fields. Payloads are compact JSON, which escapes every control byte, so a payload never holds
a CR or LF that could split a frame.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events" (event stream interpretation).
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
# The first bytes of every stream: gunicorn sends the status line and headers only with the first body
# chunk, so an immediate comment lets the client see the headers before the first token.
OPEN = b": ok\n\n"
PING = b": ping\n\n"
QUEUED = b": queued\n\n"


def data_event(payload: bytes, event_id: str | None = None) -> bytes:
    """Frame ``payload`` (one line of JSON, or ``[DONE]``) as one SSE event.

    Args:
        payload: the event data, UTF-8, without CR or LF.
        event_id: the ``id:`` field for ``EventSource`` resumption, or None.

    Returns:
        ``[id: <event_id>\\n]data: <payload>\\n\\n`` as bytes.
    """
    if event_id is None:
        return b"data: " + payload + b"\n\n"
    return b"id: " + event_id.encode() + b"\ndata: " + payload + b"\n\n"


def comment(text: str) -> bytes:
    """Return an SSE comment line (ignored by clients; keeps proxies and disconnect detection alive)."""
    return b": " + text.encode() + b"\n\n"
