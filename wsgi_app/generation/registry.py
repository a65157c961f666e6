"""The models one worker serves and which of them a request's ``model`` picks (no Flask).

Each model has its own :class:`~wsgi_app.generation.context.GenerationContext` (its engine and
engine thread, its admission slots and queue, its version); every generation runs through the one
answer path with the context of the model its request picked. A ``model`` naming a model or an
alias picks it; any other string (the seed contract serves every non-empty name) and a missing one
pick the default model. The answer echoes the request's ``model`` either way; ``X-Model-Version``
names the version of the model that answered.

Source: docs/ARCHITECTURE.md §12 (several models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.chat_template import ChatTemplate
from model.loader import LoadedModel
from wsgi_app.generation.context import GenerationContext


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model of a worker, with what its generations run with.

    Attributes:
        name: the id ``/v1/models`` lists it under.
        aliases: the other names that pick it.
        generation: its generation context (model, engine, admission, version).
        chat_template: the chat template its chat and Messages requests are rendered with.
    """

    name: str
    aliases: tuple[str, ...]
    generation: GenerationContext
    chat_template: ChatTemplate

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
        served: the models, in the order ``/v1/models`` lists them (at least one).
        default: the name of the model a request naming none of them gets.

    Raises:
        KeyError: ``default`` names none of ``served``.
    """

    def __init__(self, served: Sequence[ServedModel], default: str) -> None:
        self.served = tuple(served)
        self._by_name = {name: m for m in self.served for name in (m.name, *m.aliases)}
        self.default = self._by_name[default]

    def pick(self, requested: object) -> ServedModel:
        """Return the model ``requested`` (the body's ``model``, any JSON value) names by name or
        alias, else the default model (an unknown name, a missing or invalid ``model``: the
        request's own validation answers the latter)."""
        if isinstance(requested, str):
            return self._by_name.get(requested, self.default)
        return self.default

    def failed(self) -> list[str]:
        """Return the names of the models whose engine's last shared step failed, in order."""
        return [m.name for m in self.served if not m.generation.engine_ok]
