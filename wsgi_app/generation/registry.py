"""The models one worker serves and which of them a request's ``model`` picks (no Flask).

Each model has its own :class:`~wsgi_app.generation.context.GenerationContext` (its engine and
engine thread, its admission slots and queue, its version); every generation runs through the one
answer path with the context of the model its request picked. A ``model`` naming a model or an
alias picks it; any other string (the seed contract serves every non-empty name) and a missing one
pick the default model. The answer echoes the request's ``model`` either way; ``X-Model-Version``
names the version of the model that answered.

A model may have canary variants, each serving a stated percentage of the clients: a client (its
key: the API key, else the ``user`` field, else a session header) always gets the same variant, on
every worker and host, because the variant is a function of the key hashed with a salt every host
is configured with (``VARIANT_SALT``), in the manner of nginx's ``split_clients``, one draw per
canary (:func:`split`); a request without a key gets the primary variant; an operator pins one by
name (:meth:`ModelRegistry.pick`'s ``pinned``).

A model may also have shadow variants, which no client is split to: each mirrors a stated
percentage of the requests its primary variant answers (:meth:`ModelRegistry.mirrored`; the
request's id hashed with the same salt), run by ``wsgi_app.generation.shadow``. A pinned request
(the operator's own check) is never mirrored.

Source: docs/ARCHITECTURE.md §12 (several models).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from model.chat_template import ChatTemplate
from model.loader import LoadedModel
from wsgi_app.api.errors import invalid
from wsgi_app.generation.context import GenerationContext

PRIMARY = "primary"  # wsgi_app.models_file.PRIMARY: the variant a model's own source is
PIN_HEADER = "X-Model-Variant"  # names the variant an operator pins


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model of a worker, with what its generations run with.

    Attributes:
        name: the id ``/v1/models`` lists it under.
        aliases: the other names that pick it.
        generation: its generation context (model, engine, admission, version).
        chat_template: the chat template its chat and Messages requests are rendered with.
        variant: :data:`PRIMARY`, or the name of a canary or shadow variant of the model ``name``.
        weight: the percentage of clients the variant serves (0 for a shadow).
        shadow: for a shadow variant, the percentage of its primary's requests it mirrors; None
            for the primary and canaries.
    """

    name: str
    aliases: tuple[str, ...]
    generation: GenerationContext
    chat_template: ChatTemplate
    variant: str = PRIMARY
    weight: float = 100.0
    shadow: float | None = None

    @property
    def model(self) -> LoadedModel:
        """The loaded model and its tokenizer."""
        return self.generation.model

    @property
    def model_version(self) -> str:
        """Its ``X-Model-Version``: checkpoint hash + code version."""
        return self.generation.model_version


