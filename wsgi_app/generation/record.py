"""What the server learns about one request while answering it: the one per-request state.

Made before routing (``wsgi_app.http.lifecycle``, which also notes its status and a server error),
filled in as the request goes: the client's key digest (``wsgi_app.http.auth``), whether its rate
limit counted it (``wsgi_app.http.ratelimit``), the chat's hashed ``user`` (``routes/chat.py``), and
everything of its generation by the generation itself (``wsgi_app.generation.lifetime``: admission,
failures, settling; ``wsgi_app.generation.pacer``: token times, deadlines). Read once when the
response is closed (``wsgi_app.http.lifecycle.finish``, ``telemetry.observer``).
This module imports nothing of the app, so every layer may import it.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from telemetry.spans import Span


@dataclass(slots=True)
class RequestRecord:
    """What the server learns about one request while answering it.

    Attributes:
        request_id: the client's ``X-Request-Id`` (1-128 visible ASCII) or a generated one.
        span: the request's SERVER span.
        started: ``perf_counter`` at arrival, in seconds.
        status: the HTTP status sent.
        prompt_tokens, completion_tokens: usage counts (tokens).
        cached_tokens: prompt tokens served by the prefix cache (``usage.prompt_tokens_details``),
            None for a model without one.
        finish_reasons: one per choice.
        error: message of a failure after the first byte (the status cannot change then), or None.
        ttft_s: seconds from arrival to the first generated token, or None.
        done: True once :func:`wsgi_app.http.lifecycle.finish` has run (it runs once).
        method, path, route: the HTTP method, the path (no query string) and the matched rule or None.
        client_hash: salted hash of the client's address (``telemetry.logs.client_hash``).
        user_hash: salted hash of the request's ``user`` (the same function), or None without one.
        model: the request's ``model`` once validated, else None.
        model_version: the version of the model the request picked (``X-Model-Version``), or
            None before one is picked (the default model's is sent then).
        served_model: the name of the model the request picked, as the models file (or
            ``/v1/models``) names it, never the client's ``model`` string, or None before one is
            picked; variant: the variant of it that answered (``primary`` or a canary's name), or
            None before one is picked. Both are set with ``model_version``
            (``wsgi_app.http.runtime.Runtime.pick``).
        prompt: the prompt text, kept only with ``LOG_PROMPTS=1`` (else None).
        texts: each choice's text, kept only with ``LOG_PROMPTS=1`` (else None).
        token_times: ``perf_counter`` of every generated token (all choices), ``array('d')``, seconds.
        queue_wait_s: seconds from admission to a slot (or to leaving the queue), None if never queued.
        slot_at: ``perf_counter`` when the slot was granted, or None.
        end_reason: why generation ended, one of ``wsgi_app.server.end_reason.END_REASONS``, set
            once by :meth:`end`; None for a request that never generated (refused, invalid, not a
            generation route).
        constraint: the kind of the request's output constraint (``tool_calls`` for a tool-call
            grammar), or None; compile_s: seconds it waited for its grammar; grammar: the
            request's ``model.grammar.compile.RequestGrammar`` (its mask time), or None.
        tool_calls: tool calls made over all choices, or None for a request that could make none
            (no tools, or ``tool_choice`` ``none``).
        ignored_fields: the unknown top-level fields of a generation request, sorted, as its
            ``X-Ignored-Fields`` header lists them (``wsgi_app.api.table.shown_names``).
        api_key_digest: the digest of the API key the request was authenticated with
            (``wsgi_app.http.client_identity.key_digest``: its rate-limit bucket), or None.
        rate_limit_counted: True when the request counts against its client's rate limit (an API
            route while the limiter's storage answers).
    """

    request_id: str
    span: Span
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None
    ttft_s: float | None = None
    done: bool = False
    method: str = ""
    path: str = ""
    route: str | None = None
    client_hash: str = ""
    user_hash: str | None = None
    model: str | None = None
    model_version: str | None = None
    served_model: str | None = None
    variant: str | None = None
    prompt: str | None = None
    texts: list[str] | None = None
    token_times: array = field(default_factory=lambda: array("d"))
    queue_wait_s: float | None = None
    slot_at: float | None = None
    end_reason: str | None = None
    constraint: str | None = None
    compile_s: float | None = None
    grammar: Any = None
    tool_calls: int | None = None
    ignored_fields: tuple[str, ...] = ()
    api_key_digest: str | None = None
    rate_limit_counted: bool = False

    def end(self, reason: str) -> bool:
        """Record why generation ended, unless a reason is recorded already (the first one to know
        wins: a deadline that raised is not then overwritten by the close that follows it).

        Args:
            reason: one of ``wsgi_app.server.end_reason.END_REASONS``.

        Returns:
            True when ``reason`` was recorded.
        """
        if self.end_reason is not None:
            return False
        self.end_reason = reason
        return True
