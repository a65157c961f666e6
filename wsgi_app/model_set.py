"""Load the models a server serves (``MODELS_FILE``, else ``MODEL_DIR``'s one) and count what they
cost a worker against ``MEMORY_BUDGET_MB``.

Run twice: once in the gunicorn master before any worker starts (``gunicorn_config``: a bad file,
a model that does not load or a set that does not fit is one line and exit code 1), then by each
worker's app factory, which serves what it loads (weights are memory-mapped: a worker's second
load costs little).

A worker's cost of a model is its weights' bytes (``LoadedModel.weights_bytes``; a mapped file's
pages are shared by the workers, a private copy is not: the count takes both as private, so it
errs on the safe side) plus, for a batched family (a Llama), ``KV_CACHE_BUDGET_MB``: the KV-cache
bytes its running requests may reserve, which its prefix cache lives within. The bigram keeps no
KV cache.

Source: docs/ARCHITECTURE.md §12 (several models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from model.fetch import MODELS, fetched_file
from model.loader import LoadedModel, gguf_file, load_model
from wsgi_app.api.models import model_card
from wsgi_app.models_file import (
    PRIMARY,
    ModelEntry,
    ModelsFile,
    read_models_file,
    read_snapshot,
    single_model,
)
from wsgi_app.settings import Settings

MIB = 1 << 20


def models_of(settings: Settings, snapshot: bool = True) -> ModelsFile:
    """Return the models ``settings`` name: the master's snapshot of the last good models file
    (unless ``snapshot`` is False), else the models file, else ``MODEL_DIR``'s one model.

    Raises:
        ValueError: the models file or its snapshot is invalid (one line naming it and the entry).
    """
    if snapshot and settings.models_snapshot is not None:
        return read_snapshot(settings.models_snapshot)
    if settings.models_file is not None:
        return read_models_file(settings.models_file)
    return single_model(settings.model_dir)


def load_entry(entry: ModelEntry) -> LoadedModel:
    """Load ``entry``'s model: its path, the packaged default, or a fetched file (its SHA-256
    checked against ``model.fetch``'s).

    Raises:
        ValueError: the model is missing or invalid, or a fetched file is not the one expected.
    """
    if entry.fetch is None:
        return load_model(entry.source)
    path = fetched_file(entry.fetch)
    loaded = load_model(path)
    if loaded.checksum != MODELS[entry.fetch].sha256:
        raise ValueError(f"{path}: SHA-256 differs from model.fetch's: fetch it again")
    return loaded


def load_models(models: ModelsFile) -> list[tuple[ModelEntry, LoadedModel]]:
    """Load every model of ``models``, in order; ``MODEL_DIR``'s entry gets its served id as name.

    Raises:
        ValueError: one line naming the entry (``MODELS_FILE (path): models.NAME: ...``, or
            ``MODEL_DIR (where): ...``) and why its model cannot load, or why a shadow variant
            cannot be compared with its primary (:func:`same_vocabulary`).
    """
    loaded = []
    primaries: dict[str, LoadedModel] = {}
    for entry in models.entries:
        try:
            model = load_entry(entry)
            if entry.shadow is not None:  # the file lists a model's primary before its variants
                same_vocabulary(model, primaries[entry.name], entry.name)
        except ValueError as exc:
            raise ValueError(f"{models.where(entry)}: {exc}") from exc
        if entry.variant == PRIMARY:
            primaries[entry.name] = model
        if models.path is None:  # MODEL_DIR: served under the id its files give it
            entry = replace(entry, name=model_card(model)["id"])
        loaded.append((entry, model))
    return loaded


def same_vocabulary(shadow: LoadedModel, primary: LoadedModel, name: str) -> None:
    """Refuse a shadow variant whose tokenizer is not its primary's, token for token.

    A shadow's tokens are compared with the primary's id by id, and it runs with the primary's
    prompt ids and compiled grammar: both mean something only when every id is the same token
    (the same bytes, the same special tokens) in both vocabularies.

    Args:
        shadow: the shadow variant's model.
        primary: its primary variant's model.
        name: the model's name (for the message).

    Raises:
        ValueError: naming the first id that differs, or the vocabularies' sizes.
    """
    mine, theirs = shadow.tokenizer, primary.tokenizer
    why = ""
    if mine.vocab_size != theirs.vocab_size:
        why = f"{mine.vocab_size} tokens, the primary's {theirs.vocab_size}"
    elif mine.token_bytes != theirs.token_bytes:
        pairs = zip(mine.token_bytes, theirs.token_bytes, strict=True)
        i, (a, b) = next((i, p) for i, p in enumerate(pairs) if p[0] != p[1])
        why = f"token {i} is {a!r}, the primary's {b!r}"
    elif mine.special_tokens != theirs.special_tokens:
        why = "its special tokens differ from the primary's"
    if why:
        raise ValueError(
            f"a shadow's tokenizer must be its primary's (models.{name}), token for token: {why}"
        )


def cost_bytes(model: LoadedModel, settings: Settings) -> tuple[int, int]:
    """Return what ``model`` costs one worker: its weights' bytes and its KV budget's bytes (0 for
    an inline family, which keeps no KV cache)."""
    kv = 0 if model.family.inline else settings.kv_cache_budget_mb * MIB
    return model.weights_bytes, kv


def check_budget(loaded: list[tuple[ModelEntry, LoadedModel]], settings: Settings) -> None:
    """Refuse a set of models that costs a worker more than ``MEMORY_BUDGET_MB`` (unset: none).

    Raises:
        ValueError: one line naming ``MEMORY_BUDGET_MB``, the total and each model's weights + KV,
            in MiB.
    """
    budget = settings.memory_budget_mb
    if budget is None:
        return
    parts, total = [], 0
    for entry, model in loaded:
        weights, kv = cost_bytes(model, settings)
        total += weights + kv
        label = entry.name if entry.variant == PRIMARY else f"{entry.name}/{entry.variant}"
        parts.append(f"{label} {weights / MIB:.2f} + KV {kv / MIB:.0f}")
    if total > budget * MIB:
        raise ValueError(
            f"MEMORY_BUDGET_MB ({budget}): the models need {total / MIB:.2f} MiB a worker "
            f"(weights + KV budget: {'; '.join(parts)}); raise it, lower KV_CACHE_BUDGET_MB or "
            "serve fewer models"
        )


def check_models(
    settings: Settings, before_load: Callable[[str | None], None] | None = None
) -> ModelsFile:
    """Check the models ``settings`` name (the models file itself, never the snapshot, else
    ``MODEL_DIR``'s one) exactly as a worker will serve them: read the file, load every model,
    count them against ``MEMORY_BUDGET_MB`` and render their chat templates; return the models.
    The master runs it before any worker starts and on every reload; ``greenserve
    --check-models`` runs it before a reload is sent.

    Args:
        settings: the server's settings.
        before_load: called with each entry's GGUF file (None for a model directory) before it
            loads: a first load of a GGUF builds its weights cache, seconds of silence.

    Raises:
        ValueError: one line naming the setting, the file and the entry.
    """
    from wsgi_app.http.chat import check_chat_template

    models = models_of(settings, snapshot=False)
    for entry in models.entries:
        if entry.source is not None and before_load is not None:
            try:
                before_load(gguf_file(entry.source))
            except ValueError as exc:
                raise ValueError(f"{models.where(entry)}: {exc}") from exc
    loaded = load_models(models)
    check_budget(loaded, settings)
    for entry, model in loaded:
        try:
            check_chat_template(model, settings)  # CHAT_TEMPLATE rendered once on a sample
        except ValueError as exc:
            if models.path is None:
                raise
            raise ValueError(f"{models.where(entry)}: {exc}") from exc
    return models
