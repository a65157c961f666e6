"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one model this server serves.

The model object and the id it lists are ``wsgi_app.api.models``'s. Completions still accept any
``model`` string and echo it (docs/ARCHITECTURE.md §8): the list tells clients what to send, it does
not police them.

Source: OpenAI API reference, "Models" (list, retrieve; the ``model`` object).
"""

from __future__ import annotations

from flask import Blueprint, Response

from wsgi_app.api.errors import ApiError
from wsgi_app.api.models import model_card
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.runtime import runtime

bp = Blueprint("models", __name__)


@bp.get("/v1/models")
def list_models() -> Response:
    """List the served models: ``{"object":"list","data":[<model>]}``."""
    return json_response({"object": "list", "data": [model_card(runtime().model)]})


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str) -> Response:
    """Describe one model.

    Raises:
        ApiError: 404 ``model_not_found`` when ``model`` is not the served id.
    """
    card = model_card(runtime().model)
    if model != card["id"]:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{card['id']}'.",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    return json_response(card)
