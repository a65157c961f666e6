"""How generated text becomes content and tool calls, piece by piece (no server): the call parser of
both syntaxes fed in every split, the content filter's hold-back of a possible opening tag, stop
strings that end the content but never apply inside a block, and the tool grammar's refusals named
by ``GrammarService``."""

from __future__ import annotations

import pytest

from model.grammar.compile import Constraint
from model.sampling import SamplingParams
from model.stop import StopMatcher
from model.tokenizer import ByteTokenizer
from model.tool_formats import tool_format
from telemetry.spans import start_server_span
from wsgi_app.api.completions import CompletionRequest
from wsgi_app.api.errors import ApiError
from wsgi_app.api.structured import RequestConstraint
from wsgi_app.api.tools import parse_tools
from wsgi_app.generation.grammars import GrammarService, tool_constraint
from wsgi_app.generation.inputs import generation_input
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.tool_calls import CallFilter

TWO = (
    '<tool_call>[{"name":"get_weather","arguments":{"city":"P\\"a}ris","n":[1,{"a":2}]}},'
    '{"name":"get_time","arguments":{}}]</tool_call>'
)
HERMES_TWO = (
    '<tool_call>{"name":"get_weather","arguments":{"city":"P\\"a}ris","n":[1,{"a":2}]}}</tool_call>'
    '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
)
WEATHER_ARGS = '{"city":"P\\"a}ris","n":[1,{"a":2}]}'


def CallParser(fmt="smollm2", new_id=lambda i: ""):  # noqa: N802 - the parser's former class
    return tool_format(fmt).parser(new_id)


def feed(parser, text: str, size: int) -> list[tuple[int, str | None]]:
    events = []
    for i in range(0, len(text), size):
        parser.feed(text[i : i + size])
        events += parser.take_events()
    return events


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("fmt", "block"), [("smollm2", TWO), ("hermes", HERMES_TWO)])
def test_every_split_reads_the_same_calls_and_events(fmt, block, size):
    parser = CallParser(fmt, lambda i: f"id{i}")
    events = feed(parser, block, size)
    assert parser.complete and not parser.broken
    assert [(c.id, c.name, "".join(c.arguments)) for c in parser.calls] == [
        ("id0", "get_weather", WEATHER_ARGS),
        ("id1", "get_time", "{}"),
    ]
    # Each call starts once, then its fragments follow, never another call's in between.
    starts = [e for e in events if e[1] is None]
    assert starts == [(0, None), (1, None)]
    for index in (0, 1):
        fragments = [f for i, f in events if i == index and f is not None]
        assert "".join(fragments) == "".join(parser.calls[index].arguments)
    assert events.index((1, None)) > max(k for k, e in enumerate(events) if e[0] == 0)


def test_a_cut_block_keeps_its_calls_as_far_as_they_came():
    parser = CallParser()
    parser.feed('<tool_call>[{"name":"get_weather","arguments":{"city":"Pa')
    assert not parser.complete and not parser.broken
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", ['{"city":"Pa'])]
    # A call is noted once its name and the "arguments" key after it are read (the README's words).
    for cut in ('<tool_call>[{"name":"get_wea', '<tool_call>[{"name":"get_weather","argum'):
        short = CallParser()
        short.feed(cut)
        assert short.calls == [] and not short.broken
    at_key = CallParser()
    at_key.feed('<tool_call>[{"name":"get_weather","arguments":')
    assert [(c.name, c.arguments) for c in at_key.calls] == [("get_weather", [])]


def test_hermes_between_blocks_is_complete_until_another_block_opens():
    parser = CallParser("hermes")
    parser.feed('<tool_call>{"name":"f","arguments":{}}</tool_call><tool_')
    assert parser.complete
    parser.feed('call>{"name":"g","arg')
    assert not parser.complete and [c.name for c in parser.calls] == ["f"]


@pytest.mark.parametrize(
    "text", ["<tool_call>{", "<tool_call>[]</tool_call>", TWO + "x", "<tool_call>[{'name'"]
)
def test_text_the_syntax_does_not_allow_breaks_the_block(text):
    parser = CallParser()
    parser.feed(text)
    assert parser.broken


