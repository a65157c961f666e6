"""A worker's grammar compiler for structured outputs and tool calls: compiled off the event loop,
cached, refused with a 400 naming the field.

Compiling a constraint takes ~1 ms for a typical schema and up to ~0.1 s of CPU for a hostile one
(within llguidance's limits, ``model.grammar.compile``; the first one of a worker also builds
llguidance's view of the tokenizer, ~0.5 s for a 49k vocabulary), so
it runs on a small native pool (``wsgi_app.generation.compile_pool``: shared fairly between clients,
one compile per constraint, waited for within the request's deadline), never on the gevent hub and
never on the engine thread: other requests and running streams do not wait for it. A grammar
already in the tenant's cache (``model.grammar.compile``) is taken on the hub at once. Everything
happens before admission, so a refusal is a 400 before any byte, and nothing holds a slot
meanwhile.

A request with ``tools`` is constrained by its tool-call grammar (:func:`tool_constraint`, written
by the model's tool-call format, ``model.tool_formats``: the tools' ``parameters`` schemas, the
request's text constraint for a text answer); a schema llguidance cannot enforce is a 400 naming
that tool's ``parameters``. Every tool's schema is checked so, whatever ``tool_choice`` says (as
OpenAI validates them): each compiles alone (cached, ~1 ms for a typical schema), while only the
callable tools join the tool-call grammar.

A constraint that compiles but is found to admit no output only while generating (past a choice:
``model.grammar.compile`` checks its forced start) ends the request with the same kind of 400
(:func:`constraint_failure`), raised from ``Completion.chunks``.

Token masks are charged to their request (``model.grammar.matcher.MaskBudget``): one mask may take
at most ``MAX_MASK_TOKEN_S`` of CPU and all of a request's masks together ``MAX_MASK_REQUEST_S``.
A constraint whose first masks (computed when it is compiled) cross the first bound is refused with
that 400 before admission; one that crosses a bound while generating ends its request with it
(``model.grammar.matcher.MaskTooCostly``), so its cost stays its own. The bigram computes its masks
on a native pool of its own (:data:`MASK_THREADS`), never on the gevent hub; the Llama engine on its
engine thread.

Source: docs/ARCHITECTURE.md §6 (where the mask sits), §14 (tool calls), §15 (heavy work off the hub).
"""

from __future__ import annotations

import time
from typing import Any

from gevent.monkey import get_original
from gevent.threadpool import ThreadPool

from model.grammar.compile import (
    CACHE_BYTES,
    MAX_CONSTRAINT_BYTES,
    NO_OUTPUT,
    PAST_LIMITS,
    Constraint,
    ConstraintError,
    Grammar,
    GrammarCompiler,
    MaskBudget,
    MaskTooCostly,
    RequestGrammar,
    arguments_schema,
    unknown_keyword,
)
from model.tool_formats import ToolFormat
from wsgi_app.api.errors import ApiError, invalid, timeout_error
from wsgi_app.api.tools import ToolRequest
from wsgi_app.generation.compile_pool import CompilePool
from wsgi_app.generation.faults import spin
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.record import RequestRecord
from wsgi_app.server.end_reason import DEADLINE

# The native (never monkey-patched) lock, for what native threads share with the event loop.
_native_lock = get_original("_thread", "allocate_lock")
MASK_THREADS = 2  # the bigram's masks: a costly one does not hold up every other request's
# The settings that bound a request's mask time, by MaskTooCostly.limit (named in its 400).
MASK_SETTINGS = {"token": "MAX_MASK_TOKEN_S", "request": "MAX_MASK_REQUEST_S"}


