"""Server-Sent Events framing for the completion streams.

POST streams carry only ``data:`` events and comment lines; the GET stream for ``EventSource`` adds ``id:``
and ``retry:`` fields. Payloads are compact JSON, which escapes every control byte, so a payload never holds
a CR or LF that could split a frame.

Source: WHATWG HTML Living Standard, §9.2 "Server-sent events" (event stream interpretation).
"""

from __future__ import annotations

# The two ends of a data event: every SSE byte of a stream is written from this module's constants.
DATA = b"data: "
END = b"\n\n"
DONE = DATA + b"[DONE]" + END
# The first bytes of every stream: gunicorn sends the status line and headers only with the first body
# chunk, so an immediate comment lets the client see the headers before the first token.
OPEN = b": ok" + END
PING = b": ping" + END
QUEUED = b": queued" + END


def data_event(payload: bytes, event_id: str | None = None) -> bytes:
    """Frame ``payload`` (one line of JSON, or ``[DONE]``) as one SSE event.

    Args:
        payload: the event data, UTF-8, without CR or LF.
        event_id: the ``id:`` field for ``EventSource`` resumption, or None.

    Returns:
        ``[id: <event_id>\\n]data: <payload>\\n\\n`` as bytes.
    """
    if event_id is None:
        return DATA + payload + END
    return b"id: " + event_id.encode() + b"\n" + DATA + payload + END


def named_event(name: str, payload: bytes) -> bytes:
    """Frame ``payload`` (one line of JSON) as one SSE event of type ``name``:
    ``event: <name>\ndata: <payload>\n\n`` (the Anthropic and the Responses APIs' framing, where
    every event is named after its ``type``)."""
    return b"event: " + name.encode() + b"\n" + DATA + payload + END


def comment(text: str) -> bytes:
    """Return an SSE comment line (ignored by clients; keeps proxies and disconnect detection alive)."""
    return b": " + text.encode() + END


class Framing:
    """Frame the events of a POST stream: ``: ok`` first, then bare ``data:`` events and ``[DONE]``.

    The GET stream swaps in :class:`EventIds`; ``Completion`` and ``Generation`` ask their framing for
    every event, so one streaming loop serves both.

    Attributes:
        fold: ``(before, after)``, the bytes around every payload when each event is framed alike
            (``data: `` and the blank line), so an encoder may fold them into its constant bytes; None
            for a framing whose events differ (ids, dropped events): the encoder calls :meth:`frame`.
    """

    fold: tuple[bytes, bytes] | None = (DATA, END)

    def opening(self) -> bytes:
        """Return the stream's first bytes (sent at once, so the headers leave before a token)."""
        return OPEN

    def frame(self, payload: bytes) -> bytes:
        """Return ``payload`` as one data event; b"" means "generated but not sent" (never written)."""
        return data_event(payload)

    def done(self) -> bytes:
        """Return the final ``[DONE]`` event."""
        return DONE


class EventIds(Framing):
    """Frame the ``EventSource`` stream: ``retry:`` first, ``id: <seed>-<index>`` on every data event,
    ``id: <seed>-done`` on ``[DONE]``, and resumption after the event a reconnect names.

    The stream is a pure function of the request and its seed, so a reconnect regenerates it and this
    framing drops the events up to and including ``resume_after``: no server-side state.

    Args:
        seed: the effective seed, 0..2**64-1 (reported in every id, so every stream can be replayed).
        retry_ms: the reconnection delay the client should use, in milliseconds.
        resume_after: index of the last event the client has, or -1 for a fresh stream.

    Source: WHATWG HTML Living Standard, §9.2 "Server-sent events" (``id``, ``retry``,
    ``Last-Event-ID``); docs/ARCHITECTURE.md §8 (the ``EventSource`` stream).
    """

    fold = None

    def __init__(self, seed: int, retry_ms: int, resume_after: int = -1) -> None:
        self.seed = seed
        self.retry_ms = retry_ms
        self.resume_after = resume_after
        self.next_index = 0

    def opening(self) -> bytes:
        """Return ``retry: <ms>``; a block with no ``data`` dispatches no event in the browser."""
        return b"retry: %d" % self.retry_ms + END

    def frame(self, payload: bytes) -> bytes:
        """Number the event; return b"" for events the client already has."""
        index = self.next_index
        self.next_index += 1
        if index <= self.resume_after:
            return b""
        return data_event(payload, f"{self.seed}-{index}")

    def done(self) -> bytes:
        """Return ``[DONE]`` with ``id: <seed>-done`` (a reconnect naming it gets a 204)."""
        return data_event(b"[DONE]", f"{self.seed}-done")


PLAIN = Framing()