def content_of(filt: CallFilter, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for piece in pieces:
        released, stopped = filt.push(piece)
        out.append(released)
        if stopped:
            return out, True
    out.append(filt.flush())
    return out, False


def test_content_is_held_back_from_the_first_byte_of_a_possible_tag():
    filt = CallFilter(StopMatcher(()), CallParser())
    out, _ = content_of(filt, ["Let me look <", "tool", "_call>[", '{"name":"f","arguments":{}}]'])
    assert out == ["Let me look ", "", "", "", ""]
    assert filt.in_block and [c.name for c in filt.parser.calls] == ["f"]
    # A "<" that turns out to be text is released as soon as it cannot start the tag.
    plain = CallFilter(StopMatcher(()), CallParser())
    assert content_of(plain, ["a <", "b", " <tool", "!"]) == (
        ["a ", "<b", " ", "<tool!", ""],
        False,
    )
    assert content_of(CallFilter(StopMatcher(()), CallParser()), ["x <tool_"]) == (
        ["x ", "<tool_"],
        False,
    )


def test_stop_strings_end_the_content_and_never_apply_inside_the_block():
    filt = CallFilter(StopMatcher(("}",)), CallParser())
    out, stopped = content_of(filt, ['<tool_call>[{"name":"f","arguments":{"a":"}"}}]</tool_call>'])
    assert (out, stopped) == (["", ""], False)
    assert "".join(filt.parser.calls[0].arguments) == '{"a":"}"}'
    stop = CallFilter(StopMatcher(("ok",)), CallParser())
    assert content_of(stop, ["fine, o", "k <tool_call>["]) == (["fine, ", ""], True)
    assert stop.parser.calls == [] and not stop.in_block
    # A stop prefix just before the tag is content: the tag ends the text.
    held = CallFilter(StopMatcher(("ab",)), CallParser())
    assert content_of(held, ["xa<tool_call>["]) == (["xa", ""], False)


def test_under_auto_a_block_the_parser_cannot_read_is_content():
    filt = CallFilter(StopMatcher(("!",)), CallParser())
    out, stopped = content_of(filt, ["so <tool", "_call>[hi", " <tool_call> more!", "x"])
    assert (out, stopped) == (["so ", "<tool_call>[hi", " <tool_call> more"], True)
    assert filt.parser.calls == [] and not filt.in_block
    # Once a call is read the block stays a block, whatever follows.
    read = CallFilter(StopMatcher(()), CallParser())
    assert content_of(read, ['<tool_call>[{"name":"f","arguments":{}}]</tool_call>x']) == (
        ["", ""],
        False,
    )
    assert [c.name for c in read.parser.calls] == ["f"]
    # required / named: never content.
    forced = CallFilter(StopMatcher(()), CallParser(), in_block=True)
    assert content_of(forced, ["<tool_call>hi"]) == (["", ""], False)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def bad(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "bad", "parameters": schema}}


def prepared(service: GrammarService, body: dict, constraint: Constraint | None = None):
    req = CompletionRequest(
        model="m",
        prompt_ids=(1,),
        prompt_text="x",
        max_tokens=8,
        sampling=SamplingParams(),
        seed=None,
        constraint=None if constraint is None else RequestConstraint(constraint, "response_format"),
    )
    req = generation_input(req, parse_tools(body), tool_format("hermes"))
    record = RequestRecord("r", start_server_span("POST /v1/chat/completions", None, {}))
    return req, service.prepare(req, record), record


@pytest.fixture(scope="module")
def service():
    return GrammarService(ByteTokenizer())


@pytest.mark.parametrize(
    ("body", "param", "why"),
    [
        (
            {
                "tools": [
                    WEATHER,
                    WEATHER | {"function": {"name": "w2"}},
                    bad({"properties": {"a": {"type": "nope"}}}),
                ]
            },
            "tools[2].function.parameters",
            "Invalid type",
        ),
        (
            {"tools": [WEATHER, bad({"type": "object", "maxLenght": 3})]},
            "tools[1].function.parameters",
            "uses 'maxLenght' at #, which is not a JSON Schema keyword enforced here",
        ),
        (
            {"functions": [bad({"properties": {"a": {"pattern": "(?=a)"}}})["function"]]},
            "functions[0].parameters",
            "look-around",
        ),
    ],
)
def test_a_schema_that_cannot_be_enforced_names_its_tool(service, body, param, why):
    with pytest.raises(ApiError) as info:
        prepared(service, body)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"'{param}' cannot be enforced: ")
    assert why in info.value.message


def test_the_text_constraint_is_named_when_it_alone_fails(service):
    with pytest.raises(ApiError) as info:
        prepared(service, {"tools": [WEATHER]}, Constraint("regex", "(?=x)"))
    assert info.value.param == "response_format"


def test_a_tool_request_gets_its_grammar_and_format(service):
    req, grammar, record = prepared(service, {"tools": [WEATHER], "tool_choice": "required"})
    assert (req.tool_format.name, req.calls_tools, record.constraint) == (
        "hermes",
        True,
        "tool_calls",
    )
    assert grammar is not None and record.grammar is grammar
    # "none" with a text constraint is that constraint alone; without one, text without the tag.
    text = Constraint("json_object")
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert tool_constraint(none, tool_format("smollm2"), text) is text
    req, _, record = prepared(service, {"tools": [WEATHER], "tool_choice": "none"})
    assert (req.calls_tools, record.constraint) == (False, "tool_calls")
