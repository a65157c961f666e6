"""Constraints compiled into grammars: one :class:`Grammar` per distinct constraint, cached per worker.

A :class:`Constraint` is what a request asks for (a JSON Schema, any JSON object, a regex, a choice
of strings, a Lark grammar), already in its canonical form. :class:`GrammarCompiler` turns it into
llguidance's grammar and a template matcher, refusing what llguidance cannot enforce exactly: a
schema it cannot compile, a keyword it does not implement (``lenient`` is never on: a tool that is
not strict has such keywords left out before, where the request names them), a regex or
grammar that does not parse, or anything over :data:`MAX_CONSTRAINT_BYTES` and the parser limits;
a schema is read first for what llguidance would skip, misread or never end
(``model.grammar.schema``).
JSON is compact: no whitespace outside strings, ``,`` and ``:`` as separators; ``oneOf`` is refused
unless llguidance can prove its branches disjoint (``coerce_one_of`` stays off). Compiled grammars
are kept in a bounded LRU keyed by the constraint's canonical JSON.

Compiling can take from ~1 ms to ~1 s for a hostile grammar (llguidance drops the GIL meanwhile); the
serving layer runs :meth:`GrammarCompiler.compile` on a thread of its own, never on the event loop or
the engine thread.

Source: llguidance docs/json_schema.md and docs/syntax.md (what it enforces); the OpenAI "Structured
Outputs" guide (the request forms).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from model.grammar import schema, tokens
from model.grammar.matcher import NO_OUTPUT, ConstraintError, TokenMatcher, reason

# The server's door to the modules behind this one: what it reads of them, re-exported.
from model.grammar.matcher import PAST_LIMITS as PAST_LIMITS
from model.grammar.matcher import MaskViolation as MaskViolation
from model.grammar.schema import arguments_schema as arguments_schema
from model.grammar.schema import closed as closed
from model.grammar.schema import open_object as open_object
from model.grammar.schema import unknown_keyword as unknown_keyword
from model.grammar.schema import without_unimplemented as without_unimplemented
from model.tokenizer import TextTokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
MAX_CONSTRAINT_BYTES = 64 * 1024  # canonical JSON of a schema, or a regex/grammar/choice list
MAX_CHOICES = 1024
MAX_GRAMMAR_SIZE = 100_000  # llguidance grammar symbols (its default is 500 000)
CACHE_SIZE = 256  # compiled grammars kept per worker
FORCED_RUNS = 8  # runs of forced tokens followed when a grammar is checked (one mask each)
# JSON output options that no schema's "x-guidance" may change: compact, strict, exact.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "coerce_one_of": False,
    "lenient": False,
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's output constraint, validated for shape (not yet compiled).

    Attributes:
        kind: one of :data:`KINDS`.
        value: the schema (a dict) for ``json_schema``; None for ``json_object``; the pattern for
            ``regex``; a tuple of strings for ``choice``; the Lark text for ``grammar``; for
            ``tool_calls`` (``model.tool_formats``) ``(lark, text)``: the tool-call grammar's
            Lark text, and the constraint its ``@text`` rule stands for (None when it has none).
    """

    kind: str
    value: Any = None

    def key(self) -> str:
        """Return the canonical JSON of the constraint: the cache key, equal for equal constraints."""
        return json.dumps(_plain(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain(value: Any) -> Any:
    """Return ``value`` as JSON sees it: a constraint as ``[kind, value]``, tuples as lists."""
    if isinstance(value, Constraint):
        return [value.kind, _plain(value.value)]
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def grammar_text(constraint: Constraint) -> str:
    """Return llguidance's grammar for ``constraint`` (not yet checked against a tokenizer).

    Raises:
        ConstraintError: over :data:`MAX_CONSTRAINT_BYTES` or :data:`MAX_CHOICES`, an empty choice,
            a kind outside :data:`KINDS`, or a schema :func:`model.grammar.schema.refusal` refuses.
    """
    kind, value = constraint.kind, constraint.value
    if len(constraint.key().encode("utf-8")) > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"is over the limit of {MAX_CONSTRAINT_BYTES} bytes")
    if kind == "json_schema":
        why = schema.refusal(value)  # what llguidance would skip, misread or never end
        if why is not None:
            raise ConstraintError(why)
        return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not value or len(value) > MAX_CHOICES or any(not s for s in value):
            raise ConstraintError(f"must hold 1..{MAX_CHOICES} non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(s) for s in value)
        )
    if kind == "grammar":
        try:  # llama.cpp's and xgrammar's GBNF becomes Lark; Lark passes as is
            lark = any_to_lark(value)
        except Exception as exc:  # noqa: BLE001 - the converter raises whatever it meets
            raise ConstraintError(f"cannot read the GBNF grammar: {exc}") from None
        code = _outside_literals(lark)
        if _TOKEN_REF.search(code):
            raise ConstraintError(
                "names a special token or a token id (<...>): a constrained span is text only"
            )
        for found in _JSON_RULE.finditer(code):  # a %json schema is read as any schema is
            try:
                embedded, _ = json.JSONDecoder().raw_decode(lark, found.end())
            except ValueError:
                continue  # llguidance says what is wrong with it
            why = schema.refusal(embedded)
            if why is not None:
                raise ConstraintError(f"its %json schema at offset {found.start()}: {why}")
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind == "tool_calls":
        lark, text = value
        if text is None:
            return llguidance.LLMatcher.grammar_from_lark(lark)
        # The text answer's grammar joins as a named grammar the Lark refers to as @text.
        return json.dumps({"grammars": [{"lark_grammar": lark}, _named(grammar_text(text))]})
    raise ConstraintError(f"kind {kind!r} is not one of {', '.join(KINDS)}")


def _named(grammar: str, name: str = "text") -> dict[str, Any]:
    """Return the one grammar of llguidance's grammar text ``grammar`` (its JSON top-level grammar
    or plain Lark) as an entry of a top-level grammar's ``grammars`` list, named ``name``."""
    if not grammar.lstrip().startswith("{"):
        return {"name": name, "lark_grammar": grammar}
    (entry,) = json.loads(grammar)["grammars"]  # every kind's grammar is one grammar
    return {**entry, "name": name}


_TOKEN_REF = re.compile(r"<\s*[\[|A-Za-z/]")
_JSON_RULE = re.compile(r"%json\s*")  # Lark's inline JSON Schema, llguidance's extension


def _outside_literals(lark: str) -> str:
    """Return ``lark`` with its string and regex literals and its comments blanked out, each by as
    many spaces (offsets are the text's)."""
    return re.sub(
        r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[a-z]*|//[^\n]*',
        lambda m: " " * len(m.group()),
        lark,
    )


def limits() -> llguidance.LLParserLimits:
    """Return the parser limits of every matcher: bounded grammar size, errors without state."""
    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)


