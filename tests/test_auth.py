"""API keys: ``API_KEYS`` guards the ``/v1/`` routes; every other endpoint stays open.

A real gunicorn with two keys; exact status codes, error bodies and ``WWW-Authenticate`` challenges.
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest

from tests.sse import events

KEYS = ("key-one-0123456789", "key-two-abcdefghij")
BODY = {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0}
MISSING = {
    "error": {
        "message": "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}
INVALID = {
    "error": {
        "message": "Invalid API key.",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


@pytest.fixture(scope="module")
def keyed(succ_dir, serve_module):
    """One gunicorn serving the succ model with ``API_KEYS`` set to two keys."""
    return serve_module(MODEL_DIR=str(succ_dir), API_KEYS=",".join(KEYS))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_is_accepted(keyed, key):
    status, _, body = keyed.complete(BODY, headers=bearer(key))
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == "bcd"


def test_scheme_is_case_insensitive(keyed):
    status, _, body = keyed.complete(BODY, headers={"Authorization": f"bearer {KEYS[0]}"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "bcd"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Basic a2V5LW9uZTo="}, {"Authorization": "Bearer "}],
    ids=["none", "basic", "empty-bearer"],
)
def test_missing_key_is_refused(keyed, headers):
    status, resp_headers, body = keyed.complete(BODY, headers=headers)
    assert status == 401
    assert json.loads(body) == MISSING
    assert resp_headers["www-authenticate"] == 'Bearer realm="greenserve"'
    assert resp_headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    "key",
    [
        "wrong-key",
        KEYS[0][:-1],  # a prefix of a real key
        KEYS[0] + "x",  # a real key with more after it
        KEYS[0].upper(),
        f"{KEYS[0]},{KEYS[1]}",  # the whole API_KEYS value is not a key
    ],
    ids=["wrong", "prefix", "longer", "case", "list"],
)
def test_wrong_key_is_refused_without_echoing_it(keyed, key):
    status, headers, body = keyed.complete(BODY, headers=bearer(key))
    assert status == 401
    assert json.loads(body) == INVALID
    assert key.encode() not in body
    assert headers["www-authenticate"] == 'Bearer realm="greenserve", error="invalid_token"'


def test_every_api_route_is_guarded(keyed):
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/no-such-route")):
        status, _, body = keyed.request(method, path)
        assert (status, json.loads(body)) == (401, MISSING), path
    status, _, body = keyed.get("/v1/models", headers=bearer(KEYS[1]))
    assert status == 200, body


@pytest.mark.parametrize("path", ["/healthz", "/health", "/ready", "/debug/state"])
def test_ops_endpoints_stay_open(keyed, path):
    status, _, _ = keyed.get(path)
    assert status == 200
    assert keyed.get(path, port=keyed.health_port)[0] == 200


def test_metrics_is_not_guarded(keyed):
    status, _, body = keyed.get("/metrics")
    assert status == 200, body


def test_query_key_only_on_the_event_stream(keyed):
    query = urlencode({"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0})
    accept = {"Accept": "text/event-stream"}
    # POST never reads the query string: the key must be a header there.
    status, _, body = keyed.post(f"/v1/completions?api_key={KEYS[0]}", BODY)
    assert (status, json.loads(body)) == (401, MISSING)
    # GET /v1/completions (EventSource cannot send headers): ?api_key= is accepted.
    path = f"/v1/completions?{query}&api_key={KEYS[1]}"
    status, headers, body = keyed.get(path, headers=accept)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    data = [e["data"] for e in events(body)]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["b", "c"]
    status, _, body = keyed.get(f"/v1/completions?{query}&api_key=wrong", headers=accept)
    assert (status, json.loads(body)) == (401, INVALID)
    status, _, body = keyed.get(f"/v1/completions?{query}", headers=accept)
    assert (status, json.loads(body)) == (401, MISSING)
    # Other GET routes do not take it either.
    status, _, body = keyed.get(f"/v1/models?api_key={KEYS[0]}")
    assert (status, json.loads(body)) == (401, MISSING)


def test_query_key_on_the_chat_event_stream(keyed):
    messages = json.dumps([{"role": "user", "content": "a"}])
    query = urlencode({"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0})
    accept = {"Accept": "text/event-stream"}
    status, headers, body = keyed.get(
        f"/v1/chat/completions?{query}&api_key={KEYS[0]}", headers=accept
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert [e["data"] for e in events(body)][-1] == "[DONE]"
    status, _, body = keyed.get(f"/v1/chat/completions?{query}&api_key=wrong", headers=accept)
    assert (status, json.loads(body)) == (401, INVALID)
    status, _, body = keyed.get(f"/v1/chat/completions?{query}", headers=accept)
    assert (status, json.loads(body)) == (401, MISSING)
    # POST never reads the query string.
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    status, _, raw = keyed.post(f"/v1/chat/completions?api_key={KEYS[0]}", body)
    assert (status, json.loads(raw)) == (401, MISSING)


def test_keys_off_by_default(succ_server):
    status, _, body = succ_server.complete(BODY)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "bcd"
    status, _, body = succ_server.complete(BODY, headers=bearer("anything"))
    assert status == 200
