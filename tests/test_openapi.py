"""The contract as a file: ``/openapi.json`` is a valid OpenAPI 3.1 document that lists every route, and
real answers of every endpoint validate against it (``tests/contract.py``)."""

from __future__ import annotations

import json
import socket

import pytest
from jsonschema import ValidationError
from openapi_spec_validator import validate

from tests.contract import DOC_PATH, Contract
from tests.responses import city_tool
from tests.sse import events
from wsgi_app.api.chat import FIELDS as CHAT_FIELDS
from wsgi_app.api.completions import FIELDS as COMPLETION_FIELDS
from wsgi_app.api.responses import FIELDS as RESPONSES_FIELDS
from wsgi_app.api.table import CONSTRAINT_FIELDS

SSE = {"Accept": "text/event-stream"}
STREAM_URL = "/v1/completions?model=m&prompt=a&max_tokens=3&temperature=0&seed=5"


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(json.loads(DOC_PATH.read_text()))


def test_served_document_is_the_file_and_valid_openapi_3_1(succ_server):
    status, headers, body = succ_server.get("/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json"
    doc = json.loads(body)
    assert doc == json.loads(DOC_PATH.read_text())
    assert doc["openapi"] == "3.1.0"
    validate(doc)  # the OpenAPI 3.1 meta-schema (raises on any violation)


def test_every_route_is_documented(succ_dir, tmp_path):
    from wsgi_app import create_app
    from wsgi_app.settings import Settings

    app = create_app(
        Settings.from_env({"MODEL_DIR": str(succ_dir), "STATS_DB": str(tmp_path / "s")})
    )
    routes = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<path:", "{").replace("<", "{").replace(">", "}")
        routes |= {(path, m.lower()) for m in rule.methods - {"HEAD", "OPTIONS"}}
    doc = json.loads(DOC_PATH.read_text())
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented


def test_completion_answers_validate(succ_server, contract):
    cases = [
        {"model": "m", "prompt": "a", "max_tokens": 3},
        {"model": "m", "prompt": [255], "max_tokens": 5, "n": 2, "logprobs": 2, "echo": True},
        {"model": "m", "prompt": "a", "max_tokens": 4, "stop": "d", "temperature": 0},
    ]
    checked = 0
    for body in cases:
        status, headers, raw = succ_server.complete(body)
        checked += contract.check("/v1/completions", "POST", status, headers, raw)
        status, headers, raw = succ_server.complete(
            {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        checked += contract.check("/v1/completions", "POST", status, headers, raw)
    assert checked == 3 + 7 + 3 + 16 + 3 + 7  # headers, bodies and every event


def test_stream_events_are_checked_strictly(succ_server, contract):
    # The checker itself: an id on a POST event, or a chunk with a stray field, is a violation.
    _, headers, raw = succ_server.complete(
        {"model": "m", "prompt": "a", "max_tokens": 1, "stream": True}
    )
    with pytest.raises(ValidationError):
        contract.check(
            "/v1/completions", "POST", 200, headers, raw.replace(b"data: {", b"id: 1\ndata: {")
        )
    with pytest.raises(ValidationError):
        contract.check(
            "/v1/completions", "POST", 200, headers, raw.replace(b'"id":', b'"x":0,"id":')
        )


def test_event_source_answers_validate(succ_server, contract):
    status, headers, raw = succ_server.get(STREAM_URL, headers=SSE)
    assert contract.check("/v1/completions", "GET", status, headers, raw) == 2 + 4
    assert [e["id"] for e in events(raw)] == ["5-0", "5-1", "5-2", "5-done"]
    status, headers, raw = succ_server.get(STREAM_URL, headers={**SSE, "Last-Event-ID": "5-done"})
    assert status == 204
    contract.check("/v1/completions", "GET", status, headers, raw)


ERRORS = [
    ("POST", "/v1/completions", {"model": "m"}, {}),
    ("GET", STREAM_URL.replace("max_tokens=3", "max_tokens=x"), None, SSE),
    ("GET", STREAM_URL, None, {}),
    ("GET", "/v1/models/nope", None, {}),
]


@pytest.mark.parametrize(("method", "url", "body", "headers"), ERRORS)
def test_error_answers_validate(succ_server, contract, method, url, body, headers):
    status, got, raw = succ_server.request(method, url, body=body, headers=headers)
    template = "/v1/models/{model}" if url.startswith("/v1/models/") else url.split("?")[0]
    assert status in (400, 404)
    contract.check(template, method, status, got, raw)


def test_413_validates(succ_server, contract):
    with socket.create_connection(("127.0.0.1", succ_server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\nConnection: close\r\n\r\n"
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    assert int(lines[0].split()[1]) == 413
    contract.check("/v1/completions", "POST", 413, headers, body)


def test_undocumented_paths_and_methods_still_answer_the_error_shape(succ_server, contract):
    for method, path, expected in (("GET", "/nope", 404), ("DELETE", "/v1/models", 405)):
        status, _, raw = succ_server.request(method, path)
        assert status == expected
        contract.validator("/components/schemas/Error").validate(json.loads(raw))


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/{model}", "/healthz", "/health", "/ready", "/debug/state"]
    + ["/metrics", "/stats", "/stats/history"],
)
def test_ops_and_models_validate(succ_server, succ_dir, contract, path):
    status, headers, raw = succ_server.get(path.replace("{model}", succ_dir.name))
    assert status == 200
    assert contract.check(path, "GET", status, headers, raw) == 3  # two headers and the body


def test_openapi_json_validates(succ_server, contract):
    status, headers, raw = succ_server.get("/openapi.json")
    contract.check("/openapi.json", "GET", status, headers, raw)


def test_drain_and_not_ready_validate(succ_dir, serve, contract):
    srv = serve(MODEL_DIR=str(succ_dir), health_port=False)
    status, headers, raw = srv.post("/debug/drain", b"")
    contract.check("/debug/drain", "POST", status, headers, raw)
    status, headers, raw = srv.get("/ready")
    assert (status, json.loads(raw)) == (503, {"status": "not_ready", "reason": "draining"})
    contract.check("/ready", "GET", status, headers, raw)
    status, headers, raw = srv.post("/debug/drain", b"", headers={"X-Forwarded-For": "1.2.3.4"})
    contract.check("/debug/drain", "POST", status, headers, raw)
    assert status == 404


@pytest.mark.parametrize(
    ("schema", "path", "aliases"),
    [
        ("CompletionRequest", "/v1/completions", set()),
        ("ChatCompletionRequest", "/v1/chat/completions", {"include_usage"}),
    ],
)
def test_the_documented_fields_are_the_endpoints_field_table(schema, path, aliases):
    """One source for each endpoint's fields (``wsgi_app.api.table``): the body schema lists the
    table's fields and the refused constraint fields; the GET form's parameters are the fields the
    table says a query carries (and the chat's ``include_usage``)."""
    table = COMPLETION_FIELDS if path == "/v1/completions" else CHAT_FIELDS
    doc = json.loads(DOC_PATH.read_text())
    assert set(doc["components"]["schemas"][schema]["properties"]) == table.names | set(
        CONSTRAINT_FIELDS
    )
    params = {p["name"] for p in doc["paths"][path]["get"]["parameters"] if p.get("in") == "query"}
    assert params == {f.name for f in table.fields if f.query} | aliases


def test_every_generation_operation_documents_the_variant_headers():
    # Every operation that picks a model (wsgi_app.http.runtime.Runtime.pick) takes the pin and the
    # session header, and every answer names the version that answered.
    doc = json.loads(DOC_PATH.read_text())
    refs = [
        {"$ref": "#/components/parameters/X-Model-Variant"},
        {"$ref": "#/components/parameters/X-Session-Id"},
    ]
    picking = {
        ("/v1/completions", "post"),
        ("/v1/completions", "get"),
        ("/v1/chat/completions", "post"),
        ("/v1/chat/completions", "get"),
        ("/v1/responses", "post"),
        ("/v1/messages", "post"),
        ("/v1/messages/count_tokens", "post"),
    }
    with_refs = {
        (path, method)
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if all(ref in op.get("parameters", []) for ref in refs)
    }
    assert with_refs == picking
    params = doc["components"]["parameters"]
    assert {name: (p["name"], p["in"]) for name, p in params.items()} == {
        "X-Model-Variant": ("X-Model-Variant", "header"),
        "X-Session-Id": ("X-Session-Id", "header"),
    }
    for path, method in picking:
        answer = doc["paths"][path][method]["responses"]["200"]
        assert "X-Model-Version" in answer["headers"], (path, method)


def test_the_responses_request_schema_is_its_field_table():
    doc = json.loads(DOC_PATH.read_text())
    assert set(doc["components"]["schemas"]["ResponsesRequest"]["properties"]) == (
        RESPONSES_FIELDS.names | set(CONSTRAINT_FIELDS)
    )


def test_responses_answers_validate(succ_server, contract):
    tool = city_tool()
    cases = [
        {"model": "m", "input": "a", "max_output_tokens": 3},
        {"model": "m", "input": "a", "tools": [tool], "tool_choice": "required", "seed": 1},
        {"model": "m", "input": "a", "text": {"format": {"type": "json_object"}}, "seed": 2},
    ]
    stored = []
    for body in cases:
        for streamed in (False, True):
            status, headers, raw = succ_server.post("/v1/responses", {**body, "stream": streamed})
            assert status == 200, raw
            contract.check("/v1/responses", "POST", status, headers, raw)
            if not streamed:
                stored.append(json.loads(raw)["id"])
    path = "/v1/responses/{response_id}"
    for method, status in (("GET", 200), ("DELETE", 200), ("GET", 404), ("DELETE", 404)):
        got, headers, raw = succ_server.request(method, f"/v1/responses/{stored[0]}")
        assert got == status
        contract.check(path, method, got, headers, raw)
    status, headers, raw = succ_server.post("/v1/responses", {"model": "m"})
    assert status == 400
    contract.check("/v1/responses", "POST", status, headers, raw)
