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
are kept by tenant and canonical JSON, least recently used first out, within a budget of estimated
bytes (``model.grammar.cache``, :func:`entry_bytes`).

Compiling can take from ~1 ms to ~0.1 s of CPU for a hostile grammar, within llguidance's limits
(:func:`limits`: grammar size, :data:`LEXER_FUEL`) and the check's (:data:`FORCED_RUNS`,
:data:`FORCED_TOKENS`); llguidance drops the GIL for most of it, but calls back into the tokenizer
bridge (Python) to tokenize forced text. The serving layer runs :meth:`GrammarCompiler.result` on a
pool of its own, never on the event loop or the engine thread.

Source: llguidance docs/json_schema.md and docs/syntax.md (what it enforces); the OpenAI "Structured
Outputs" guide (the request forms).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from model.grammar import schema, tokens
from model.grammar.cache import GrammarCache
from model.grammar.matcher import NO_OUTPUT, ConstraintError, Offload, TokenMatcher, reason

# The server's door to the modules behind this one: what it reads of them, re-exported.
from model.grammar.matcher import PAST_LIMITS as PAST_LIMITS
from model.grammar.matcher import MaskBudget as MaskBudget
from model.grammar.matcher import MaskTooCostly as MaskTooCostly
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
CACHE_BYTES = 64 << 20  # estimated bytes of compiled grammars kept per worker (GRAMMAR_CACHE_MB)
ENTRY_SHARE = 32  # a grammar estimated over this share of the cache is not kept (2 MiB of 64)
# entry_bytes' proxy, calibrated by bench/grammar_cache.py (bytes)
ENTRY_BASE_BYTES = 64 << 10
ENTRY_TEXT_FACTOR = 64  # per byte of llguidance's grammar text
ENTRY_FORCED_FACTOR = 320  # per byte of a forced run
FORCED_RUNS = 8  # runs of forced tokens followed when a grammar is checked (one mask each)
FORCED_TOKENS = 256  # forced tokens followed in all (a longer run is followed that far)
# llguidance's budget for building a grammar's regexes (its initial_lexer_fuel, default 1,000,000):
# the most any valid constraint measured needs is ~23,000 (an enum of 2,000 strings); x{99999990}
# spent 0.5-0.9 s of it on SmolLM2 before failing (tokenizing a 250 kB forced run), ~60 ms now.
LEXER_FUEL = 200_000
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
    """Return the parser limits of every matcher: bounded grammar size and regex-building fuel,
    errors without state."""
    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE, initial_lexer_fuel=LEXER_FUEL, verbose_errors=False
    )


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

    def matcher(
        self, budget: MaskBudget | None = None, offload: Offload | None = None
    ) -> TokenMatcher:
        """Return a fresh matcher at the grammar's start (µs: the compiled grammar is shared),
        charging ``budget`` and computing :meth:`TokenMatcher.next_mask` on ``offload``."""
        return TokenMatcher(self._template.deep_copy(), *self._sizes, budget, offload)


class RequestGrammar:
    """One request's use of a compiled grammar: its choices' matchers, and their mask time.

    The engine calls :meth:`matcher` once per choice (any thread); the serving layer reads
    :attr:`mask_s` when the request is done.

    Args:
        grammar: the compiled grammar (shared by every request with the same constraint).
        budget: the CPU time the request's masks may take (one, and all together); None: no bound.
        offload: where its matchers compute :meth:`TokenMatcher.next_mask` (the bigram's masks,
            off the gevent hub); None for the engine's own thread.
    """

    __slots__ = ("grammar", "kind", "matchers", "budget", "offload")

    def __init__(
        self, grammar: Grammar, budget: MaskBudget | None = None, offload: Offload | None = None
    ) -> None:
        self.grammar = grammar
        self.kind = grammar.kind
        self.matchers: list[TokenMatcher] = []
        self.budget = MaskBudget() if budget is None else budget
        self.offload = offload

    def again(self) -> RequestGrammar:
        """Return another use of the same compiled grammar: its own matchers and a fresh budget of
        the same bounds, on the same offload (the request's generation repeated by a shadow
        variant, charged apart from the request's)."""
        budget = MaskBudget(self.budget.token_s, self.budget.request_s)
        return RequestGrammar(self.grammar, budget, self.offload)

    def matcher(self) -> TokenMatcher:
        """Return a fresh matcher for one more choice of the request."""
        m = self.grammar.matcher(self.budget, self.offload)
        self.matchers.append(m)
        return m

    @property
    def mask_s(self) -> float:
        """CPU seconds spent computing this request's masks, over all its choices."""
        return sum(m.mask_s for m in self.matchers)


