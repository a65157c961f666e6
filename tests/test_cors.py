"""CORS for browsers (``CORS_ORIGINS``): off by default, exact origins or ``*``, preflight ``OPTIONS``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server import GunicornServer
from wsgi_app.http.cors import ALLOW_HEADERS, allow_headers, allowed_origin
from wsgi_app.settings import Settings

ALLOWED = "http://a.example"
PREFLIGHT = {
    "Origin": ALLOWED,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type, authorization",
}
STREAM = "/v1/completions?model=m&prompt=a&max_tokens=1"
# What the official openai JavaScript SDK's preflight asks for from a browser (Chromium's form:
# lowercase, sorted, no spaces).
SDK_HEADERS = "authorization,content-type,x-stainless-os,x-stainless-timeout"


@pytest.fixture(scope="module")
def cors_server(succ_dir: Path, serve_module) -> GunicornServer:
    """The succ model with two allowed origins."""
    origins = f"{ALLOWED}, https://b.example:8443/"
    return serve_module(MODEL_DIR=str(succ_dir), CORS_ORIGINS=origins, health_port=False)


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
        "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
        "access-control-allow-headers": "content-type, authorization",
        "access-control-max-age": "600",
    }
    assert headers["vary"] == "Access-Control-Request-Headers, Origin"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_preflight_allows_the_headers_the_openai_sdk_sends(cors_server, path):
    headers = {**PREFLIGHT, "Access-Control-Request-Headers": SDK_HEADERS}
    status, got, body = cors_server.request("OPTIONS", path, headers=headers)
    assert (status, body) == (204, b"")
    assert cors_headers(got) == {
        "access-control-allow-origin": ALLOWED,
        "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
        "access-control-allow-headers": "authorization, content-type, x-stainless-os, "
        "x-stainless-timeout",
        "access-control-max-age": "600",
    }
    # Every header a client of the family may add is echoed, whatever its case.
    many = "X-Stainless-Lang,x-stainless-retry-count,OpenAI-Organization,openai-project,Idempotency-Key"
    status, got, _ = cors_server.request(
        "OPTIONS", path, headers={**PREFLIGHT, "Access-Control-Request-Headers": many}
    )
    assert status == 204
    assert got["access-control-allow-headers"] == (
        "x-stainless-lang, x-stainless-retry-count, openai-organization, openai-project, "
        "idempotency-key"
    )


def test_a_preflight_without_header_list_gets_the_base_list(cors_server):
    headers = {k: v for k, v in PREFLIGHT.items() if k != "Access-Control-Request-Headers"}
    status, got, _ = cors_server.request("OPTIONS", "/v1/completions", headers=headers)
    assert status == 204
    assert got["access-control-allow-headers"] == ALLOW_HEADERS


@pytest.mark.parametrize("requested", ["content-type, authorization", SDK_HEADERS])
def test_preflight_from_another_origin_gets_no_cors_headers(cors_server, requested):
    headers = {
        **PREFLIGHT,
        "Origin": "http://evil.example",
        "Access-Control-Request-Headers": requested,
    }
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


def test_allow_headers_echoes_well_formed_lists_only():
    assert allow_headers(SDK_HEADERS) == (
        "authorization, content-type, x-stainless-os, x-stainless-timeout"
    )
    assert allow_headers(" A , b,,a ") == "a, b"  # trimmed, lowercased, empty elements dropped
    assert allow_headers(None) == ALLOW_HEADERS
    assert allow_headers(" , ") == ALLOW_HEADERS
    for bad in ("x-a x-b", "x-a,(x)", "x-é", "x:y", "a\tb"):
        assert allow_headers(bad) == ALLOW_HEADERS, bad
    assert allow_headers(",".join(f"x-{i}" for i in range(64))).count(",") == 63
    assert allow_headers(",".join(f"x-{i}" for i in range(65))) == ALLOW_HEADERS


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