class GrammarService:
    """Compile the output constraints of one worker's requests.

    Args:
        tokenizer: the served tokenizer (``LoadedModel.tokenizer``).
        cache_bytes: the estimated bytes compiled grammars may keep (``GRAMMAR_CACHE_MB``).
        mask_token_s: most CPU seconds one token mask may take (``MAX_MASK_TOKEN_S``).
        mask_request_s: most CPU seconds a request's masks may take together
            (``MAX_MASK_REQUEST_S``).
        inline: the engine runs on the request's greenlet (the bigram): masks are computed on a
            native pool of :data:`MASK_THREADS`, off the hub.
        timeout_s: the requests' deadline from arrival (``REQUEST_TIMEOUT_S``): a request waits
            for its grammar until then.
        compile_spin_s: test hook (``GREENSERVE_FAULTS`` ``compile_spin_s``): CPU seconds every
            compile also spins on its thread; 0 for none.
    """

    def __init__(
        self,
        tokenizer: Any,
        cache_bytes: int = CACHE_BYTES,
        mask_token_s: float = float("inf"),
        mask_request_s: float = float("inf"),
        inline: bool = False,
        timeout_s: float = float("inf"),
        compile_spin_s: float = 0.0,
    ) -> None:
        # The native lock: the compile pool's threads and the event loop share the cache, and a
        # monkey-patched lock taken by native threads can leave a waiter asleep for good.
        self.compiler = GrammarCompiler(tokenizer, cache_bytes, mask_token_s, _native_lock)
        self._pool = CompilePool()
        self._timeout_s = timeout_s
        self._compile_spin_s = compile_spin_s
        self._mask_token_s = mask_token_s
        self._mask_request_s = mask_request_s
        self._mask_pool: ThreadPool | None = ThreadPool(MASK_THREADS) if inline else None

    def _offload(self, func: Any) -> Any:
        """Start ``func`` on the mask pool; return its result's ``get`` (the waiting greenlet
        yields to the hub; ``func``'s exception is raised there)."""
        return self._mask_pool.spawn(func).get

    def prepare(
        self, req: GenerationInput, record: RequestRecord, tenant: str = "", client: str = ""
    ) -> RequestGrammar | None:
        """Return the grammar every choice of ``req`` keeps to, or None when it has no constraint.

        Compiled grammars are cached per ``tenant`` (the prefix cache's salt,
        ``wsgi_app.http.auth.cache_salt``): one tenant never reuses, nor times, another's. A
        grammar not in the cache is compiled in ``client``'s line of the compile pool
        (``wsgi_app.http.client_identity``), waited for until the request's deadline.

        A request with tools gets the tool-call grammar of its ``tool_format``. Notes the
        constraint's kind (``tool_calls`` for a tool-call grammar) and the seconds waited for its
        grammar on ``record`` (the log line and the ``greenserve_structured_*`` metrics).

        Raises:
            ApiError: 400 ``invalid_request_error`` naming the field, with llguidance's reason, when
                a constraint cannot be enforced exactly: the constraint's (``response_format``...),
                a tool's ``tools[i].function.parameters``, or ``tools`` for tools that only fail
                together; 504 ``timeout`` when the deadline passes while it compiles.
        """
        ask = (tenant, client, record)
        rc = req.constraint
        text = None if rc is None else rc.constraint
        if req.tools is not None:
            _check_keywords(req.tools)
            self._check_tools(req.tools, ask)
            if rc is not None:
                # Checked alone whatever the tool choice: "required" leaves it out of the grammar.
                alone = self._grammar(rc.constraint, ask)
                if isinstance(alone, ConstraintError):
                    raise _cannot(rc.param, alone)
            constraint = tool_constraint(req.tools, req.tool_format, text)
        elif text is None:
            return None
        else:
            constraint = text
        record.constraint = constraint.kind
        start = time.perf_counter()
        grammar = self._grammar(constraint, ask)
        if isinstance(grammar, ConstraintError):
            raise self._refusal(req, constraint, grammar)
        record.compile_s = time.perf_counter() - start
        budget = MaskBudget(self._mask_token_s, self._mask_request_s)
        use = RequestGrammar(grammar, budget, None if self._mask_pool is None else self._offload)
        record.grammar = use
        return use

    def _grammar(
        self, constraint: Constraint, ask: tuple[str, str, RequestRecord]
    ) -> Grammar | ConstraintError:
        """Return the compiled grammar or the refusal: from the tenant's cache on the hub, else
        compiled on the pool in the client's line.

        Raises:
            ApiError: 504 ``timeout`` when the request's deadline passes first.
        """
        tenant, client, record = ask
        grammar = self.compiler.cached(constraint, tenant)
        if grammar is not None:
            return grammar

        def compile_() -> Grammar | ConstraintError:
            spin(self._compile_spin_s)
            return self.compiler.result(constraint, tenant)

        deadline = record.started + self._timeout_s
        try:
            return self._pool.run((tenant, constraint.key()), client, deadline, compile_)
        except TimeoutError:
            record.end(DEADLINE)
            raise timeout_error(self._timeout_s) from None

    def state(self) -> dict[str, int]:
        """Return the compiled-grammar cache's state for ``/debug/state`` (its entries and their
        estimated bytes, and its budget) and the compile pool's (``CompilePool.state``)."""
        cache = self.compiler.cache
        return {
            "cache_entries": len(cache),
            "cache_bytes": cache.bytes,
            "cache_budget_bytes": cache.budget_bytes,
            **self._pool.state(),
        }

    def _check_tools(self, tools: ToolRequest, ask: tuple[str, str, RequestRecord]) -> None:
        """Compile each tool's ``parameters`` alone, as a ``response_format`` schema is (cached;
        with its satisfiability check): the tool-call grammar's own check only computes its first
        mask (the tag's ``<``), so a schema that only refers to itself (``{"$ref": "#"}``, a
        ``$defs`` loop) would otherwise pass and fail while generating. The tools a named or
        ``"none"`` choice leaves out are checked too, so a request is refused the same way
        whatever its ``tool_choice`` (OpenAI validates every tool): they compile alone, as under
        ``"auto"`` (cached, on the pool), and join no tool-call grammar.

        Raises:
            ApiError: 400 naming the first failing tool's ``parameters`` (:func:`parameters_param`).
        """
        for i, tool in enumerate(tools.tools):
            enforced = arguments_schema(tool.parameters, MAX_CONSTRAINT_BYTES)
            alone = self._grammar(Constraint("json_schema", enforced), ask)
            if isinstance(alone, ConstraintError):
                raise _cannot(parameters_param(tools, i), alone)

    def _refusal(
        self, req: GenerationInput, constraint: Constraint, error: ConstraintError
    ) -> ApiError:
        """Return the 400 of a constraint that does not compile, naming the part at fault: for a
        tool-call grammar (whose tools' schemas and text constraint each compile alone, checked
        first), the tools together."""
        rc, tools = req.constraint, req.tools
        if constraint.kind == "tool_calls" and tools is not None:
            return _cannot(tools.param, error)
        return _cannot(rc.param, error)


