"""CORS for browsers (``CORS_ORIGINS``): off by default, exact origins or ``*``, preflight ``OPTIONS``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import GunicornServer
from wsgi_app.cors import allowed_origin
from wsgi_app.settings import Settings

ALLOWED = "http://a.example"
PREFLIGHT = {
    "Origin": ALLOWED,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type, authorization",
}
STREAM = "/v1/completions?model=m&prompt=a&max_tokens=1"


@pytest.fixture(scope="module")
def cors_server(
    succ_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """The succ model with two allowed origins."""
    with GunicornServer(
        tmp_path_factory.mktemp("cors"),
        {"MODEL_DIR": str(succ_dir), "CORS_ORIGINS": f"{ALLOWED}, https://b.example:8443/"},
        health_port=False,
    ) as srv:
        yield srv


def cors_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-")}


def test_off_by_default(succ_server):
    status, headers, _ = succ_server.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert (
        status == 204
    )  # the plain OPTIONS answer (Allow only): no CORS headers, a browser refuses
    assert cors_headers(headers) == {}
    _, headers, _ = succ_server.complete(
        {"model": "m", "prompt": "a", "max_tokens": 1}, headers={"Origin": ALLOWED}
    )
    assert cors_headers(headers) == {}


def test_preflight_from_an_allowed_origin(cors_server):
    status, headers, body = cors_server.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert (status, body) == (204, b"")
    assert "content-type" not in headers
    assert cors_headers(headers) == {
        "access-control-allow-origin": ALLOWED,
        "access-control-allow-methods": "GET, POST, OPTIONS",
        "access-control-allow-headers": "Authorization, Content-Type, Last-Event-ID, "
        "X-Request-Id, traceparent",
        "access-control-max-age": "600",
    }
    assert headers["vary"] == "Origin"


def test_preflight_from_another_origin_gets_no_cors_headers(cors_server):
    headers = {**PREFLIGHT, "Origin": "http://evil.example"}
    status, got, _ = cors_server.request("OPTIONS", "/v1/completions", headers=headers)
    assert status == 204  # the plain OPTIONS answer, without CORS headers
    assert cors_headers(got) == {}
    assert got["vary"] == "Origin"


def test_actual_requests_from_allowed_origins(cors_server):
    status, headers, _ = cors_server.complete(
        {"model": "m", "prompt": "a", "max_tokens": 1},
        headers={"Origin": "https://b.example:8443"},
    )
    assert status == 200
    assert cors_headers(headers) == {
        "access-control-allow-origin": "https://b.example:8443",
        "access-control-expose-headers": "X-Request-Id, X-Model-Version, Retry-After",
    }
    status, headers, body = cors_server.get(
        STREAM, headers={"Origin": ALLOWED, "Accept": "text/event-stream"}
    )
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert headers["access-control-allow-origin"] == ALLOWED
    # Errors are readable cross-origin too, or a page could not show why a request failed.
    status, headers, _ = cors_server.get("/v1/models/nope", headers={"Origin": ALLOWED})
    assert (status, headers["access-control-allow-origin"]) == (404, ALLOWED)


def test_unknown_path_preflight_stays_404(cors_server):
    assert cors_server.request("OPTIONS", "/nope", headers=PREFLIGHT)[0] == 404


def test_allowed_origin():
    assert allowed_origin("http://a.example", ("http://a.example",)) == "http://a.example"
    assert allowed_origin("http://a.example:80", ("http://a.example",)) is None
    assert allowed_origin("http://x", ("*",)) == "*"
    assert allowed_origin(None, ("*",)) is None
    assert allowed_origin("http://a.example", ()) is None


def test_cors_origins_setting():
    env = {"CORS_ORIGINS": " http://a.example/ ,https://b.example:8443"}
    assert Settings.from_env(env).cors_origins == ("http://a.example", "https://b.example:8443")
    assert Settings.from_env({}).cors_origins == ()
    assert Settings.from_env({"CORS_ORIGINS": "*"}).cors_origins == ("*",)
    for bad in ("a.example", "ftp://a.example", "http://a.example/path", "http://"):
        with pytest.raises(ValueError, match="CORS_ORIGINS"):
            Settings.from_env({"CORS_ORIGINS": bad})
