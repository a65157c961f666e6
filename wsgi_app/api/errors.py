"""The OpenAI error envelope for every failure, and the compact JSON encoding of every answer (no Flask here).

Source: OpenAI API reference, "Error codes"; docs/ARCHITECTURE.md §8 (JSON bytes, error types).
"""

from __future__ import annotations

import json
from typing import Any

# json.dumps with non-default arguments makes an encoder per call; this one, made once, encodes the
# same text (json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)

MAX_NAME_CHARS = 256
MAX_MESSAGE_CHARS = 4096
MAX_PARAM_CHARS = 512


def printable(text: str) -> str:
    """Return ``text`` with each lone surrogate (which no UTF-8 answer can carry) as ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def quote_name(name: Any) -> str:
    """Return a client-sent name (an unknown key, a role) fit to quote in an error's message/param.

    Lone surrogates are escaped and a name over :data:`MAX_NAME_CHARS` characters is cut there,
    ending with an ellipsis, so an error never echoes a huge key back (twice).
    """
    return _shorten(printable(str(name)), MAX_NAME_CHARS)


def json_bytes(obj: Any) -> bytes:
    """Encode ``obj`` as compact UTF-8 JSON, non-ASCII unescaped, no trailing newline.

    Control characters are still escaped by the encoder, so a generated newline or NUL never breaks an SSE
    frame. ``allow_nan=False`` makes a stray NaN a bug we see, not invalid JSON a client sees.

    Raises:
        ValueError: ``obj`` holds a NaN or an infinity.
        TypeError: ``obj`` holds something JSON cannot encode.
    """
    return _ENCODER.encode(obj).encode()


class ApiError(Exception):
    """A failure that is answered with the OpenAI error envelope.

    Args:
        status: HTTP status code.
        message: human-readable explanation.
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the request field at fault, or None.
        code: machine-readable code, e.g. ``rate_limit_exceeded``, or None.
        headers: extra response headers (``Retry-After``, ``Allow``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the wire name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Every error can be encoded and stays small whatever client text it quotes.
        message = _shorten(printable(message), MAX_MESSAGE_CHARS)
        param = None if param is None else _shorten(printable(param), MAX_PARAM_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        """Return ``{"error": {"message", "type", "param", "code"}}`` in that key order."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None) -> ApiError:
    """Return a 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, param=param)


def error_body(err: ApiError) -> bytes:
    """Return ``err``'s envelope as the JSON bytes of an answer or of a stream's error event."""
    return json_bytes(err.envelope())


def timeout_error(limit_s: float) -> ApiError:
    """The 504 of a request whose deadline (``REQUEST_TIMEOUT_S``) passed."""
    return ApiError(
        504, f"Request timed out after {limit_s:g} s.", type="server_error", code="timeout"
    )


def unavailable(message: str) -> ApiError:
    """A 503 ``unavailable`` (draining, shutting down, not ready, out of memory)."""
    return ApiError(503, message, type="server_error", code="unavailable")