class ModelRegistry:
    """A worker's models, by every name that picks one.

    Args:
        served: the models and their variants, in the order ``/v1/models`` lists them (at least
            one primary variant per model, its canaries and shadows after it).
        default: the name of the model a request naming none of them gets.
        salt: the salt clients' keys are hashed with (``VARIANT_SALT``).

    Attributes:
        served: every variant of every model.
        primaries: each model's primary variant, in order.
        default: the default model's primary variant.

    Raises:
        KeyError: ``default`` names none of ``served``.
    """

    def __init__(self, served: Sequence[ServedModel], default: str, salt: str = "") -> None:
        self.served = tuple(served)
        self.primaries = tuple(m for m in self.served if m.variant == PRIMARY)
        self._variants = {
            m.name: [v for v in self.served if v.name == m.name] for m in self.primaries
        }
        # What the client split picks from: the primary and its canaries, never a shadow.
        self._split = {
            name: [v for v in variants if v.shadow is None]
            for name, variants in self._variants.items()
        }
        self._by_name = {name: m for m in self.primaries for name in (m.name, *m.aliases)}
        self.default = self._by_name[default]
        self.salt = salt

    def variants(self, primary: ServedModel) -> list[ServedModel]:
        """Return the variants of ``primary``'s model: the primary first, then its canaries and
        shadows, in the file's order."""
        return self._variants[primary.name]

    def shadows(self) -> list[ServedModel]:
        """Return every shadow variant of every model, in order."""
        return [m for m in self.served if m.shadow is not None]

    def mirrored(self, served: ServedModel, request_id: str, pinned: bool) -> list[ServedModel]:
        """Return the shadow variants that mirror a request ``served`` answers: none unless it is
        a model's primary variant and was not pinned; else each shadow whose percentage is above
        the request's :func:`bucket` (its id hashed with the salt: the same request, the same
        answer on every worker and host).
        """
        if pinned or served.variant != PRIMARY:
            return []
        variants = self._variants[served.name]
        if len(variants) == len(self._split[served.name]):  # no shadow: no hash
            return []
        point = bucket(self.salt, request_id)
        return [v for v in variants if v.shadow is not None and point < v.shadow]

    def pick(
        self, requested: object, client_key: str | None = None, pinned: str | None = None
    ) -> ServedModel:
        """Return the variant that answers a request.

        The model is the one ``requested`` (the body's ``model``, any JSON value) names by name or
        alias, else the default model (an unknown name, a missing or invalid ``model``: the
        request's own validation answers the latter). Its variant is ``pinned`` when given (a
        shadow too), else the one :func:`split` gives ``client_key`` (never a shadow), else (no
        key) the primary.

        Raises:
            ApiError: 400 naming :data:`PIN_HEADER` when the model has no variant ``pinned``.
        """
        primary = self.default
        if isinstance(requested, str):
            primary = self._by_name.get(requested, self.default)
        variants = self._variants[primary.name]
        if pinned is not None:
            for variant in variants:
                if variant.variant == pinned:
                    return variant
            names = ", ".join(repr(v.variant) for v in variants)
            raise invalid(
                f"The model '{primary.name}' has no variant {pinned!r} (it has {names}).",
                PIN_HEADER,
            )
        variants = self._split[primary.name]
        if client_key is None or len(variants) == 1:
            return primary
        return split(variants, self.salt, client_key)

    def failed(self) -> list[str]:
        """Return the names of the models whose engine's last shared step failed, in order. A
        shadow's engine is not counted: its failure harms no client's request (its mirrored
        work is dropped, and counted as failed)."""
        return [m.name for m in self.served if m.shadow is None and not m.generation.engine_ok]


def bucket(salt: str, client_key: str) -> float:
    """Return where a client falls in ``[0, 100)``: the first 8 bytes of
    ``sha256(salt + "\\0" + client_key)`` as a fraction of 2**64, in percent. The same on every
    worker and host configured with the same ``salt``.

    Source: nginx ``ngx_http_split_clients_module`` (a salted key's hash split by percentages).
    """
    digest = hashlib.sha256(f"{salt}\0{client_key}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def split(variants: Sequence[ServedModel], salt: str, client_key: str) -> ServedModel:
    """Return the variant a client gets: each canary, in order, takes the client when the client's
    point for that canary (:func:`bucket` of the model's name, the canary's name and the key) is
    below its weight; the primary (``variants[0]``) takes the rest.

    Each canary draws its clients by a hash of its own, so setting a canary's weight to 0 or
    removing it moves only its own clients (to the next canary whose draw takes them, else the
    primary), raising a weight only adds clients, and the clients of one model's canary are not
    those of another model's. A client drawn by two canaries gets the one listed first, so a canary
    serves its weight of the clients no canary before it took: a lone canary exactly its weight,
    two of 10 % each 10 % and 9 %.

    Source: nginx ``ngx_http_split_clients_module`` (a salted key's hash against percentages),
    one hash per canary as feature-flag rollouts draw one per flag.
    """
    for variant in variants[1:]:
        if bucket(salt, f"{variant.name}\0{variant.variant}\0{client_key}") < variant.weight:
            return variant
    return variants[0]
