"""Parse and format the W3C Trace Context ``traceparent`` header.

Source: W3C Trace Context Level 1, §3.2 "Traceparent Header" (https://www.w3.org/TR/trace-context/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["TraceContext", "format_traceparent", "new_span_id", "new_trace_id", "parse"]

_LOWER_HEX = frozenset("0123456789abcdef")
# version(2) "-" trace-id(32) "-" parent-id(16) "-" trace-flags(2)
_V00_LEN = 55
_INVALID_VERSION = "ff"
# HTTP allows optional whitespace (SP / HTAB) around a field value (RFC 9110 §5.5).
_OWS = " \t"


@dataclass(frozen=True, slots=True)
class TraceContext:
    """Hold the caller's trace position as carried by ``traceparent``.

    Attributes:
        trace_id: 32 lower-case hex characters (16 bytes), not all zero.
        span_id: 16 lower-case hex characters (8 bytes), not all zero; the caller's span.
        flags: trace-flags byte, 0..255 (bit 0 = sampled).
    """

    trace_id: str
    span_id: str
    flags: int


def _is_lower_hex(text: str, length: int) -> bool:
    return len(text) == length and all(ch in _LOWER_HEX for ch in text)


def _is_zero(text: str) -> bool:
    return text.count("0") == len(text)


def parse(value: str | None) -> TraceContext | None:
    """Parse a ``traceparent`` header value into a TraceContext.

    Version ``00`` must be exactly ``00-<trace-id>-<parent-id>-<flags>``. A higher version is parsed
    by its first four fields as the spec asks, provided the flags are followed by the end of the
    value or by ``-``. Spaces and tabs around the value are ignored.

    Args:
        value: the raw header value, or None when the header is absent.

    Returns:
        The parsed context, or None when the value is absent or invalid (upper-case hex, wrong
        lengths, all-zero trace id or parent id, version ``ff``, extra fields on version ``00``).
        Never raises.

    Source: W3C Trace Context Level 1, §3.2.2 (header format) and §3.2.4 (versioning of
    traceparent).
    """
    if not isinstance(value, str):
        return None
    value = value.strip(_OWS)
    if len(value) < _V00_LEN:
        return None
    version = value[0:2]
    if not _is_lower_hex(version, 2) or version == _INVALID_VERSION:
        return None
    if version == "00" and len(value) != _V00_LEN:
        return None
    if len(value) > _V00_LEN and value[_V00_LEN] != "-":
        return None
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    trace_id, span_id, flags = value[3:35], value[36:52], value[53:55]
    if not (_is_lower_hex(trace_id, 32) and _is_lower_hex(span_id, 16) and _is_lower_hex(flags, 2)):
        return None
    if _is_zero(trace_id) or _is_zero(span_id):
        return None
    return TraceContext(trace_id=trace_id, span_id=span_id, flags=int(flags, 16))


def _random_hex(n_bytes: int) -> str:
    while True:
        raw = os.urandom(n_bytes)
        # An all-zero id is invalid; the retry happens with probability 2**-64 or less.
        if any(raw):
            return raw.hex()


def new_trace_id() -> str:
    """Return a random non-zero trace id: 32 lower-case hex characters (16 bytes from os.urandom).

    Source: W3C Trace Context Level 1, §3.2.2.3 (trace-id).
    """
    return _random_hex(16)


def new_span_id() -> str:
    """Return a random non-zero span id: 16 lower-case hex characters (8 bytes from os.urandom).

    Source: W3C Trace Context Level 1, §3.2.2.4 (parent-id).
    """
    return _random_hex(8)


def format_traceparent(ctx: TraceContext) -> str:
    """Format a context as a version ``00`` ``traceparent`` value.

    Args:
        ctx: the context to propagate; ``flags`` is truncated to one byte.

    Returns:
        ``00-<trace_id>-<span_id>-<flags as 2 lower hex>``, 55 characters.

    Source: W3C Trace Context Level 1, §3.2.2.
    """
    return f"00-{ctx.trace_id}-{ctx.span_id}-{ctx.flags & 0xFF:02x}"
