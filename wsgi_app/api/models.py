"""The OpenAI ``model`` object of a model this server serves (``GET /v1/models``), and the id
``MODEL_DIR``'s model is served under (no Flask).

``MODEL_DIR``'s id is the model's ``config.json`` ``name`` when it is a non-empty string; otherwise
``bigram`` for the packaged default model and the model directory's name for a ``MODEL_DIR`` (so
``MODEL_DIR=my-model`` serves ``my-model``); a GGUF file is served under its file stem. A models
file's model is served under its entry's name. The views are ``wsgi_app/http/routes/models.py``; the
status page and the start-up log line show the same id.

Source: OpenAI API reference, "Models" (the ``model`` object).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model.files import CONFIG_NAME, read_json_object
from model.loader import LoadedModel

DEFAULT_MODEL_ID = "bigram"
OWNER = "greenserve"
# What every served model can do (both families): chat (its template or the default one), tool
# calls and structured outputs (llguidance over its tokenizer), logprobs.
CAPABILITIES = {"chat": True, "tools": True, "structured_outputs": True, "logprobs": True}


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


def model_card(model: LoadedModel, name: str | None = None) -> dict[str, Any]:
    """Return the OpenAI ``model`` object of a loaded model, listed as ``name`` (None: the id
    ``MODEL_DIR``'s model is served under).

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
        "id": name or model.name or model_id(config, directory, model.packaged),
        "object": "model",
        "created": created,
        "owned_by": OWNER,
    }
    if model.context_length is not None:
        card["context_length"] = model.context_length
    if model.quantization is not None:
        card["quantization"] = model.quantization  # the GGUF type the float32 weights came from
    return card


def serving_card(
    model: LoadedModel, name: str, aliases: tuple[str, ...], max_completion_tokens: int
) -> dict[str, Any]:
    """Return the ``model`` object ``/v1/models`` lists for a served model: :func:`model_card`
    with the extensions clients size their requests by.

    ``max_completion_tokens`` is the most ``max_tokens`` a request may ask (the API's cap, the
    context less one prompt token, the pace's bound: ``GenerationContext.max_completion_tokens``);
    ``capabilities`` what it can do (:data:`CAPABILITIES`); ``parameters`` its weights' count and
    ``resident_bytes`` their bytes in a worker (``LoadedModel.weights_bytes``); ``aliases`` the
    other names that pick it.
    """
    card = model_card(model, name)
    card["max_completion_tokens"] = max_completion_tokens
    card["capabilities"] = dict(CAPABILITIES)
    card["parameters"] = model.parameters
    card["resident_bytes"] = model.weights_bytes
    card["aliases"] = list(aliases)
    return card


def alias_card(card: dict[str, Any], alias: str) -> dict[str, Any]:
    """Return the ``model`` object of an alias of the model ``card`` describes: the same object
    under the alias's id, with ``alias_of`` naming the model and no ``aliases``."""
    listed = {key: value for key, value in card.items() if key != "aliases"}
    return {**listed, "id": alias, "alias_of": card["id"]}