def tool_constraint(
    tools: ToolRequest, fmt: ToolFormat, text: Constraint | None = None
) -> Constraint:
    """Return the constraint of an answer to a request with ``tools`` (compiled like any other).

    ``none`` is the request's text constraint alone, or text without the opening tag; ``required``
    and a named choice are a block of calls (a named one: exactly one call, as OpenAI forces it;
    the text constraint does not apply to a call); ``auto`` is text (the text constraint's, when
    there is one) or a block.

    Args:
        tools: the request's tools and tool choice.
        fmt: the format the model writes its calls in.
        text: the request's output constraint (``response_format``...), or None.
    """
    if tools.choice == "none":
        if text is not None:
            return text
        return Constraint("tool_calls", (fmt.grammar((), choice="none"), None))
    auto = tools.choice == "auto"
    lark = fmt.grammar(
        tools.callable_tools(),
        parallel=tools.parallel and tools.choice != "named",
        choice="auto" if auto else "required",
        text=auto and text is not None,
    )
    return Constraint("tool_calls", (lark, text if auto else None))


def parameters_param(tools: ToolRequest, i: int) -> str:
    """Return the ``param`` naming tool ``i``'s ``parameters`` (``tools[i].function.parameters``,
    ``functions[i].parameters`` for the legacy field, or the tool's own ``schema_param``)."""
    if tools.tools[i].schema_param:
        return tools.tools[i].schema_param
    if tools.legacy:
        return f"{tools.param}[{i}].parameters"
    return f"{tools.param}[{i}].function.parameters"


def _cannot(param: str, error: ConstraintError | str) -> ApiError:
    if isinstance(error, MaskTooCostly):  # the operator's bound: name the setting
        error = f"{error} ({MASK_SETTINGS[error.limit]})"
    return invalid(f"'{param}' cannot be enforced: {error}", param)


def constraint_failure(
    req: GenerationInput, choice: Any, error: ConstraintError | None = None
) -> ApiError:
    """Return the 400 that ends a request whose output constraint failed while ``choice`` was
    generated (``model.grammar.matcher.ConstraintError``, not a ``MaskViolation``): its masks cost
    more than the request may spend (``error`` is a ``MaskTooCostly``; the message says which
    bound and names its setting), or its grammar allows no next token after the choice's tokens
    so far, though it compiled and its forced start was checked (``model.grammar.compile``).
    Either no output can match it from there (a grammar whose rules recurse without end past a
    choice; a schema without a finite value is refused before, ``model.grammar.endless.endless``),
    or llguidance's parser limits ran out there, which the message says with llguidance's words
    (``model.grammar.matcher.reason``). The param is the constraint the choice was in: the tool
    whose call's arguments it was writing (``tools[i].function.parameters``), else the request's
    text constraint, else its ``tools``.

    Args:
        req: the request.
        choice: the failed choice (a ``Choice``; a ``ToolChoice`` knows its open call).
        error: what the matcher raised, or None.
    """
    tools, name = req.tools, getattr(choice, "open_call", None)
    called = [i for i, t in enumerate(tools.tools) if t.name == name] if tools is not None else []
    rc = req.constraint
    if called:
        param = parameters_param(tools, called[0])
    elif rc is not None:
        param = rc.param
    else:  # a grammar comes from a text constraint or tools: tools here
        param = tools.param if tools is not None else "response_format"
    if isinstance(error, MaskTooCostly):
        return _cannot(param, error)
    after = f"after the {choice.tokens} tokens generated"
    if error is not None and str(error).startswith(PAST_LIMITS):
        return _cannot(param, f"{after}, {error}")
    return _cannot(param, f"{NO_OUTPUT} {after}")


def _check_keywords(tools: ToolRequest) -> None:
    """Refuse a tool whose schema uses a key that is no JSON Schema keyword enforced here
    (llguidance would skip it silently; ``model.grammar.compile.unknown_keyword``), callable under
    this ``tool_choice`` or not.

    Raises:
        ApiError: 400 naming the tool's ``parameters``.
    """
    for i, tool in enumerate(tools.tools):
        unknown = unknown_keyword(tool.parameters)
        if unknown is not None:
            param = parameters_param(tools, i)
            raise invalid(
                f"'{param}' cannot be enforced: uses {unknown}, which is not a JSON Schema "
                "keyword enforced here",
                param,
            )
