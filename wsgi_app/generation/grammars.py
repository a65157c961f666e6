"""A worker's grammar compiler for structured outputs: compiled off the event loop, cached, refused
with a 400 naming the field.

Compiling a constraint takes ~1 ms for a typical schema and up to ~1 s for a hostile grammar (and the
first one of a worker also builds llguidance's view of the tokenizer, ~0.5 s for a 49k vocabulary), so
it runs on a small native pool (:data:`COMPILE_THREADS`), never on the gevent hub and never on the
engine thread: other requests and running streams do not wait for it. A grammar already in the LRU
(``model.grammar.compile``) is taken on the hub at once. Everything happens before admission, so a
refusal is a 400 before any byte, and nothing holds a slot meanwhile.

Source: docs/ARCHITECTURE.md §6 (where the mask sits), §15 (heavy work off the hub).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gevent.threadpool import ThreadPool

from model.grammar.compile import ConstraintError, GrammarCompiler, RequestGrammar
from wsgi_app.api.completions import CompletionRequest
from wsgi_app.api.errors import invalid
from wsgi_app.generation.record import RequestRecord

COMPILE_THREADS = 2  # a slow grammar does not hold up the next one; the hub competes with two


class GrammarService:
    """Compile the output constraints of one worker's requests.

    Args:
        tokenizer: the served tokenizer (``LoadedModel.tokenizer``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.compiler = GrammarCompiler(tokenizer)
        self._pool: ThreadPool | None = None

    def prepare(self, req: CompletionRequest, record: RequestRecord) -> CompletionRequest:
        """Return ``req`` with its constraint compiled (``req`` itself when it has none).

        Notes the constraint's kind and the seconds waited for its grammar on ``record`` (the log
        line and the ``greenserve_structured_*`` metrics).

        Raises:
            ApiError: 400 ``invalid_request_error`` naming the constraint's field, with
                llguidance's reason, when it cannot be enforced exactly.
        """
        rc = req.constraint
        if rc is None:
            return req
        record.constraint = rc.constraint.kind
        start = time.perf_counter()
        grammar = self.compiler.cached(rc.constraint)
        if grammar is None:
            if self._pool is None:
                self._pool = ThreadPool(COMPILE_THREADS)
            grammar = self._pool.apply(self.compiler.result, (rc.constraint,))
        if isinstance(grammar, ConstraintError):
            raise invalid(f"'{rc.param}' cannot be enforced: {grammar}", rc.param)
        record.compile_s = time.perf_counter() - start
        use = RequestGrammar(grammar)
        record.grammar = use
        return dataclasses.replace(req, grammar=use)


def grammar_service(rt: Any) -> GrammarService:
    """Return the worker's :class:`GrammarService` (made on first use, kept on the runtime)."""
    service = rt.grammars
    if service is None:
        service = rt.grammars = GrammarService(rt.model.tokenizer)
    return service