def entry_bytes(text_bytes: int, forced_bytes: int) -> int:
    """Return the bytes a cached grammar is charged (llguidance reports no size: a proxy).

    Calibrated against the RSS an entry keeps (``bench/grammar_cache.py``, SmolLM2's and the byte
    tokenizer alike): about 50-80 KiB for a small schema, 25-90 bytes per byte of llguidance's
    grammar text (a 60 kB choice list keeps ~2 MiB, a 400-property schema 0.9-1.4 MiB), and ~300
    bytes per byte of a forced run (``y{6000}``'s text is 104 bytes, its entry 1.7 MiB: llguidance
    builds the run's regex states up front). A choice that is not forced (``[a-z]{1,3000}``) keeps
    almost nothing. Lexer states built later, while generating, come on top (~1-2 KiB each,
    llguidance's figure), bounded by its ``max_lexer_states``.

    Args:
        text_bytes: the UTF-8 bytes of llguidance's grammar text.
        forced_bytes: the bytes of the forced runs the compile-time check met.
    """
    return ENTRY_BASE_BYTES + ENTRY_TEXT_FACTOR * text_bytes + ENTRY_FORCED_FACTOR * forced_bytes


class GrammarCompiler:
    """Compile constraints for one served tokenizer, with a cache of the results bounded in bytes.

    Thread-safe: the bridge tokenizer is built once (on the first compile), and the cache is locked.
    Every entry is keyed by its tenant as well (the prefix cache's salt: the API key's digest and
    the request's ``cache_salt``), so one tenant never gets, nor times, another's compiled grammar.

    Args:
        tokenizer: the served tokenizer.
        cache_bytes: the estimated bytes (:func:`entry_bytes`) the cached grammars and refusals may
            hold together; one over a :data:`ENTRY_SHARE` th of it is not kept.
        mask_token_s: most CPU seconds one token mask may take (``MaskBudget.token_s``): a
            constraint whose first masks, computed by the check, take longer is refused.
        lock: makes the locks shared by the compiling threads and the caller's (default
            ``threading.Lock``); a gevent server passes the native lock, as a monkey-patched one
            taken by native threads can leave a waiter asleep for good.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        cache_bytes: int = CACHE_BYTES,
        mask_token_s: float = float("inf"),
        lock: Callable[[], AbstractContextManager[Any]] = threading.Lock,
    ) -> None:
        self._tokenizer = tokenizer
        self._mask_token_s = mask_token_s
        self._lltok: llguidance.LLTokenizer | None = None
        self.cache = GrammarCache(cache_bytes, cache_bytes // ENTRY_SHARE, lock)
        self._lock = lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built on first use, ~0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = tokens.build(self._tokenizer)
            return self._lltok

    def cached(self, constraint: Constraint, tenant: str = "") -> Grammar | ConstraintError | None:
        """Return what compiling ``constraint`` gave ``tenant`` if it is in the cache (a dict
        lookup): its grammar, or the refusal (refusals are cached too, so a hostile constraint
        sent again costs nothing); None when it is not there."""
        return self.cache.get((tenant, constraint.key()))

    def compile(self, constraint: Constraint, tenant: str = "") -> tuple[Grammar, bool]:
        """Return the grammar of ``constraint`` and whether it came from ``tenant``'s cache.

        Raises:
            ConstraintError: llguidance cannot enforce it (the message is llguidance's, on one
                line, without grammar state), or it is over the limits.
        """
        found = self.cached(constraint, tenant)
        hit = found is not None
        if found is None:
            found = self.result(constraint, tenant)
        if isinstance(found, ConstraintError):
            raise found
        return found, hit

    def result(self, constraint: Constraint, tenant: str = "") -> Grammar | ConstraintError:
        """Compile ``constraint`` (no cache lookup) and cache the outcome for ``tenant`` (unless
        it is too large to keep); return the grammar or the refusal, never raising it (a thread
        pool would print a raised one)."""
        lltok = self.lltokenizer
        start = time.perf_counter()
        outcome: Grammar | ConstraintError
        key = constraint.key()
        size = ENTRY_BASE_BYTES + len(key)  # a refusal keeps its message
        try:
            text = grammar_text(constraint)
            template = llguidance.LLMatcher(lltok, text, log_level=0, limits=limits())
            if template.is_error():
                raise ConstraintError(template.get_error())
            sizes = (self._tokenizer.vocab_size, lltok.vocab_size)
            outcome = Grammar(constraint.kind, template, sizes, time.perf_counter() - start)
            forced = _check_satisfiable(outcome, self._mask_token_s)
            size = entry_bytes(len(text.encode()), len(lltok.decode_bytes(forced)))
        except MaskTooCostly as exc:  # anew: the raised one's traceback holds the grammar
            outcome = MaskTooCostly(str(exc), exc.limit)
        except ValueError as exc:  # ConstraintError, or llguidance's for a value it cannot read
            outcome = ConstraintError(_short(str(exc)))
        self.cache.put((tenant, key), outcome, size)
        return outcome


def _check_satisfiable(grammar: Grammar, mask_token_s: float) -> list[int]:
    """Compute ``grammar``'s first mask, and its mask after each run of tokens every output must
    start with (llguidance's forced tokens, up to :data:`FORCED_RUNS` runs and
    :data:`FORCED_TOKENS` tokens: a forced run as long as an answer is not walked token by token,
    nor its lexer states built and kept with the grammar), so a constraint that can never be met is
    refused when compiled, not found while generating: a grammar whose rules only refer to
    themselves, a regex no text matches, and one past llguidance's parser or lexer limits on that
    path (the reason says which: :func:`model.grammar.matcher.reason`). A schema without a finite
    value was refused before (``model.grammar.endless.endless``); a grammar whose endless rule comes
    after a choice is found only while generating, where it ends the choice with a 400 naming the
    constraint (``wsgi_app.generation.grammars.constraint_failure``). A constraint that can be met
    but one of whose masks here took longer than ``mask_token_s`` of CPU is refused too (every
    request would end at that mask: ``model.grammar.matcher.MaskBudget``).

    Returns:
        The forced tokens met, each run whole (also past :data:`FORCED_TOKENS`).

    Raises:
        ConstraintError: a mask on the forced path is an error or allows no token of the model.
        MaskTooCostly: else, a mask on the forced path took longer than ``mask_token_s``.
    """
    probe = grammar.matcher()
    worst_s = 0.0

    def mask() -> None:
        nonlocal worst_s
        before = probe.mask_s
        probe.allowed()
        worst_s = max(worst_s, probe.mask_s - before)

    forced: list[int] = []
    walked = 0
    try:
        mask()
        for _ in range(FORCED_RUNS):
            whole = probe.forced()
            run = whole[: max(0, FORCED_TOKENS - walked)]
            if not run:
                break  # none, or the rest of a run already counted whole
            forced += whole
            walked += len(run)
            if any(probe.consume(token_id) for token_id in run):
                break  # complete: nothing can follow (a const, a choice of one)
            mask()
    except ConstraintError:
        why = reason(probe.error())
        if why == NO_OUTPUT:
            why = f"can never be satisfied: {why}"
        raise ConstraintError(why) from None
    MaskBudget(token_s=mask_token_s).charge(worst_s)  # raises MaskTooCostly past the bound
    return forced


def _short(message: str, limit: int = 300) -> str:
    """Return llguidance's error message on one line, at most ``limit`` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
