"""model/grammar: the tokenizer bridge, compiled grammars and their cache, the mask in sampling."""

from __future__ import annotations

import numpy as np
import pytest

from model.grammar.cache import GrammarCache
from model.grammar.compile import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    ConstraintError,
    GrammarCompiler,
    MaskViolation,
    entry_bytes,
    grammar_text,
)
from model.loader import load_model
from model.pcg32 import PCG32
from model.sampling import SamplingParams, sample
from model.tokenizer import ByteTokenizer
from tests.llamafiles import convert_stories
from tests.schemas import ENDLESS, RECURSIVE_WITH_AN_END, obj


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    return load_model(convert_stories(tmp_path_factory.mktemp("stories") / "model"))


def test_special_tokens_are_never_text_and_eos_only_where_the_grammar_accepts(stories):
    tok = stories.tokenizer
    grammar, _ = GrammarCompiler(tok).compile(Constraint("regex", "[a-z<>/]+"))
    m = grammar.matcher()
    specials = sorted(tok.special_tokens.values())  # <unk>, <s>, </s>: their names are "<...>"
    row = m.allowed()
    assert not row[specials].any()  # "<s>" is no text, though the regex allows "<", "s" and ">"
    assert row[tok.token_bytes.index(b"s")]
    assert not m.consume(tok.token_bytes.index(b"s"))
    row = m.allowed()
    assert row[sorted(tok.eos_ids)].all() and not row[tok.special_tokens["<unk>"]]


def test_a_complete_grammar_says_so_and_then_allows_nothing_of_the_model():
    grammar, _ = GrammarCompiler(ByteTokenizer()).compile(Constraint("choice", ("ab",)))
    m = grammar.matcher()
    assert not m.consume(ord("a"))
    assert m.consume(ord("b"))  # nothing can follow "ab"
    with pytest.raises(ConstraintError):
        m.allowed()  # only the byte bridge's end marker, which the model cannot produce


def test_json_is_compact():
    grammar, _ = GrammarCompiler(ByteTokenizer()).compile(Constraint("json_object"))
    m = grammar.matcher()
    assert np.flatnonzero(m.allowed()).tolist() == [ord("{")]
    m.consume(ord("{"))
    allowed = set(np.flatnonzero(m.allowed()).tolist())
    assert allowed == {ord('"'), ord("}")}  # no whitespace


def test_the_cache_is_keyed_by_tenant_and_canonical_json():
    compiler = GrammarCompiler(ByteTokenizer())
    a = {"type": "object", "properties": {"x": {"type": "integer"}}}
    first, hit = compiler.compile(Constraint("json_schema", a), "t1")
    assert not hit
    one = compiler.cache.bytes  # its text, and its forced "{" (entry_bytes)
    assert one == entry_bytes(len(grammar_text(Constraint("json_schema", a))), len("{"))
    same, hit = compiler.compile(
        Constraint("json_schema", {"properties": {"x": {"type": "integer"}}, "type": "object"}),
        "t1",
    )
    assert hit and same is first
    other, hit = compiler.compile(Constraint("json_schema", a), "t2")  # another tenant's own
    assert not hit and other is not first
    assert (len(compiler.cache), compiler.cache.bytes) == (2, 2 * one)


def test_the_cache_is_bounded_in_bytes_least_recently_used_first_out():
    cache = GrammarCache(budget_bytes=100, entry_max_bytes=50)
    assert cache.put("a", 1, 40) and cache.put("b", 2, 40)
    assert cache.get("a") == 1  # now the most recently used
    assert cache.put("c", 3, 40)  # 120 bytes: the least recently used goes
    assert (cache.get("b"), cache.get("a"), cache.get("c"), cache.bytes) == (None, 1, 3, 80)
    assert not cache.put("d", 4, 51)  # over entry_max_bytes: not kept, nothing evicted
    assert (cache.get("d"), len(cache), cache.bytes) == (None, 2, 80)


