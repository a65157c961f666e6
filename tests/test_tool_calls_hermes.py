"""Tool calls in the Hermes format through a real gunicorn serving a tiny Llama whose own chat
template is Qwen2.5's kind (it renders tools itself and writes calls as ``<tool_call>\\n{...}\\n
</tool_call>``): the served template picks the format (no ``TOOL_CALL_FORMAT``), the grammar forces
that layout, the calls parse back from it with schema-valid arguments, streamed and not, and what
cannot be enforced is refused. The format's own pieces (grammar, parser, detection) are checked
without a server first.

Source: Qwen2.5-Instruct's chat template (tools and tool calls); the Hermes function-calling format.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from model.chat_template import ChatTemplate
from model.grammar.compile import Constraint, GrammarCompiler
from model.grammar.matcher import ConstraintError
from model.loader import load_model
from model.tokenizer import ByteTokenizer
from model.tool_formats import SAMPLE_TOOLS, HermesFormat, tool_format
from tests.llamafiles import write_tiny_llama
from tests.toolcalls import ASK, TIME, TOOLS, WEATHER, accumulate, answer, called, plain, stream

# Qwen2.5-Instruct's template, shortened to its tool parts (the system text, tools as JSON lines,
# calls in <tool_call> blocks, results as user turns of <tool_response> blocks).
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN = HermesFormat("\n")
TWO = (
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>'
)
COMPACT = TWO.replace("\n", "")
REQUIRED = {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}


def accepts(grammar: str, text: str) -> bool:
    """Feed ``text`` byte by byte; True when every byte is allowed and the grammar accepts."""
    compiled, _ = GrammarCompiler(ByteTokenizer()).compile(Constraint("grammar", grammar))
    matcher = compiled.matcher()
    try:
        for byte in text.encode("utf-8"):
            if not matcher.allowed()[byte]:
                return False
            matcher.consume(byte)
    except ConstraintError:  # nothing may follow: the text went past the end
        return False
    return matcher.accepting


def without_ids(choices: list[dict]) -> list[dict]:
    """Return ``choices`` with every call id blanked."""
    return json.loads(re.sub(r'"call_[A-Za-z0-9]{24}"', '"call_"', json.dumps(choices)))


def specs(*tools: dict):
    """Return the tools as the grammar reads them (``name``, ``parameters``)."""
    from wsgi_app.api.tools import parse_tools

    return parse_tools({"tools": list(tools)}).tools


def test_a_template_that_writes_hermes_calls_gets_the_hermes_format():
    qwen = ChatTemplate.from_source(QWEN_TEMPLATE)
    assert qwen.handles_tools and qwen.tool_format == QWEN
    # Its tools and calls are its own: the format is what the template wrote, whatever the setting.
    assert ChatTemplate.from_source(QWEN_TEMPLATE, tool_format="smollm2").tool_format == QWEN
    # A template that does not render tools gets the tool template's, by name (TOOL_CALL_FORMAT).
    plain_chatml = ChatTemplate.from_source("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plain_chatml.tool_format is tool_format("smollm2")
    assert ChatTemplate.default(tool_format="hermes").tool_format == HermesFormat("")
    text = qwen.render(ASK, list(SAMPLE_TOOLS))
    assert "# Tools" in text and text.endswith("<|im_start|>assistant\n")


def test_the_qwen_layout_is_forced_and_read_back():
    tools = specs(WEATHER, TIME)
    grammar = QWEN.grammar(tools)
    assert accepts(grammar, TWO)
    assert not accepts(grammar, COMPACT)  # the template's newlines, nothing else
    assert not accepts(QWEN.grammar(tools, parallel=False), TWO)
    assert accepts(QWEN.grammar(tools, choice="auto"), "Let me look.\n" + TWO)
    assert QWEN.parse_calls(TWO) == tool_format("hermes").parse_calls(COMPACT)
    parser = QWEN.parser(lambda i: f"id{i}")
    for ch in TWO:  # one character at a time, as tokens may split it
        parser.feed(ch)
    assert parser.complete and not parser.broken
    assert [(c.id, c.name, "".join(c.arguments)) for c in parser.calls] == [
        ("id0", "get_weather", '{"city":"Paris","unit":"c"}'),
        ("id1", "get_time", '{"zone":1}'),
    ]
    cut = QWEN.parser()
    cut.feed(TWO[:60])  # inside the first call's arguments
    assert not cut.complete and not cut.broken and [c.name for c in cut.calls] == ["get_weather"]


@pytest.fixture(scope="module")
def hermes_llama(serve_module, tmp_path_factory):
    directory = write_tiny_llama(tmp_path_factory.mktemp("hermes") / "m")
    config = json.loads((directory / "config.json").read_text())  # room for the tools' prompt
    config["max_position_embeddings"] = 2048
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_TEMPLATE}))
    assert load_model(directory).chat_template().tool_format == QWEN
    return serve_module(MODEL_DIR=str(directory), LOG_PROMPTS="1")


def test_forced_calls_in_the_models_format(hermes_llama):
    for body in (
        {**REQUIRED, "seed": 5, "max_tokens": 120},
        {**REQUIRED, "temperature": 0, "max_tokens": 120, "parallel_tool_calls": False},
        {
            **REQUIRED,
            "seed": 2,
            "max_tokens": 120,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ):
        choices = plain(answer(hermes_llama, body))
        streamed = accumulate(stream(hermes_llama, body))
        if "seed" not in body:  # unseeded call ids are random
            streamed, choices = without_ids(streamed), without_ids(choices)
        assert streamed == choices
        (choice,) = choices
        calls = choice["message"]["tool_calls"]
        assert calls and choice["message"]["content"] is None
        if choice["finish_reason"] == "length":  # a block cut by max_tokens: the last call cut
            calls = calls[:-1]
        else:
            assert choice["finish_reason"] == (
                "stop" if "function" in body["tool_choice"] else "tool_calls"
            )
        for call in calls:
            function = call["function"]
            schema = TOOLS[function["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(function["arguments"]), schema)
        if body.get("parallel_tool_calls") is False or "function" in body["tool_choice"]:
            assert len(choice["message"]["tool_calls"]) == 1


def test_the_prompt_is_the_templates_own(hermes_llama):
    history = [*ASK, *called("get_time", '{"zone":1}', "10:00")]
    body = {"model": "m", "messages": history, "tools": [TIME], "max_tokens": 1}
    status, _, raw = hermes_llama.post("/v1/chat/completions", body, headers={"X-Request-Id": "q"})
    assert status == 200, raw
    hermes_llama.wait_idle()
    (line,) = [json.loads(x) for x in hermes_llama.log_text().splitlines() if '"q"' in x]
    assert "# Tools\n\nYou may call one or more functions" in line["prompt"]
    assert (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
        in line["prompt"]
    )
    assert "<|im_start|>user\n<tool_response>\n10:00\n</tool_response><|im_end|>" in line["prompt"]


def test_what_cannot_be_enforced_is_refused(hermes_llama):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    status, _, raw = hermes_llama.post(
        "/v1/chat/completions", {**REQUIRED, "tools": [WEATHER, bad]}
    )
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "tools[1].function.parameters")
