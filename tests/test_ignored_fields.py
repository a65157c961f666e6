"""What another server's client sends: unknown fields are ignored and named, constraint fields and
negative seeds are a 400 naming them, a message's ``name`` and reasoning reach the chat template.

A real gunicorn serving the succ model (``W[i][(i+1) % 256]``: greedy text is the bytes after the
prompt's last one), on every generation endpoint: ``POST`` (JSON and stream) and ``GET`` (the
``EventSource`` form) of ``/v1/completions`` and ``/v1/chat/completions``.

Source: DESIGN.md §5 (the v0 contract: "unknown fields are ignored", "``seed`` a non-negative
integer"); Hugging Face transformers, "Chat templates" (the message dict is the template's).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import pytest

from tests.contract import DOC_PATH, Contract
from tests.server import GunicornServer, wait_until
from tests.sse import frames
from wsgi_app.api.table import CONSTRAINT_FIELDS

CHAT = "/v1/chat/completions"
SSE = {"Accept": "text/event-stream"}
HELLO = [{"role": "user", "content": "a"}]
COMPLETION = {"model": "m", "prompt": "a", "max_tokens": 2, "temperature": 0}
CHAT_BODY = {"model": "m", "messages": HELLO, "max_tokens": 2, "temperature": 0}
# What clients of vLLM, llama.cpp and Ollama send that this server does not know.
NOISE = {"repetition_penalty": 1.1, "cache_prompt": True, "n_predict": 8, "keep_alive": "5m"}
NOISE_HEADER = "cache_prompt,keep_alive,n_predict,repetition_penalty"


def get_url(path: str, params: dict) -> str:
    query = {k: json.dumps(v) if isinstance(v, list | bool) else v for k, v in params.items()}
    return f"{path}?{urlencode(query)}"


def data_choices(body: bytes) -> list:
    """The ``choices`` of every data event of a stream (ids and timestamps left out)."""
    return [
        json.loads(f["data"])["choices"]
        for f in frames(body)
        if f.get("data", "[DONE]") != "[DONE]"
    ]


# -- unknown fields: ignored, named ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), (CHAT, CHAT_BODY)], ids=["legacy", "chat"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_post_ignores_unknown_fields_and_names_them(succ_server, path, body, stream):
    body = {**body, "seed": 3, "stream": stream}
    status, headers, noisy = succ_server.post(path, {**body, **NOISE})
    assert status == 200, noisy
    assert headers["x-ignored-fields"] == NOISE_HEADER
    _, plain_headers, plain = succ_server.post(path, body)
    assert "x-ignored-fields" not in plain_headers
    if stream:
        assert data_choices(noisy) == data_choices(plain)
    else:
        assert json.loads(noisy)["choices"] == json.loads(plain)["choices"]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/completions", COMPLETION),
        (CHAT, {**CHAT_BODY, "messages": json.dumps(HELLO)}),
    ],
    ids=["legacy", "chat"],
)
def test_get_ignores_unknown_query_parameters_and_names_them(succ_server, path, params):
    params = {**params, "seed": 3}
    status, headers, noisy = succ_server.get(get_url(path, {**params, **NOISE}), headers=SSE)
    assert status == 200, noisy
    assert headers["x-ignored-fields"] == NOISE_HEADER
    assert headers["content-type"] == "text/event-stream"
    _, plain_headers, plain = succ_server.get(get_url(path, params), headers=SSE)
    assert "x-ignored-fields" not in plain_headers
    assert data_choices(noisy) == data_choices(plain)


def test_many_unknown_fields_are_named_up_to_32_then_counted(succ_server):
    extra = {f"x{i:02d}": i for i in range(40)}
    status, headers, _ = succ_server.complete({**COMPLETION, **extra})
    assert status == 200
    assert headers["x-ignored-fields"] == ",".join([f"x{i:02d}" for i in range(32)] + ["+8"])


def test_the_log_line_names_the_ignored_fields(succ_server):
    rid = "ignored-fields-log-1"
    status, _, _ = succ_server.complete(
        {**COMPLETION, "mirostat": 2, "cache_prompt": True}, headers={"X-Request-Id": rid}
    )
    assert status == 200

    def line() -> dict | None:
        for text in succ_server.log_text().splitlines():
            obj = json.loads(text) if text.startswith("{") else {}
            if obj.get("message") == "request" and obj.get("request_id") == rid:
                return obj
        return None

    assert wait_until(line, 10.0, succ_server.log_tail)["ignored_fields"] == [
        "cache_prompt",
        "mirostat",
    ]


def test_unknown_fields_do_not_hide_a_known_fields_error(succ_server):
    status, headers, raw = succ_server.complete({**COMPLETION, "temperature": 3, "mirostat": 2})
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "temperature"


# -- other servers' constraint fields: never noise ----------------------------------------------

# vLLM's guided_* and llama.cpp's json_schema/grammar are enforced (tests/test_structured_refusals.py).
CONSTRAINTS = {"format": "json"}


def test_the_constraint_list_is_the_one_tested():
    assert tuple(CONSTRAINTS) == CONSTRAINT_FIELDS


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), (CHAT, CHAT_BODY)], ids=["legacy", "chat"]
)
def test_a_constraint_field_is_a_400_naming_it(succ_server, path, body, name):
    status, _, raw = succ_server.post(path, {**body, **NOISE, name: CONSTRAINTS[name]})
    assert status == 400
    assert json.loads(raw)["error"] == {
        "message": f"'{name}' (another server's constrained-output field) is not supported by "
        "this server; remove it for unconstrained text.",
        "type": "invalid_request_error",
        "param": name,
        "code": None,
    }


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_constraint_query_parameter_is_a_400_naming_it(succ_server, path):
    params = COMPLETION if path != CHAT else {**CHAT_BODY, "messages": json.dumps(HELLO)}
    status, _, raw = succ_server.get(get_url(path, {**params, "guided_regex": "a+"}), headers=SSE)
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "guided_regex"


def test_known_unsupported_fields_stay_a_400(succ_server):
    for body, param in [
        ({**CHAT_BODY, "modalities": ["text", "audio"]}, "modalities"),
        ({**CHAT_BODY, "audio": {"voice": "alloy"}}, "audio"),
        ({**CHAT_BODY, "prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({**CHAT_BODY, "response_format": {"type": "json_schema"}}, "response_format"),
    ]:
        status, _, raw = succ_server.post(CHAT, body)
        assert (status, json.loads(raw)["error"]["param"]) == (400, param)
    status, _, raw = succ_server.complete({**COMPLETION, "suffix": "!"})
    assert (status, json.loads(raw)["error"]["param"]) == (400, "suffix")


# -- negative seeds ---------------------------------------------------------------------------------

SEED_MESSAGE = "'seed' must be in 0..18446744073709551615, got -1; omit 'seed' for a random seed."


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", COMPLETION),
        ("POST", CHAT, CHAT_BODY),
        ("GET", "/v1/completions", COMPLETION),
        ("GET", CHAT, {**CHAT_BODY, "messages": json.dumps(HELLO)}),
    ],
)
def test_seed_minus_one_is_a_400_on_every_endpoint(succ_server, method, path, body):
    if method == "POST":
        status, _, raw = succ_server.post(path, {**body, "seed": -1})
    else:
        status, _, raw = succ_server.get(get_url(path, {**body, "seed": -1}), headers=SSE)
    assert status == 400
    error = json.loads(raw)["error"]
    assert (error["param"], error["message"]) == ("seed", SEED_MESSAGE)


# -- what the chat template sees ---------------------------------------------------------------------

NAME_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}]"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}[assistant]"
)


@pytest.fixture(scope="module")
def named_server(succ_dir: Path, tmp_path_factory: pytest.TempPathFactory, serve_module):
    """The succ model with a chat template that prints names and ``reasoning_content``."""
    template = tmp_path_factory.mktemp("named") / "template.jinja"
    template.write_text(NAME_TEMPLATE)
    return serve_module(MODEL_DIR=str(succ_dir), CHAT_TEMPLATE=str(template), health_port=False)


def prompt_tokens(srv: GunicornServer, messages: list[dict]) -> int:
    status, _, raw = srv.post(CHAT, {**CHAT_BODY, "messages": messages, "max_tokens": 1})
    assert status == 200, raw
    return json.loads(raw)["usage"]["prompt_tokens"]


def test_a_messages_name_is_rendered_by_a_template_that_reads_it(named_server):
    # The succ model's tokens are bytes: the prompt is "[user]a\n[assistant]", or with the name
    # "[user ann]a\n[assistant]", four bytes more.
    plain = prompt_tokens(named_server, [{"role": "user", "content": "a"}])
    assert plain == len("[user]a\n[assistant]")
    assert (
        prompt_tokens(named_server, [{"role": "user", "content": "a", "name": "ann"}]) == plain + 4
    )


def test_reasoning_is_accepted_and_rendered_only_by_a_template_that_reads_it(
    named_server, succ_server
):
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with_reasoning = [turns[0], {**turns[1], "reasoning_content": "xyz"}, turns[2]]
    base = prompt_tokens(named_server, turns)
    assert prompt_tokens(named_server, with_reasoning) == base + len("<think>xyz</think>")
    # OpenRouter's and Ollama's key: accepted, and this template does not read it.
    with_reasoning[1] = {**turns[1], "reasoning": "xyz"}
    assert prompt_tokens(named_server, with_reasoning) == base
    # The default template renders neither.
    assert prompt_tokens(succ_server, with_reasoning) == prompt_tokens(succ_server, turns)


def test_reasoning_on_a_user_message_is_still_refused(named_server):
    status, _, raw = named_server.post(
        CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "a", "reasoning": "x"}]}
    )
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "messages[0].reasoning"


def test_the_header_is_in_the_contract(succ_server):
    contract = Contract(json.loads(DOC_PATH.read_text()))
    for stream in (False, True):
        status, headers, raw = succ_server.complete(
            {**COMPLETION, **NOISE, "": 1, "stream": stream}
        )
        assert headers["x-ignored-fields"] == "''," + NOISE_HEADER
        # Every documented header is validated when present: X-Ignored-Fields is one of them.
        assert contract.check("/v1/completions", "POST", status, headers, raw) >= 4