def test_a_grammar_too_large_for_the_cache_is_compiled_but_not_kept():
    choices = tuple(f"choice number {i:04d}" for i in range(1000))  # 23 kB of grammar text
    compiler = GrammarCompiler(ByteTokenizer(), cache_bytes=32 << 20)  # kept up to 1 MiB
    assert entry_bytes(len(grammar_text(Constraint("choice", choices)).encode()), 0) > 1 << 20
    grammar, hit = compiler.compile(Constraint("choice", choices))
    assert not hit and grammar.matcher().allowed().any()
    assert compiler.cached(Constraint("choice", choices)) is None and len(compiler.cache) == 0


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", {"type": "array", "uniqueItems": True}),
        Constraint("json_schema", {"$ref": "#/$defs/x"}),
        Constraint("regex", "(["),
        Constraint("grammar", "start: missing_rule"),
        Constraint("grammar", "root ::= ("),
        Constraint("choice", ()),
        Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1)),
    ],
)
def test_what_cannot_be_enforced_is_refused(constraint):
    with pytest.raises(ConstraintError) as info:
        GrammarCompiler(ByteTokenizer()).compile(constraint)
    assert "\n" not in str(info.value) and len(str(info.value)) <= 300


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", {"const": "abc"}),  # all forced, then complete
        Constraint("json_schema", {"enum": ["only"]}),
        Constraint("json_schema", obj({"k": {"const": "v"}})),
        Constraint("json_schema", obj({"a": {"type": "integer"}, "b": {"type": "boolean"}})),
        Constraint("choice", ("yes",)),
        Constraint("regex", "abc"),
        Constraint("regex", "abc(d)?"),
        Constraint("grammar", 'start: "hello"'),
        # Recursive, with an end: a tree whose "kids" may be empty.
        Constraint(
            "json_schema",
            {
                "$defs": {"t": obj({"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}})},
                "$ref": "#/$defs/t",
            },
        ),
    ],
)
def test_a_forced_start_that_can_end_is_no_refusal(constraint):
    """The check follows a grammar's forced tokens (``compile._check_satisfiable``): one that is
    forced to its end, or through a required property, compiles."""
    grammar, _ = GrammarCompiler(ByteTokenizer()).compile(constraint)
    assert grammar.kind == constraint.kind


@pytest.mark.parametrize("case", list(ENDLESS))
def test_a_schema_without_a_finite_value_is_refused_when_compiled(case):
    """Whether its endless part is on the forced start or past a choice
    (``model.grammar.endless.endless``)."""
    schema, why = ENDLESS[case]
    with pytest.raises(ConstraintError) as info:
        GrammarCompiler(ByteTokenizer()).compile(Constraint("json_schema", schema))
    assert str(info.value) == why


@pytest.mark.parametrize("case", list(RECURSIVE_WITH_AN_END))
def test_a_recursive_schema_with_an_end_compiles(case):
    grammar, _ = GrammarCompiler(ByteTokenizer()).compile(
        Constraint("json_schema", RECURSIVE_WITH_AN_END[case])
    )
    assert grammar.kind == "json_schema"


# Past the choice of "a" or "b", the rest is forced ("ccc..." without end): llguidance's walk of
# the forced output runs out of items while "c" is consumed.
ENDLESS_GRAMMAR = 'start: ("a" | "b") x\nx: "c" x'
FORCED_PAST_LIMITS = (
    "it is past llguidance's parser limits (parser error: Too many items (limit 50000; "
    "ff_tokens): the output forced from here is too long, or endless)"
)


def test_a_token_the_mask_forbade_is_a_mask_violation_one_it_allowed_is_the_constraints():
    compiler = GrammarCompiler(ByteTokenizer())
    m = compiler.compile(Constraint("regex", "ab"))[0].matcher()
    m.allowed()
    with pytest.raises(MaskViolation):
        m.consume(ord("z"))
    m = compiler.compile(Constraint("grammar", ENDLESS_GRAMMAR))[0].matcher()
    assert m.allowed()[ord("a")]
    m.consume(ord("a"))
    assert m.allowed()[ord("c")]
    with pytest.raises(ConstraintError) as info:
        m.consume(ord("c"))
    assert type(info.value) is ConstraintError
    assert str(info.value) == FORCED_PAST_LIMITS


@pytest.mark.parametrize(
    "constraint, why",
    [
        # A valid grammar whose 2,000 alternatives fill an Earley row past max_items_in_row (2,000).
        (
            Constraint("grammar", "start: " + " | ".join(f'"alt{i}"' for i in range(2000))),
            "Parser Error: Current row has 2001 items; max is 2000; consider making your grammar "
            "left-recursive if it's right-recursive",
        ),
        # A forced run of a million a's: the lexer's expressions run out.
        (Constraint("regex", "a{1000}{1000}"), "lexer error: too many expressions constructed"),
    ],
    ids=["alternatives", "repeat"],
)
def test_a_constraint_past_the_parser_limits_is_refused_as_such(constraint, why):
    with pytest.raises(ConstraintError) as info:
        GrammarCompiler(ByteTokenizer()).compile(constraint)
    assert str(info.value) == f"it is past llguidance's parser limits ({why})"


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 0), (1.3, 40)])
def test_the_mask_only_removes_ids(temperature, top_k):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(512).astype(np.float32) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, logit_bias=((7, 5.0),))
    everything = np.ones(512, bool)
    # Allowing every id changes no bit: the same ids from the same uniforms.
    a, b = PCG32(1, 54), PCG32(1, 54)
    assert [sample(logits, params, a) for _ in range(50)] == [
        sample(logits, params, b, None, everything) for _ in range(50)
    ]
    allowed = np.zeros(512, bool)
    allowed[[3, 100, 400]] = True
    draws = {sample(logits, params, PCG32(s, 54), None, allowed) for s in range(200)}
    assert draws <= {3, 100, 400}