class Grammar:
    """A compiled constraint: makes one :class:`TokenMatcher` per choice (a copy of its template).

    Attributes:
        kind: the constraint's kind (for logs and metrics).
        compile_s: seconds its compilation took.
    """

    __slots__ = ("kind", "compile_s", "_template", "_sizes")

    def __init__(
        self, kind: str, template: llguidance.LLMatcher, sizes: tuple[int, int], compile_s: float
    ) -> None:
        self.kind = kind
        self.compile_s = compile_s
        self._template = template
        self._sizes = sizes  # (model vocabulary, bridge vocabulary)

    def matcher(self) -> TokenMatcher:
        """Return a fresh matcher at the grammar's start (µs: the compiled grammar is shared)."""
        return TokenMatcher(self._template.deep_copy(), *self._sizes)


class RequestGrammar:
    """One request's use of a compiled grammar: its choices' matchers, and their mask time.

    The engine calls :meth:`matcher` once per choice (any thread); the serving layer reads
    :attr:`mask_s` when the request is done.

    Args:
        grammar: the compiled grammar (shared by every request with the same constraint).
    """

    __slots__ = ("grammar", "kind", "matchers")

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.kind = grammar.kind
        self.matchers: list[TokenMatcher] = []

    def matcher(self) -> TokenMatcher:
        """Return a fresh matcher for one more choice of the request."""
        m = self.grammar.matcher()
        self.matchers.append(m)
        return m

    @property
    def mask_s(self) -> float:
        """Seconds spent computing this request's masks, over all its choices."""
        return sum(m.mask_s for m in self.matchers)


