"""Structured outputs through a real gunicorn, on the bigram and on stories260K: every schema of the grid
is enforced (outputs that end with ``stop`` parse and validate with ``jsonschema``), streamed equals not
streamed, regex / choice / grammar on both endpoints, ``json_object``, ``n``, ``echo`` and raw logprobs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.schemas import SCHEMAS
from tests.server import GunicornServer, concurrently
from tests.sse import sse_events

MAX_TOKENS = 48
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(family, serve_module):
    """A server on each model family in turn (``family``), 16 slots."""
    name, env = family
    srv = serve_module(MAX_SLOTS="16", **env)
    srv.model_name = name
    return srv


def _text(srv: GunicornServer, body: dict, path: str = "/v1/completions") -> tuple[str, str]:
    """Return (text, finish_reason) of a one-choice request, streamed or not."""
    status, _, raw = srv.post(path, body)
    assert status == 200, raw
    chat = path == CHAT
    if not body.get("stream"):
        choice = json.loads(raw)["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, reason = [], None
    for payload in sse_events(raw)[:-1]:
        choice = json.loads(payload)["choices"][0]
        text.append(choice["delta"].get("content", "") if chat else choice["text"])
        reason = choice["finish_reason"] or reason
    return "".join(text), reason


def _greedy_text(srv: GunicornServer, **fields) -> tuple[str, str]:
    """Return (text, finish_reason) of the greedy completion of "x" (``MAX_TOKENS``) with
    ``fields`` (the constraint, stop strings) added."""
    body = {"model": "m", "prompt": "x", "max_tokens": MAX_TOKENS, "temperature": 0}
    return _text(srv, {**body, **fields})


def test_schema_grid_is_enforced(server):
    """Each schema greedy and seeded, streamed and not (concurrently): stream == JSON answer, and every
    output that stops validates."""
    cases = [(name, temp) for name in SCHEMAS for temp in (0.0, 1.0)]

    def run(i: int) -> tuple[str, str, str, str]:
        name, temp = cases[i]
        body = {
            "model": "m",
            "prompt": "The answer:",
            "max_tokens": MAX_TOKENS,
            "temperature": temp,
            "seed": 7 + i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": SCHEMAS[name]},
            },
        }
        plain = _text(server, body)
        streamed = _text(server, {**body, "stream": True})
        assert streamed == plain, (name, temp)
        return name, temp, *plain

    results = concurrently(run, len(cases), timeout_s=120)
    stopped = 0
    for name, _temp, text, reason in results:
        assert reason in ("stop", "length"), (name, reason)
        if reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        else:
            assert len(text) > 0
    # Nearly all finish within 48 tokens (the bigram spends one token per byte).
    print(f"{server.model_name}: {stopped}/{len(results)} outputs stopped and validated")
    assert stopped >= 0.8 * len(results)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 9}])
def test_alone_and_in_a_batch_of_16_give_the_same_bytes(server, sampling):
    body = {
        "model": "m",
        "prompt": "Data:",
        "max_tokens": MAX_TOKENS,
        "logprobs": 2,
        "n": 2,
        "structured_outputs": {"json": SCHEMAS["nested_arrays"]},
        **sampling,
    }

    def choices(_: int) -> str:
        status, _, raw = server.complete(body)
        assert status == 200, raw
        return json.dumps(json.loads(raw)["choices"])

    alone = choices(0)
    assert concurrently(choices, 16, timeout_s=120) == [alone] * 16


def test_json_is_compact(server):
    schema = {
        "type": "object",
        "properties": {
            "a": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    text, reason = _greedy_text(server, structured_outputs={"json": schema})
    assert reason == "stop"
    assert text == json.dumps(json.loads(text), separators=(",", ":"))


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
@pytest.mark.parametrize(
    "field, value, check",
    [
        ("structured_outputs", {"regex": "[a-z]{2,6}-[0-9]{2}"}, r"[a-z]{2,6}-[0-9]{2}"),
        ("structured_outputs", {"choice": ["alpha", "beta", "gamma"]}, "alpha|beta|gamma"),
        ("structured_outputs", {"grammar": 'start: "x" n "y"\nn: /[0-9]{1,3}/'}, r"x[0-9]{1,3}y"),
        ("guided_regex", "(yes|no)!", "(yes|no)!"),
        ("guided_choice", ["up", "down"], "up|down"),
        ("grammar", 'root ::= "a" [0-9] "b"', "a[0-9]b"),
    ],
)
def test_regex_choice_grammar(server, path, field, value, check):
    base = {"model": "m", "max_tokens": MAX_TOKENS, "seed": 3, field: value}
    base.update(
        {"messages": [{"role": "user", "content": "Go"}]} if path == CHAT else {"prompt": "Go"}
    )
    for temp, stream in ((0.0, False), (1.0, True)):
        text, reason = _text(server, {**base, "temperature": temp, "stream": stream}, path)
        assert reason == "stop", text
        assert re.fullmatch(check, text), text


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_json_object_outputs_are_objects(server, path):
    body = {
        "model": "m",
        "max_tokens": MAX_TOKENS,
        "seed": 11,
        "response_format": {"type": "json_object"},
    }
    body.update(
        {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    )
    for temp in (0.0, 0.8):
        text, reason = _text(server, {**body, "temperature": temp}, path)
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_n_echo_and_raw_logprobs(server):
    schema = SCHEMAS["enum_and_bounds"]
    body = {
        "model": "m",
        "prompt": "Weigh:",
        "max_tokens": MAX_TOKENS,
        "n": 3,
        "seed": 5,
        "echo": True,
        "logprobs": 2,
        "structured_outputs": {"json": schema},
    }
    status, _, raw = server.complete(body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 3
    for c in choices:
        assert c["text"].startswith("Weigh:")
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"][len("Weigh:") :]), schema)
    # logprobs are the raw distribution: the first generated token's alternatives are those of an
    # unconstrained request on the same prompt, though the grammar forced "{".
    status, _, free = server.complete({k: v for k, v in body.items() if k != "structured_outputs"})
    first = len(json.loads(free)["choices"][0]["logprobs"]["tokens"]) - MAX_TOKENS
    got = choices[0]["logprobs"]["top_logprobs"][first]
    assert got == json.loads(free)["choices"][0]["logprobs"]["top_logprobs"][first]
    assert choices[0]["logprobs"]["tokens"][first].startswith("{")


def stop_refusal(param: str) -> dict:
    message = (
        f"'stop' cannot be used with an output constraint ('{param}'): a stop string would cut "
        "the constrained answer before it is complete, yet end with finish_reason 'stop'. Send "
        "one of them (a regex or grammar can say where the answer ends)."
    )
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "stop",
            "code": None,
        }
    }


STOP_WITH = {
    "structured_outputs.choice": {"structured_outputs": {"choice": ["alphabeta"]}},
    "response_format": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": SCHEMAS["integer"], "strict": True},
        }
    },
    "guided_regex": {"guided_regex": "[a-z]+"},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
@pytest.mark.parametrize("param", list(STOP_WITH))
def test_stop_strings_beside_a_constraint_are_refused(server, param, path, stream):
    """A stop string could only cut the constrained answer short of its end (``{"a":3972`` for
    ``stop: [","]``) and still say ``finish_reason: "stop"``: the pair is a 400 naming ``stop``."""
    body = {"model": "m", "max_tokens": MAX_TOKENS, "stream": stream, **STOP_WITH[param]}
    body.update(
        {"prompt": "x"} if path != CHAT else {"messages": [{"role": "user", "content": "x"}]}
    )
    for stop in ("ta", [","], ["}", "a"]):
        status, headers, raw = server.post(path, {**body, "stop": stop})
        assert (status, headers["content-type"], json.loads(raw)) == (
            400,
            "application/json",
            stop_refusal(param),
        )
    # Without it (or with an empty list, or null) the answer is whole.
    for stop in ([], None):
        status, _, raw = server.post(path, {**body, "stop": stop})
        assert status == 200, raw
    assert _greedy_text(server, stop=[], **STOP_WITH["structured_outputs.choice"]) == (
        "alphabeta",
        "stop",
    )


def test_metrics_and_log_name_the_kind(server):
    _text(
        server,
        {"model": "m", "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "ab+"}},
    )
    server.wait_idle()
    _, _, metrics = server.get("/metrics")
    lines = metrics.decode().splitlines()
    assert any(
        line.startswith('greenserve_structured_requests_total{kind="regex"}') for line in lines
    )
    assert any(line.startswith("greenserve_structured_compile_seconds_count") for line in lines)
    assert any(line.startswith("greenserve_structured_mask_seconds_count") for line in lines)
    logged = [json.loads(x) for x in server.log_text().splitlines() if '"constraint": "regex"' in x]
    assert logged and logged[-1]["status"] == 200 and logged[-1]["mask_s"] is not None
