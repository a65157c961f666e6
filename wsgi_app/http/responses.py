"""A Responses request becomes a generation input: its stored conversation put first, rendered by the
chat's path, and its finished response stored.

``previous_response_id`` is looked up in the worker's store (``wsgi_app.http.response_store``) as the
request's API key's: another key's response, an expired or an evicted one is unknown, a 400 naming
``previous_response_id``. The stored items, then the request's own, become the template's messages
(``ResponsesRequest.with_messages``), rendered and checked exactly as a chat request's
(``wsgi_app.http.chat.chat_completion_request``): the same conversation is the same prompt, and so,
at the same seed, the same text. With ``store`` (OpenAI's default), the finished response is kept
with its conversation's items before its last event or its JSON is written, so a client that reads
the answer can continue it at once from any worker.

Source: OpenAI API reference, "Responses" (``previous_response_id``, ``store``); the "Conversation
state" guide.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from flask import current_app

from wsgi_app.api.errors import ApiError
from wsgi_app.api.response_items import Item, output_as_items
from wsgi_app.api.responses import ResponsesRequest
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.registry import ServedModel
from wsgi_app.http.chat import chat_completion_request
from wsgi_app.http.response_store import RedisResponseStore, ResponseStore, SqliteResponseStore
from wsgi_app.http.runtime import Runtime
from wsgi_app.settings import Settings
from wsgi_app.wire.responses import ResponsesFormat, responses_format

log = logging.getLogger("greenserve.responses")
STORE_EXTENSION = "greenserve.responses"


def make_store(settings: Settings) -> ResponseStore:
    """Return the store ``settings`` name: Redis with ``RESPONSES_REDIS_URL``, else the SQLite file
    ``RESPONSES_DB``."""
    most, most_bytes, ttl = (
        settings.responses_max_count,
        settings.responses_max_mb << 20,
        settings.responses_ttl_s,
    )
    if settings.responses_redis_url:
        return RedisResponseStore(
            settings.responses_redis_url, settings.responses_redis_prefix, most, most_bytes, ttl
        )
    return SqliteResponseStore(settings.responses_db, most, most_bytes, ttl)


def response_store(rt: Runtime) -> ResponseStore:
    """Return the worker's store of responses, made on first use (in the worker, never the
    master: a Redis connection or a SQLite file handle does not survive a fork)."""
    store = current_app.extensions.get(STORE_EXTENSION)
    if store is None:
        store = current_app.extensions[STORE_EXTENSION] = make_store(rt.settings)
    return store


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """Turn a failure of the store itself (Redis or the database file unreachable, a disk error)
    into a 503 ``store_unavailable``: the request is sound and may be retried; the engine is fine.

    Raises:
        ApiError: 503 ``store_unavailable``, naming the failure's type.
    """
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - sqlite3.Error, redis.RedisError, OSError
        log.exception("the response store failed")
        raise ApiError(
            503,
            f"The response store is unavailable ({type(exc).__name__}); try again later.",
            type="server_error",
            code="store_unavailable",
        ) from exc


def owner(record: RequestRecord) -> str:
    """Return who a stored response belongs to: the API key's digest, "" without ``API_KEYS``
    (an open server's store is open too)."""
    return record.api_key_digest or ""


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """Return the error of a response id this key has no stored response under: a 404 for ``GET``
    and ``DELETE``, a 400 naming ``previous_response_id`` for a request that continues it."""
    if param is None:
        return ApiError(404, f"Response with id '{response_id}' not found.")
    return ApiError(
        400,
        f"Previous response with id '{response_id}' not found.",
        param=param,
        code="previous_response_not_found",
    )


def responses_input(
    rt: Runtime, served: ServedModel, record: RequestRecord, req: ResponsesRequest
) -> tuple[GenerationInput, ResponsesFormat]:
    """Return the generation input of ``req`` for the model ``served`` (its chat template and
    tokenizer) and the wire format of its answer (which stores the finished response when
    ``req.store``).

    Raises:
        ApiError: 400 naming ``previous_response_id`` for one this key has no stored response
            under; the refusals of ``ResponsesRequest.with_messages`` and
            ``chat_completion_request`` (naming ``input`` or the item at fault, or
            ``max_output_tokens``).
    """
    settings = rt.settings
    stored: tuple[Item, ...] = ()
    if req.previous_response_id is not None:
        with store_errors():
            kept = response_store(rt).get(owner(record), req.previous_response_id)
        if kept is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        stored = tuple(Item("previous_response_id", item) for item in kept["items"])
    conversation = req.with_messages(stored, settings.max_chat_messages)
    generation = chat_completion_request(
        conversation,
        served.chat_template,
        served.model,
        max_prompt_tokens=settings.max_prompt_tokens,
        chat_max_tokens=settings.chat_max_tokens,
        offload=rt.offload,
        kv_budget_bytes=settings.kv_cache_budget_mb << 20,
    )
    on_done = None
    if req.store:
        with store_errors():
            store, key = response_store(rt), owner(record)
        items = [item.item for item in stored + req.items]

        def on_done(response: dict[str, Any]) -> None:
            """Keep the finished response and its conversation; a store that fails is logged,
            and the answer still goes out, saying ``"store": false`` (it was not kept)."""
            kept = {"response": response, "items": items + output_as_items(response["output"])}
            try:
                store.put(key, response["id"], kept)
            except Exception:  # noqa: BLE001 - the answer is made; storing it is a service
                log.exception("could not store response %s", response["id"])
                response["store"] = False

    return generation, responses_format(req.echo, on_done)
