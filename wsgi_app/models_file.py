"""The models file (``MODELS_FILE``): the models a server serves, their aliases and its default one
(no Flask, no model code: the gunicorn master reads it before anything is loaded).

A TOML file (read with the standard library's ``tomllib``) or, for a name ending ``.json``, the same
structure in JSON::

    default = "bigram"              # the model a request naming no listed model gets

    [models.bigram]
    source = "bigram"               # the packaged default model
    aliases = ["gpt-4o-mini"]

    [models.poems]
    source = "models/poems"         # a model directory or .gguf file, relative to this file
    aliases = ["verse"]
    max_slots = 4                   # this model's own slots and queue per worker (else MAX_SLOTS,
    max_queue = 16                  # MAX_QUEUE, else its family's)

    [models.poems.variants.v2]      # a canary: 10 % of the clients get it, each always the same
    source = "models/poems-v2"
    weight = 10                     # percent; the primary variant (``source``) gets the rest

    [models.poems.variants.next]    # a shadow: mirrors 5 % of the primary's answered requests
    source = "models/poems-next"
    shadow = 5                      # percent of requests; never answers a client (no weight)

    [models.smollm2]
    source = "smollm2"              # a ``python -m model.fetch`` name, fetched beforehand

Without ``MODELS_FILE``, ``MODEL_DIR`` alone is one model, as it always was
(:func:`single_model`). Every check is made when the file is read, and an error is one line naming
``MODELS_FILE``, the file and the entry (``models.poems.aliases``).

Source: TOML v1.0.0; RFC 8259 (JSON).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The source naming the model shipped with the ``model`` package (what an unset MODEL_DIR serves).
PACKAGED_SOURCE = "bigram"
# model.fetch.MODELS' names, kept here so that reading the file imports no model code; the test of
# this module checks that both agree.
FETCH_NAMES = ("smollm2",)
ENTRY_KEYS = ("source", "aliases", "max_slots", "max_queue", "variants")
VARIANT_KEYS = ("source", "weight", "shadow")
PRIMARY = "primary"  # the variant an entry's own ``source`` is
_VARIANT_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a header value as it arrives, unchanged
SLOT_RANGES = {"max_slots": (1, 100_000), "max_queue": (0, 1_000_000)}  # as MAX_SLOTS, MAX_QUEUE


@dataclass(frozen=True)
class ModelEntry:
    """One model of the file.

    Attributes:
        name: the id it is served and listed under (the entry's key).
        source: a model directory or ``.gguf`` file (absolute, or relative to the file's folder,
            made absolute here), :data:`PACKAGED_SOURCE`, or a ``model.fetch`` name; None for the
            packaged default model.
        fetch: the ``model.fetch`` name ``source`` is, or None.
        aliases: other names that pick it (on its primary variant's entry only).
        max_slots, max_queue: its own slots and queue per worker, or None (the server's); each
            variant has its own.
        variant: :data:`PRIMARY`, or the name of a canary or shadow variant of the model ``name``.
        weight: the percentage of clients this variant serves (``0 <= weight <= 100``; the
            primary's is what the canaries leave; a shadow's is 0).
        shadow: for a shadow variant, the percentage of the primary's requests it mirrors
            (``0 < shadow <= 100``); None for the primary and canaries.
    """

    name: str
    source: str | None
    fetch: str | None = None
    aliases: tuple[str, ...] = ()
    max_slots: int | None = None
    max_queue: int | None = None
    variant: str = PRIMARY
    weight: float = 100.0
    shadow: float | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The name, then the aliases: every name that picks this model."""
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class ModelsFile:
    """The models a server serves, in the file's order.

    Attributes:
        entries: one per model (at least one), each followed by its canary and shadow variants'.
        default: the name of the model a request naming none of them gets.
        path: the file it was read from, or None for ``MODEL_DIR``'s one model.
    """

    entries: tuple[ModelEntry, ...]
    default: str
    path: str | None = None

    def where(self, entry: ModelEntry) -> str:
        """Return how an error names ``entry``: ``MODELS_FILE (path): models.NAME`` or
        ``MODEL_DIR (where)``."""
        if self.path is None:
            return f"MODEL_DIR ({entry.source or 'the embedded default model'})"
        if entry.variant != PRIMARY:
            return f"MODELS_FILE ({self.path}): models.{entry.name}.variants.{entry.variant}"
        return f"MODELS_FILE ({self.path}): models.{entry.name}"


def write_snapshot(models: ModelsFile, path: str) -> None:
    """Write ``models`` (sources resolved) to ``path`` as JSON, atomically: the last good models
    file, which workers serve from (:func:`read_snapshot`) so that an edit is applied only once
    checked.

    Raises:
        OSError: the file cannot be written.
    """
    data = {
        "path": models.path,
        "default": models.default,
        "entries": [asdict(entry) for entry in models.entries],
    }
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)


def read_snapshot(path: str) -> ModelsFile:
    """Return the models :func:`write_snapshot` wrote to ``path``.

    Raises:
        ValueError: the snapshot cannot be read (the message names it).
    """
    try:
        with open(path) as f:
            data = json.load(f)
        entries = tuple(
            ModelEntry(**{**entry, "aliases": tuple(entry["aliases"])}) for entry in data["entries"]
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the models snapshot {path}: cannot read: {_one_line(exc)}") from None
    return ModelsFile(entries, data["default"], data["path"])


def single_model(model_dir: str | None) -> ModelsFile:
    """Return ``MODEL_DIR``'s one model (None: the packaged default), the default of itself; its
    name is filled in once loaded (``wsgi_app.api.models.model_id``), so the entry's is empty."""
    return ModelsFile((ModelEntry("", model_dir),), "")


def read_models_file(path: str) -> ModelsFile:
    """Read and check the models file at ``path`` (TOML, or JSON for a ``.json`` name).

    Raises:
        ValueError: one line starting ``MODELS_FILE (path): `` and naming the entry and key: the
            file cannot be read or parsed, has no models, an unknown key, a source that is not a
            string or names no existing path, a name given twice (as a name or an alias), slots
            out of range, a variant without a source, with a weight out of [0, 100] (or weights
            over 100 together), a shadow out of (0, 100], both a weight and a shadow or neither,
            or a ``default`` naming no model (needed with more than one model).
    """
    where = f"MODELS_FILE ({path})"
    try:
        raw = Path(path).read_bytes()
        if path.lower().endswith(".json"):  # a key given twice is refused, as TOML refuses it
            data = json.loads(raw, object_pairs_hook=_unique_keys)
        else:
            data = tomllib.loads(raw.decode())
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise ValueError(f"{where}: cannot read: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a table (a JSON object) with 'models'")
    unknown = sorted(set(data) - {"default", "models"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: default, models)")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{where}: 'models' must be a table of at least one model")
    base = Path(path).resolve().parent
    entries = tuple(
        entry
        for name, spec in models.items()
        for entry in _entries(f"{where}: models.{name}", name, spec, base)
    )
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.variant != PRIMARY:
            continue
        for name in entry.names:
            if name in seen:
                raise ValueError(
                    f"{where}: models.{entry.name}: the name {name!r} is already "
                    f"models.{seen[name]}'s"
                )
            seen[name] = entry.name
    default = data.get("default", entries[0].name if len(models) == 1 else None)
    if default is None:
        raise ValueError(f"{where}: 'default' must name one of the {len(models)} models")
    if not isinstance(default, str) or default not in models:
        raise ValueError(f"{where}: default {default!r} is not a model of the file")
    return ModelsFile(entries, default, path)


def _entries(where: str, name: str, spec: Any, base: Path) -> list[ModelEntry]:
    """Check one ``[models.NAME]`` table; return its primary entry, then its variants' entries
    (``where`` names it in errors)."""
    if not name.strip() or name != name.strip():
        raise ValueError(f"{where}: a model's name must be non-empty, without outer spaces")
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: must be a table with 'source'")
    unknown = sorted(set(spec) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(ENTRY_KEYS)})")
    source = spec.get("source")
    aliases = spec.get("aliases", [])
    if not isinstance(aliases, list) or not all(
        isinstance(a, str) and a.strip() and a == a.strip() for a in aliases
    ):
        raise ValueError(f"{where}.aliases: must be a list of non-empty strings, no outer spaces")
    limits = {}
    for key, (low, high) in SLOT_RANGES.items():
        value = spec.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise ValueError(f"{where}.{key}: must be an integer in [{low}, {high}], got {value!r}")
        limits[key] = value
    variants = spec.get("variants", {})
    if not isinstance(variants, Mapping):
        raise ValueError(f"{where}.variants: must be a table of variants")
    others = []
    for variant, vspec in variants.items():
        vwhere = f"{where}.variants.{variant}"
        if variant == PRIMARY or not _VARIANT_NAME.fullmatch(variant):
            raise ValueError(
                f"{vwhere}: a variant's name must be letters, digits, '.', '_' or '-' (the "
                f"X-Model-Variant header pins it by name), and not {PRIMARY!r}"
            )
        if not isinstance(vspec, Mapping):
            raise ValueError(f"{vwhere}: must be a table with 'source' and 'weight' or 'shadow'")
        unknown = sorted(set(vspec) - set(VARIANT_KEYS))
        if unknown:
            raise ValueError(
                f"{vwhere}: unknown key {unknown[0]!r} (known: {', '.join(VARIANT_KEYS)})"
            )
        weight, shadow = _share(vwhere, vspec)
        vsource, vfetch = _source(vwhere, vspec.get("source"), base)
        others.append(
            ModelEntry(
                name, vsource, vfetch, (), **limits, variant=variant, weight=weight, shadow=shadow
            )
        )
    rest = 100.0 - sum(c.weight for c in others)
    if rest < 0:
        raise ValueError(f"{where}.variants: the weights add up to {100 - rest:g} %, over 100")
    path, fetch = _source(where, source, base)
    return [ModelEntry(name, path, fetch, tuple(aliases), **limits, weight=rest), *others]


def _share(where: str, spec: Mapping[str, Any]) -> tuple[float, float | None]:
    """Return a variant's ``weight`` (percent of clients; 0 for a shadow) and ``shadow`` (percent
    of the primary's requests mirrored; None for a canary): exactly one of the two is given."""
    weight, shadow = spec.get("weight"), spec.get("shadow")
    if weight is None and shadow is None:
        raise ValueError(
            f"{where}: needs 'weight' (a canary: percent of clients) or 'shadow' (percent of "
            "requests mirrored)"
        )
    if shadow is None:
        if type(weight) not in (int, float) or not 0 <= weight <= 100:
            raise ValueError(f"{where}.weight: must be a percentage in [0, 100], got {weight!r}")
        return float(weight), None
    if weight is not None:
        raise ValueError(
            f"{where}.shadow: a variant has either 'weight' (a canary: percent of clients) or "
            "'shadow' (percent of requests mirrored), not both"
        )
    if type(shadow) not in (int, float) or not 0 < shadow <= 100:
        raise ValueError(f"{where}.shadow: must be a percentage in (0, 100], got {shadow!r}")
    return 0.0, float(shadow)


def _source(where: str, source: Any, base: Path) -> tuple[str | None, str | None]:
    """Return a ``source``'s path (None for the packaged model or a fetch name) and fetch name."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{where}.source: must be a path, {PACKAGED_SOURCE!r} or a fetch name")
    if source == PACKAGED_SOURCE:
        return None, None
    if source in FETCH_NAMES:
        return None, source  # resolved to the fetched file by the loader side (model.fetch)
    resolved = base / source
    if not resolved.exists():
        raise ValueError(
            f"{where}.source: {str(resolved)!r} does not exist (a path, "
            f"{PACKAGED_SOURCE!r} or one of the fetch names {', '.join(FETCH_NAMES)})"
        )
    return str(resolved), None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: the object, refusing a key given twice (RFC 8259 §4 leaves
    such an object's meaning open; the last value would silently win)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"the key {key!r} is given twice in one object")
        data[key] = value
    return data


def _one_line(exc: Exception) -> str:
    """Return an exception's message on one line (TOML and JSON errors may span several)."""
    return " ".join(str(exc).split())
