"""What telemetry reads of a finished request: the record protocol.

The server keeps one record per request (``wsgi_app.generation.record.RequestRecord``) and hands it
to the observer (``telemetry.observer``) once the response is closed. Telemetry never imports the
server, so what it reads of that record is spelled out here, structurally: any object with these
attributes will do (a test's fake as well as the server's dataclass). The attribute types are the
record's own (a protocol's attributes are matched exactly).

Source: docs/ARCHITECTURE.md §10 (telemetry); §9 (end reasons).
"""

from __future__ import annotations

from array import array
from typing import Any, Protocol

from telemetry.spans import Span


class FinishedRequest(Protocol):
    """One finished request, as its log line, metrics and history see it.

    Attributes:
        request_id: the client's ``X-Request-Id`` or a generated one.
        span: the request's SERVER span (its trace and span ids go into the log line).
        started: ``perf_counter`` at arrival, in seconds.
        status: the HTTP status sent.
        prompt_tokens, completion_tokens: usage counts (tokens).
        cached_tokens: prompt tokens served by a prefix cache, None for a model without one.
        finish_reasons: one per choice; None for a choice that never finished.
        error: message of a failure after the first byte, or None.
        ttft_s: seconds from arrival to the first generated token, or None.
        method, path, route: the HTTP method, the path (no query string) and the matched rule or None.
        client_hash: salted hash of the client's address.
        user_hash: salted hash of the request's ``user``, or None.
        model: the request's ``model`` once validated, else None.
        model_version: the version of the model (variant) the request picked, or None.
        served_model: the name of the model the request picked (the models file's, a bounded set:
            never the client's ``model`` string), or None when it picked none.
        variant: the variant of that model that answered (``primary`` or a canary's name), or
            None when it picked none.
        prompt: the prompt text, only when prompts are logged (else None).
        texts: each choice's text, only when prompts are logged (else None).
        token_times: ``perf_counter`` of every generated token, ``array('d')``, seconds.
        queue_wait_s: seconds from admission to a slot (or to leaving the queue), None if never queued.
        slot_at: ``perf_counter`` when the slot was granted, or None.
        end_reason: why generation ended (docs/ARCHITECTURE.md §9), or None when it never generated.
        ignored_fields: the unknown top-level fields a generation request sent (names as its
            ``X-Ignored-Fields`` header lists them), ``()`` without any.
        constraint: the kind of the request's output constraint (structured outputs), or None.
        compile_s: seconds the request waited for its grammar, or None.
        grammar: an object whose ``mask_s`` is the request's mask time in seconds, or None.
        tool_calls: tool calls made over all choices, or None for a request that could make none.
    """

    request_id: str
    span: Span
    started: float
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    finish_reasons: list[str | None]
    error: str | None
    ttft_s: float | None
    method: str
    path: str
    route: str | None
    client_hash: str
    user_hash: str | None
    model: str | None
    model_version: str | None
    served_model: str | None
    variant: str | None
    prompt: str | None
    texts: list[str] | None
    token_times: array
    queue_wait_s: float | None
    slot_at: float | None
    end_reason: str | None
    ignored_fields: tuple[str, ...]
    constraint: str | None
    compile_s: float | None
    grammar: Any
    tool_calls: int | None
