"""A test server's JSON log read back: every line parsed, the lines a predicate picks (polled with a
deadline), and a request's access line (``"message": "request"``) by its ``X-Request-Id``."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.server import GunicornServer, wait_until


def log_lines(srv: GunicornServer) -> list[dict]:
    """Every line of the server's log, parsed.

    Raises:
        json.JSONDecodeError: a line is not JSON.
        AssertionError: a line is JSON but not one object.
    """
    lines = []
    for text in srv.log_text().splitlines():
        if text.strip():
            obj = json.loads(text)
            assert isinstance(obj, dict), text
            lines.append(obj)
    return lines


def wait_for(
    srv: GunicornServer, predicate: Callable[[dict], bool], timeout_s: float = 10.0
) -> list[dict]:
    """Poll the log until some lines satisfy ``predicate``; return those lines.

    Raises:
        AssertionError: none did within ``timeout_s`` seconds (the log's tail is shown).
    """
    return wait_until(
        lambda: [line for line in log_lines(srv) if predicate(line)],
        timeout_s,
        lambda: f"a log line; log:\n{srv.log_tail()}",
    )


def request_line(srv: GunicornServer, request_id: str, timeout_s: float = 10.0) -> dict:
    """Wait for the access line of request ``request_id`` and return it (asserted to be the only one).

    Raises:
        AssertionError: no such line within ``timeout_s`` seconds, or more than one.
    """
    (line,) = wait_for(
        srv,
        lambda x: x.get("message") == "request" and x.get("request_id") == request_id,
        timeout_s,
    )
    return line
