"""``GET /v1/models`` and ``GET /v1/models/{model}``: the models this server serves and their aliases.

The model objects are ``wsgi_app.api.models``'s: each model under its name, then each of its
aliases as a model object of its own (``alias_of`` naming the model). A model with canary or shadow
variants lists them under ``variants``: each one's name, weight (percent of clients), a shadow's
``shadow`` (percent of requests mirrored) and version.
Completions still accept any ``model`` string and echo it (docs/ARCHITECTURE.md §8): one the server
does not list goes to the default model; the list tells clients what to send, it does not police them.

Source: OpenAI API reference, "Models" (list, retrieve; the ``model`` object).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response

from wsgi_app.api.errors import ApiError
from wsgi_app.api.models import alias_card, serving_card
from wsgi_app.generation.registry import ServedModel
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.runtime import Runtime, runtime

bp = Blueprint("models", __name__)


def _cards(rt: Runtime) -> list[dict[str, Any]]:
    """Return the model objects of every served model, each followed by its aliases'."""
    cards = []
    for served in rt.models.primaries:
        gen = served.generation
        card = serving_card(served.model, served.name, served.aliases, gen.max_completion_tokens)
        variants = rt.models.variants(served)
        if len(variants) > 1:
            card["variants"] = [_variant(v) for v in variants]
        cards += [card, *(alias_card(card, alias) for alias in served.aliases)]
    return cards


def _variant(served: ServedModel) -> dict[str, Any]:
    """Return a variant's entry: its name, weight (percent of clients; 0 for a shadow), a shadow's
    percentage of requests mirrored, and its version."""
    entry: dict[str, Any] = {"variant": served.variant, "weight": served.weight}
    if served.shadow is not None:
        entry["shadow"] = served.shadow
    entry["version"] = served.model_version
    return entry


@bp.get("/v1/models")
def list_models() -> Response:
    """List the served models and aliases: ``{"object":"list","data":[<model>, ...]}``."""
    return json_response({"object": "list", "data": _cards(runtime())})


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str) -> Response:
    """Describe one model or alias.

    Raises:
        ApiError: 404 ``model_not_found`` when ``model`` is no served name or alias.
    """
    rt = runtime()
    cards = _cards(rt)
    for card in cards:
        if card["id"] == model:
            return json_response(card)
    served = ", ".join(f"'{m.name}'" for m in rt.models.primaries)
    raise ApiError(
        404,
        f"The model '{model}' does not exist; this server serves {served}.",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )
