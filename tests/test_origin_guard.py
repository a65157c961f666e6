"""Cross-origin generation is refused before any work.

Browsers send a POST with a ``text/plain``, form or multipart body, and an ``EventSource`` GET, across
origins without a preflight. A real gunicorn with API keys off (the default): such a request from an
origin that is neither the server's own nor in ``CORS_ORIGINS`` (``null`` included) is a 403
``origin_not_allowed``; nothing is generated (the access log has no completion tokens); the server's own
origin, allowed origins and requests without ``Origin`` are served.

Source: WHATWG Fetch Standard §4.1 (requests that need no preflight); RFC 6454 §7.
"""

from __future__ import annotations

import json

import pytest

from tests.server import GunicornServer
from wsgi_app.http.origin_guard import same_origin

BODY = json.dumps({"model": "m", "prompt": "a", "max_tokens": 3})
REFUSED = {
    "type": "invalid_request_error",
    "code": "origin_not_allowed",
    "param": None,
}


@pytest.fixture(scope="module")
def guarded(succ_dir, tmp_path_factory):
    env = {"MODEL_DIR": str(succ_dir), "CORS_ORIGINS": "https://app.example"}
    with GunicornServer(tmp_path_factory.mktemp("origin"), env) as srv:
        yield srv


def generated(srv: GunicornServer) -> int:
    """Return how many completion tokens the access log shows generated so far."""
    total = 0
    # Only whole lines: the server may be writing the last one while it is read.
    for line in srv.log_text().splitlines(keepends=True):
        if line.startswith("{") and line.endswith("\n"):
            total += json.loads(line).get("completion_tokens") or 0
    return total


NO_PREFLIGHT = [
    ("POST", "/v1/completions", "text/plain", BODY),
    ("POST", "/v1/completions", "application/x-www-form-urlencoded", BODY),
    ("POST", "/v1/completions", "multipart/form-data; boundary=x", BODY),
    ("POST", "/v1/chat/completions", "text/plain", BODY),
    ("GET", "/v1/completions?model=m&prompt=a&max_tokens=3&stream=true", None, None),  # EventSource
]


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
@pytest.mark.parametrize(("method", "path", "ctype", "body"), NO_PREFLIGHT)
def test_a_foreign_origin_is_403_before_any_work(guarded, origin, method, path, ctype, body):
    before = generated(guarded)
    headers = {"Origin": origin, **({"Content-Type": ctype} if ctype else {})}
    status, _, raw = guarded.request(method, path, body=body, headers=headers)
    assert status == 403, raw
    error = json.loads(raw)["error"]
    assert {k: error[k] for k in REFUSED} == REFUSED
    assert error["message"] == (
        f"Origin {origin!r} is not allowed: the API answers only its own origin and those listed "
        "in CORS_ORIGINS."
    )
    assert generated(guarded) == before


def test_own_allowed_and_absent_origins_are_served(guarded):
    own = f"http://127.0.0.1:{guarded.port}"
    for headers in ({"Origin": own}, {"Origin": "https://app.example"}, {}):
        status, _, raw = guarded.post("/v1/completions", BODY, headers=headers)
        assert status == 200, (headers, raw)


def test_same_origin_compares_host_and_port():
    assert same_origin("http://h.example:8000", "h.example:8000")
    assert same_origin("https://h.example", "h.example")  # default ports on both sides
    assert same_origin("https://h.example:443", "h.example")
    assert not same_origin("http://h.example:8000", "h.example:8001")
    assert not same_origin("http://h.example", "h.example:8000")
    assert not same_origin("http://evil.example:8000", "h.example:8000")
    assert not same_origin("http://[::1]:8000", "[::1]:8001")
    assert same_origin("http://[::1]:8000", "[::1]:8000")
    assert not same_origin("null", "h.example")
    assert not same_origin("ftp://h.example", "h.example")
    assert not same_origin("http://h.example", None)
