"""``/v1/chat/completions``: ``POST`` (JSON or Server-Sent Events) and ``GET`` (the ``EventSource`` stream).

Both validate the request (``wsgi_app.api.chat``), render the conversation with the worker's
chat template (``wsgi_app.http.chat``) and hand the resulting completion request to the pipeline every
generation goes through (admission, slots, deadlines, streaming: ``wsgi_app.http.answer``), answering
in the chat wire format (``wsgi_app.wire.chat``).

The ``GET`` form takes the body's fields as query parameters, as ``GET /v1/completions`` does:
``messages`` is one parameter holding the JSON list of messages, ``include_usage=true`` stands for
``stream_options.include_usage``, ``stop`` repeats.

Source: OpenAI API reference, "Chat Completions" (create); WHATWG HTML Living Standard, §9.2
"Server-sent events".
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, request

from wsgi_app.api.chat import ChatRequest, parse_chat_request
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.registry import ServedModel
from wsgi_app.http.answer import answer
from wsgi_app.http.body import json_body
from wsgi_app.http.chat import chat_completion_request
from wsgi_app.http.event_source import check_event_source
from wsgi_app.http.lifecycle import note_user
from wsgi_app.http.query import chat_query_body
from wsgi_app.http.runtime import Runtime, runtime
from wsgi_app.wire.chat import CHAT_COMPLETION

bp = Blueprint("chat", __name__)

PATH = "/v1/chat/completions"


@bp.post(PATH)
def create_chat_completion() -> Response:
    """Answer one chat completion request.

    Raises:
        ApiError: 400 for invalid input, a template that fails or a conversation too long (naming
            ``param``), 413 for a body over ``MAX_BODY_BYTES``, 429 ``server_busy``, 503 when
            stopping or out of memory, 504 past the deadline, 500 ``engine_error``.
    """
    rt = runtime()
    record: RequestRecord = g.record
    body = json_body(rt, record)
    served = rt.pick(body, record)
    req = _completion_request(rt, served, record, body)
    return answer(served, req, record, CHAT_COMPLETION)


@bp.get(PATH)
def stream_chat_completion() -> Response:
    """Stream a chat completion to an ``EventSource``.

    Raises:
        ApiError: 400 without ``Accept: text/event-stream``, for an invalid parameter (naming it,
            ``messages`` when it is not JSON), or a bad ``Last-Event-ID``; 429; 503.
    """
    rt = runtime()
    check_event_source(PATH)
    body = chat_query_body(request.args)
    record: RequestRecord = g.record
    served = rt.pick(body, record)
    req = _completion_request(rt, served, record, body)
    return answer(served, req, record, CHAT_COMPLETION, query=body)


def _completion_request(
    rt: Runtime, served: ServedModel, record: RequestRecord, body: dict[str, Any]
) -> GenerationInput:
    """Validate a chat body for the model ``served``, note its hashed ``user``, and render it into
    its generation input.

    Raises:
        ApiError: 400 naming the invalid field (see :func:`~wsgi_app.api.chat.parse_chat_request`
            and :func:`~wsgi_app.http.chat.chat_completion_request`).
    """
    settings = rt.settings
    chat: ChatRequest = parse_chat_request(
        body,
        vocab_size=served.model.tokenizer.vocab_size,
        max_n=settings.max_n,
        max_messages=settings.max_chat_messages,
    )
    note_user(record, settings.client_hash_salt, chat.user)
    return chat_completion_request(
        chat,
        served.chat_template,
        served.model,
        max_prompt_tokens=settings.max_prompt_tokens,
        # A default answer may use the rest of the context (OpenAI's rule) up to CHAT_MAX_TOKENS,
        # never a number fitted to a pace; the deadline still bounds it.
        chat_max_tokens=settings.chat_max_tokens,
        offload=rt.offload,
        kv_budget_bytes=settings.kv_cache_budget_mb << 20,
        max_logprob_entries=settings.max_logprob_entries,
    )
