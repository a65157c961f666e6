"""The tool-call syntax: the grammar forcing a block of calls (compiled by llguidance over the byte
tokenizer), the parser of both output syntaxes, and the call ids."""

from __future__ import annotations

import re

import pytest

from model.grammar.compile import Constraint, GrammarCompiler
from model.grammar.matcher import ConstraintError
from model.tokenizer import ByteTokenizer
from model.tool_formats import ParsedCall, tool_format
from model.tool_formats.ids import call_id, prompt_digest
from wsgi_app.api.tools import Tool

WEATHER = Tool(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
TIME = Tool("get_time", None, {"type": "object", "properties": {}, "additionalProperties": False})
COMPILER = GrammarCompiler(ByteTokenizer())


def accepts(grammar: str, text: str) -> bool:
    """Feed ``text`` byte by byte; True when every byte is allowed and the grammar accepts."""
    compiled, _ = COMPILER.compile(Constraint("grammar", grammar))
    matcher = compiled.matcher()
    try:
        for byte in text.encode("utf-8"):
            if not matcher.allowed()[byte]:
                return False
            matcher.consume(byte)
    except ConstraintError:
        return False
    return matcher.accepting


def call_grammar(tools, fmt="smollm2", **kwargs):
    return tool_format(fmt).grammar(tools, **kwargs)


def parse_calls(block, fmt="smollm2"):
    return tool_format(fmt).parse_calls(block)


def split_text(text):
    return tool_format("smollm2").split_text(text)


ONE = '<tool_call>[{"name":"get_weather","arguments":{"city":"Paris"}}]</tool_call>'
TWO = (
    '<tool_call>[{"name":"get_weather","arguments":{"city":"Paris"}},'
    '{"name":"get_time","arguments":{}}]</tool_call>'
)
HERMES_TWO = (
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
)


def test_smollm2_grammar_allows_calls_to_the_tools_with_valid_arguments():
    grammar = call_grammar([WEATHER, TIME])
    assert accepts(grammar, ONE)
    assert accepts(grammar, TWO)
    assert not accepts(grammar, '<tool_call>[{"name":"get_news","arguments":{}}]</tool_call>')
    assert not accepts(grammar, '<tool_call>[{"name":"get_weather","arguments":{}}]</tool_call>')
    assert not accepts(grammar, "<tool_call>[]</tool_call>")  # a block holds at least one call
    assert not accepts(grammar, "Sunny." + ONE)  # required: the block from the first byte


def test_parallel_false_allows_one_call():
    grammar = call_grammar([WEATHER, TIME], parallel=False)
    assert accepts(grammar, ONE)
    assert not accepts(grammar, TWO)


def test_hermes_grammar_writes_one_object_per_block():
    assert accepts(call_grammar([WEATHER, TIME], "hermes"), HERMES_TWO)
    assert not accepts(call_grammar([WEATHER, TIME], "hermes", parallel=False), HERMES_TWO)
    assert not accepts(call_grammar([WEATHER, TIME], "hermes"), TWO)


def test_parse_both_syntaxes():
    calls = [
        ParsedCall("get_weather", '{"city":"Paris"}'),
        ParsedCall("get_time", "{}"),
    ]
    assert parse_calls(TWO) == calls
    assert parse_calls(HERMES_TWO, "hermes") == calls
    assert split_text("Let me look. " + ONE) == ("Let me look. ", ONE)
    assert split_text("no call") == ("no call", None)
    with pytest.raises(ValueError):
        parse_calls('<tool_call>[{"name":"get_weather","argu')  # cut by max_tokens
    with pytest.raises(ValueError):
        parse_calls("<tool_call>[]</tool_call>")


def test_call_ids_derive_from_seed_prompt_choice_and_index():
    ids = {call_id(7, c, i) for c in range(3) for i in range(3)}
    assert len(ids) == 9
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert call_id(7, 1, 2) == call_id(7, 1, 2) != call_id(8, 1, 2)
    assert call_id(None, 0, 0) != call_id(None, 0, 0)
    turn1, turn2 = prompt_digest([1, 2, 3]), prompt_digest([1, 2, 3, 4])
    assert turn1 == prompt_digest((1, 2, 3)) != turn2
    assert call_id(7, 0, 0, turn1) == call_id(7, 0, 0, turn1) != call_id(7, 0, 0, turn2)


def test_auto_lets_text_start_and_takes_over_at_the_opening_tag():
    for fmt, block in (("smollm2", ONE), ("hermes", HERMES_TWO)):
        grammar = call_grammar([WEATHER, TIME], fmt, choice="auto")
        assert accepts(grammar, "Sunny, I think.")
        assert accepts(grammar, "Let me look. " + block)
        assert accepts(grammar, block)
        # Once the tag is written, only a valid block may follow.
        assert not accepts(grammar, "a <tool_call> b")
        assert not accepts(grammar, '<tool_call>[{"name":"get_news","arguments":{}}]</tool_call>')


def test_none_makes_the_tool_syntax_impossible():
    grammar = call_grammar([WEATHER], choice="none")
    assert accepts(grammar, "Sunny in Paris.")
    assert not accepts(grammar, ONE)
    assert not accepts(grammar, "x <tool_call>")
