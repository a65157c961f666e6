"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one model this server serves.

The served id is the model's ``config.json`` ``name`` when it is a non-empty string; otherwise
``bigram`` for the packaged default model and the model directory's name for a ``MODEL_DIR`` (so
``MODEL_DIR=my-model`` serves ``my-model``); a GGUF file is served under its file stem.
Completions still accept any ``model`` string and echo it
(docs/ARCHITECTURE.md §8): the list tells clients what to send, it does not police them.

Source: OpenAI API reference, "Models" (list, retrieve; the ``model`` object).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flask import Blueprint, Response

from model.files import CONFIG_NAME, read_json_object
from model.loader import LoadedModel
from wsgi_app.api.errors import ApiError
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.runtime import runtime

bp = Blueprint("models", __name__)

DEFAULT_MODEL_ID = "bigram"
OWNER = "greenserve"


def model_id(config: Mapping[str, Any], model_dir: Path, packaged: bool) -> str:
    """Return the id the server lists its model under.

    Args:
        config: the model's ``config.json``.
        model_dir: the directory the model was loaded from.
        packaged: True for the default model shipped with the ``model`` package.
    """
    name = config.get("name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    if packaged:
        return DEFAULT_MODEL_ID
    return Path(model_dir).resolve().name or DEFAULT_MODEL_ID


def model_card(model: LoadedModel) -> dict[str, Any]:
    """Return the OpenAI ``model`` object of a loaded model.

    ``created`` is the config file's modification time (Unix seconds): the same in every worker.
    ``context_length`` (an extension, like vLLM's ``max_model_len``) is the most tokens a prompt
    and its completion may hold together; the bigram has no such limit and omits it.
    ``quantization`` (an extension) is present for a GGUF model: its file type, e.g. ``Q4_1``.
    """
    directory = Path(model.model_dir)
    source = directory if model.name is not None else directory / CONFIG_NAME
    try:
        config = {} if model.name is not None else read_json_object(source)
        created = int(os.stat(source).st_mtime)
    except (OSError, ValueError):  # the file went away after loading: the model still serves
        config, created = {}, 0
    card = {
        "id": model.name or model_id(config, directory, model.packaged),
        "object": "model",
        "created": created,
        "owned_by": OWNER,
    }
    if model.context_length is not None:
        card["context_length"] = model.context_length
    if model.quantization is not None:
        card["quantization"] = model.quantization  # the GGUF type the float32 weights came from
    return card


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
