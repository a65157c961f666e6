"""gunicorn's own error answers (a request it cannot parse) in the OpenAI envelope, not as HTML.

Requests whose request line or headers gunicorn refuses never reach the app: gunicorn writes an HTML page
itself (``gunicorn.util.write_error``). :func:`install_json_errors`, called in each worker by
``gunicorn.conf.py``, replaces that writer with one that sends the same status as
``{"error": {...}}``, with ``X-Request-Id`` and ``X-Model-Version`` like every other answer. An unknown
transfer coding (gunicorn's 501) becomes a 400: it is the client's input, and no client input is a 5xx.

Source: RFC 9112 §3 and §5 (request line, field syntax), §6.1 (transfer codings); docs/ARCHITECTURE.md §8.
"""

from __future__ import annotations

import json
import socket
import uuid

from gunicorn import util


def error_bytes(status: int, reason: str, message: str, model_version: str) -> bytes:
    """Return a complete ``Connection: close`` HTTP/1.1 error answer.

    Args:
        status: gunicorn's status for the failure (400, 403, 414, 417, 431, 500, 501).
        reason: gunicorn's reason phrase.
        message: gunicorn's explanation (may quote the client's bytes; JSON-escaped here).
        model_version: the ``X-Model-Version`` value.
    """
    if status == 501:  # an unsupported Transfer-Encoding: the client's input
        status, reason = 400, "Bad Request"
    error = {
        "message": f"{reason}: {message}" if message else reason,
        "type": "server_error" if status >= 500 else "invalid_request_error",
        "param": None,
        "code": None,
    }
    body = json.dumps({"error": error}, separators=(",", ":")).encode()  # ASCII: \\u escapes
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"X-Request-Id: {uuid.uuid4().hex}\r\n"
        f"X-Model-Version: {model_version}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def install_json_errors(model_version: str) -> None:
    """Make this worker's gunicorn answer unparseable requests with JSON (call once per worker)."""

    def write_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
        util.write_nonblock(sock, error_bytes(status_int, reason, mesg, model_version))

    util.write_error = write_error
