"""``/v1/chat/completions`` on the succ bigram (greedy next byte = byte + 1), through a real gunicorn:
the official ``openai`` client streamed and not, the exact chunk sequence and framing, seeds, stop
strings, chat logprobs, usage, every 400 naming its param, ``CHAT_TEMPLATE`` (used, raising, looping,
broken at start), a disconnect freeing the slot, the ``EventSource`` form, the OpenAPI document,
metrics and the log line.

With the default template, "Hello" renders as ``User: Hello\\nAssistant:`` (22 bytes): the succ model
answers ``;<=>?@...`` from the ``:``.

Source: OpenAI API reference, "Chat Completions" (create, the chat completion and chunk objects).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.chat_template import MAX_RENDER_S
from telemetry.logs import client_hash
from tests.contract import DOC_PATH, Contract
from tests.server import SLACK_S, GunicornServer, failed_start, refused_setting, wait_until
from tests.sse import EventReader, sse_json
from tests.sse import events as parse_events

HELLO = [{"role": "user", "content": "Hello"}]
PROMPT = "User: Hello\nAssistant:"
SSE = {"Accept": "text/event-stream"}
PATH = "/v1/chat/completions"


def chat(srv: GunicornServer, body: dict, **kw) -> tuple[int, dict[str, str], bytes]:
    return srv.post(PATH, body, **kw)


@pytest.fixture(scope="module")
def client(succ_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=succ_server.url + "/v1", api_key="unused", max_retries=0)


def model_version(srv: GunicornServer) -> str:
    return srv.get("/v1/models")[1]["x-model-version"]


# -- the official client ---------------------------------------------------------------------------


def test_openai_client_answer(client, succ_server):
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and len(r.id) == 33
    assert r.model == "m" and r.system_fingerprint == model_version(succ_server)
    (c,) = r.choices
    assert (c.index, c.finish_reason, c.logprobs) == (0, "length", None)
    assert (c.message.role, c.message.content, c.message.refusal) == ("assistant", ";<=>?", None)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (22, 5, 27)


def test_openai_client_stream(client):
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=HELLO,
            max_completion_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({(c.id, c.created, c.system_fingerprint) for c in chunks}) == 1
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    first, *tokens, finish, usage = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert [t.choices[0].delta.content for t in tokens] == [";", "<", "="]
    assert [t.choices[0].delta.role for t in tokens] == [None] * 3
    assert finish.choices[0].delta.content is None and finish.choices[0].finish_reason == "length"
    assert [c.usage for c in chunks[:-1]] == [None] * 5
    assert usage.choices == [] and usage.usage.model_dump() == {
        "prompt_tokens": 22,
        "completion_tokens": 3,
        "total_tokens": 25,
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }


def test_seeded_n2_reproduces_and_stream_equals_answer(client):
    kw = {"model": "m", "messages": HELLO, "max_tokens": 12, "n": 2, "seed": 7}
    one = client.chat.completions.create(**kw)
    two = client.chat.completions.create(**kw)
    texts = [c.message.content for c in one.choices]
    assert texts == [c.message.content for c in two.choices]
    assert texts[0] != texts[1]  # two choices, two random streams
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


def test_stop_string(client):
    r = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=10, temperature=0, stop=["=", "zz"]
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (";<", "stop")
    deltas = [
        (c.choices[0].delta.content, c.choices[0].finish_reason)
        for c in client.chat.completions.create(
            model="m", messages=HELLO, max_tokens=10, temperature=0, stop="=", stream=True
        )
    ]
    assert deltas == [("", None), (";", None), ("<", None), (None, "stop")]


def test_logprobs_in_the_chat_shape(client):
    top = math.log(math.exp(2) + 255)  # one logit of 2, 255 of 0
    kw = {"model": "m", "messages": HELLO, "max_tokens": 3, "temperature": 0}
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in content] == [(";", [59]), ("<", [60]), ("=", [61])]
    for e, byte in zip(content, (59, 60, 61), strict=True):
        assert e.logprob == pytest.approx(2 - top, abs=1e-6)
        (a, b) = e.top_logprobs
        assert (a.token, a.bytes, b.token, b.bytes) == (chr(byte), [byte], "\x00", [0])
        assert b.logprob == pytest.approx(-top, abs=1e-6)
    assert r.choices[0].logprobs.refusal is None
    streamed = [
        e
        for chunk in client.chat.completions.create(
            **kw, logprobs=True, top_logprobs=2, stream=True
        )
        for c in chunk.choices
        if c.logprobs is not None
        for e in c.logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**kw, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], [], []]


def test_exact_bytes_of_a_stream(succ_server):
    status, headers, raw = chat(
        succ_server,
        {"model": "m", "messages": HELLO, "max_tokens": 1, "temperature": 0, "stream": True},
    )
    assert status == 200 and headers["content-type"] == "text/event-stream"
    first = sse_json(raw)[0]
    head = (
        f'{{"id":"{first["id"]}","object":"chat.completion.chunk","created":{first["created"]},'
        f'"model":"m","system_fingerprint":"{model_version(succ_server)}","choices":[{{"index":0,'
    )
    assert raw.decode() == (
        ": ok\n\n"
        f'data: {head}"delta":{{"role":"assistant","content":""}},"logprobs":null,'
        '"finish_reason":null}]}\n\n'
        f'data: {head}"delta":{{"content":";"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}"delta":{{}},"logprobs":null,"finish_reason":"length"}}]}}\n\n'
        "data: [DONE]\n\n"
    )


# -- errors ----------------------------------------------------------------------------------------

BAD = [
    ({"messages": HELLO}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    (
        {"model": "m", "messages": [*HELLO, *HELLO, {"role": "user", "content": [{"type": "a"}]}]},
        "messages[2].content[0].type",
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    ({"model": "m", "messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
    (
        {"model": "m", "messages": HELLO, "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    ({"model": "m", "messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "m", "messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": HELLO, "max_completion_tokens": 4097}, "max_completion_tokens"),
    ({"model": "m", "messages": HELLO, "n": 9}, "n"),
    ({"model": "m", "messages": HELLO, "temperature": 3}, "temperature"),
    ({"model": "m", "messages": HELLO, "user": 5}, "user"),
    ({"model": "m", "messages": HELLO, "guided_json": {"type": "strin"}}, "guided_json"),
    ({"model": "m", "messages": HELLO, "format": "json"}, "format"),
    (
        {"model": "m", "messages": HELLO, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_every_400_names_its_param(succ_server, body, param):
    status, _, raw = chat(succ_server, body)
    error = json.loads(raw)["error"]
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), error


# -- CHAT_TEMPLATE, the slot, the log line ---------------------------------------------------------

TEMPLATE = (
    "{% if messages|length > 3 %}{{ raise_exception('At most three messages, got ' ~ "
    "messages|length) }}{% endif %}\n"
    "{% if messages[-1]['content'] == 'loop' %}{% for a in range(100000) %}"
    "{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}\n"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def templated(succ_dir, tmp_path_factory, serve_module):
    """A server with a CHAT_TEMPLATE that raises and loops on demand, slow steps and 2 slots."""
    tmp = tmp_path_factory.mktemp("chat-template")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    return serve_module(
        MODEL_DIR=str(succ_dir),
        CHAT_TEMPLATE=str(tmp / "chat.jinja"),
        GREENSERVE_FAULTS="slow_step_s=0.02",
        MAX_SLOTS="2",
        MAX_PROMPT_TOKENS="64",
        CLIENT_HASH_SALT="salt",
        health_port=False,
    )


def test_chat_template_setting_renders_the_prompt(templated):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    status, _, raw = chat(templated, {**body, "temperature": 0})
    answer = json.loads(raw)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "?@A"  # after ">"
    assert answer["usage"]["prompt_tokens"] == len("<user>Hi\n<assistant>")


def test_template_that_raises_or_loops_is_a_400_with_its_message(templated):
    status, _, raw = chat(templated, {"model": "m", "messages": HELLO * 4})
    assert status == 400 and json.loads(raw)["error"] == {
        "message": "The chat template failed on 'messages': At most three messages, got 4",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    started = time.perf_counter()
    status, _, raw = chat(
        templated, {"model": "m", "messages": [{"role": "user", "content": "loop"}]}
    )
    assert time.perf_counter() - started < MAX_RENDER_S + SLACK_S  # the render budget, not a hang
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
    assert json.loads(raw)["error"]["message"].endswith("chat template: rendering took too long")
    status, _, raw = chat(
        templated, {"model": "m", "messages": [{"role": "user", "content": "x" * 60}]}
    )
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "messages")
    n = len("<user>" + "x" * 60 + "\n<assistant>")
    assert error["message"] == f"The rendered conversation is {n} tokens; the limit is 64."


def test_disconnect_mid_chat_frees_the_slot(templated):
    body = {"model": "m", "messages": HELLO, "max_tokens": 2000, "stream": True, "user": "alice"}
    reader = EventReader(templated.port, body, headers={"X-Request-Id": "chat-gone"}, path=PATH)
    assert reader.open().status == 200
    assert reader.next_frame() == b": ok\n"
    assert b'"role":"assistant"' in reader.next_frame()
    assert b'"content":' in reader.next_frame()
    assert templated.state()["slots"]["busy"] == 1
    assert templated.in_flight("chat-gone") is not None
    reader.close()
    templated.wait_idle()
    line = wait_until(lambda: templated.log_line("chat-gone"), what="the request's log line")
    assert (line["endpoint"], line["path"], line["finish_reason"]) == (PATH, PATH, "abort")
    assert line["user_hash"] == client_hash("salt", "alice")
    assert "alice" not in templated.log_text()
    assert line["completion_tokens"] < 2000


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ raise_exception('no') }}", "fails on a sample conversation: no"),
        ("{% for %}", "chat template does not compile: "),
    ],
)
def test_broken_chat_template_stops_the_start(tmp_path, source, message):
    path = tmp_path / "t.jinja"
    path.write_text(source)
    assert message in refused_setting(tmp_path, "CHAT_TEMPLATE", str(path))


def test_missing_chat_template_file_stops_the_start(tmp_path):
    _, plain = failed_start(tmp_path, {"CHAT_TEMPLATE": "/nonexistent/t.jinja"})
    assert plain == [
        "greenserve: cannot start: CHAT_TEMPLATE must be a readable file, got '/nonexistent/t.jinja'"
    ]


# -- EventSource, the contract, metrics ------------------------------------------------------------

GET_URL = PATH + "?model=m&max_tokens=3&temperature=0&seed=5&messages=" + quote(json.dumps(HELLO))


def test_event_source_chat_stream_and_resume(succ_server):
    status, headers, raw = succ_server.get(GET_URL, headers=SSE)
    events = parse_events(raw)
    assert status == 200 and [e["id"] for e in events] == [
        "5-0",
        "5-1",
        "5-2",
        "5-3",
        "5-4",
        "5-done",
    ]
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": ";"},
        {"content": "<"},
        {"content": "="},
        {},
    ]
    status, _, raw = succ_server.get(GET_URL, headers={**SSE, "Last-Event-ID": "5-2"})
    assert [e["id"] for e in parse_events(raw)] == ["5-3", "5-4", "5-done"]
    status, _, raw = succ_server.get(GET_URL.replace("messages=", "messages=x"), headers=SSE)
    assert (status, json.loads(raw)["error"]["param"]) == (400, "messages")
    status, _, raw = succ_server.get(GET_URL)
    assert status == 400 and "text/event-stream" in json.loads(raw)["error"]["message"]


def test_chat_answers_validate_against_openapi(succ_server):
    contract = Contract(json.loads(DOC_PATH.read_text()))
    body = {"model": "m", "messages": HELLO, "max_tokens": 3, "n": 2, "logprobs": True}
    for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
        status, headers, raw = chat(succ_server, {**body, "top_logprobs": 1, **extra})
        assert contract.check(PATH, "POST", status, headers, raw) > 2
    status, headers, raw = chat(succ_server, {"model": "m", "messages": []})
    contract.check(PATH, "POST", status, headers, raw)
    status, headers, raw = succ_server.get(GET_URL, headers=SSE)
    assert contract.check(PATH, "GET", status, headers, raw) == 2 + 6


def test_metrics_count_chat_under_its_endpoint(succ_server):
    chat(succ_server, {"model": "m", "messages": HELLO, "max_tokens": 1})
    families = text_string_to_metric_families(succ_server.get("/metrics")[2].decode())
    (requests,) = [f for f in families if f.name == "greenserve_requests"]
    endpoints = {s.labels["endpoint"] for s in requests.samples if s.name.endswith("_total")}
    assert PATH in endpoints
    served = json.loads(succ_server.get("/v1/models")[2])["data"][0]["id"]
    chat_ok = [
        s.value
        for s in requests.samples
        if s.labels
        == {
            "endpoint": PATH,
            "status": "200",
            "finish_reason": "length",
            "end_reason": "finished",
            "model": served,
            "variant": "primary",
        }
    ]
    assert chat_ok and chat_ok[0] >= 1
    stats = json.loads(succ_server.get("/stats")[2])
    assert stats["totals"]["by_endpoint"][PATH] >= 1


# -- the README's chat examples, as written --------------------------------------------------------


def test_readme_chat_examples_run_as_written(default_server):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("### Chat completions") :]
    section = section[: section.index("\n## ")]
    (sh,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    (py,) = re.findall(r"```python\n(.*?)```", section, re.S)
    url = default_server.url.removeprefix("http://")
    body = {"model": "m", "messages": HELLO, "max_tokens": 16, "seed": 1}
    expected = json.loads(chat(default_server, body)[2])["choices"][0]["message"]["content"]
    run = subprocess.run(
        ["bash", "-c", sh.replace("localhost:8000", url)], capture_output=True, timeout=60
    )
    assert json.loads(run.stdout)["choices"][0]["message"]["content"] == expected
    run = subprocess.run(
        [sys.executable, "-c", py.replace("localhost:8000", url)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.startswith(expected + "\n")
    assert len(run.stdout) > len(expected) + 2  # the streamed answer followed