class GrammarCompiler:
    """Compile constraints for one served tokenizer, with a bounded LRU of the results.

    Thread-safe: the bridge tokenizer is built once (on the first compile), and the cache is locked.

    Args:
        tokenizer: the served tokenizer.
        cache_size: compiled grammars kept.
    """

    def __init__(self, tokenizer: TextTokenizer, cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built on first use, ~0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = tokens.build(self._tokenizer)
            return self._lltok

    def cached(self, constraint: Constraint) -> Grammar | ConstraintError | None:
        """Return what compiling ``constraint`` gave if it is in the cache (a dict lookup): its
        grammar, or the refusal (refusals are cached too, so a hostile constraint sent again costs
        nothing); None when it is not there."""
        key = constraint.key()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def compile(self, constraint: Constraint) -> tuple[Grammar, bool]:
        """Return the grammar of ``constraint`` and whether it came from the cache.

        Raises:
            ConstraintError: llguidance cannot enforce it (the message is llguidance's, on one
                line, without grammar state), or it is over the limits.
        """
        found = self.cached(constraint)
        hit = found is not None
        if found is None:
            found = self.result(constraint)
        if isinstance(found, ConstraintError):
            raise found
        return found, hit

    def result(self, constraint: Constraint) -> Grammar | ConstraintError:
        """Compile ``constraint`` (no cache lookup) and cache the outcome; return the grammar or the
        refusal, never raising it (a thread pool would print a raised one)."""
        lltok = self.lltokenizer
        start = time.perf_counter()
        outcome: Grammar | ConstraintError
        try:
            text = grammar_text(constraint)
            template = llguidance.LLMatcher(lltok, text, log_level=0, limits=limits())
            if template.is_error():
                raise ConstraintError(template.get_error())
            sizes = (self._tokenizer.vocab_size, lltok.vocab_size)
            outcome = Grammar(constraint.kind, template, sizes, time.perf_counter() - start)
            _check_satisfiable(outcome)
        except ValueError as exc:  # ConstraintError, or llguidance's for a value it cannot read
            outcome = ConstraintError(_short(str(exc)))
        with self._lock:
            self._cache[constraint.key()] = outcome
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return outcome


def _check_satisfiable(grammar: Grammar) -> None:
    """Compute ``grammar``'s first mask, and its mask after each run of tokens every output must
    start with (llguidance's forced tokens, up to :data:`FORCED_RUNS` runs), so a constraint that
    can never be met is refused when compiled, not found while generating: a grammar whose rules
    only refer to themselves, a regex no text matches, and one past llguidance's parser limits on
    that path (the reason says which: :func:`model.grammar.matcher.reason`). A schema without a
    finite value was refused before (``model.grammar.schema.endless``); a grammar whose endless
    rule comes after a choice is found only while generating, where it ends the choice with a 400
    naming the constraint (``wsgi_app.generation.grammars.constraint_failure``).

    Raises:
        ConstraintError: a mask on the forced path is an error or allows no token of the model.
    """
    probe = grammar.matcher()
    try:
        probe.allowed()
        for _ in range(FORCED_RUNS):
            run = probe.forced()
            if not run:
                break
            if any(probe.consume(token_id) for token_id in run):
                break  # complete: nothing can follow (a const, a choice of one)
            probe.allowed()
    except ConstraintError:
        why = reason(probe.error())
        if why == NO_OUTPUT:
            why = f"can never be satisfied: {why}"
        raise ConstraintError(why) from None


def _short(message: str, limit: int = 300) -> str:
    """Return llguidance's error message on one line, at most ``limit`` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
