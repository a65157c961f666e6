"""The byte bigram model: the next byte's logits are one row of a (256, 256) matrix."""

import importlib.resources
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np

from model.bigram.checkpoint import VOCAB_SIZE, load_bigram_file, load_config
from model.files import WEIGHTS_NAME


def default_model_dir() -> Path:
    """Locate the default model shipped as package data of ``model.bigram``.

    Works for ``pip install .`` and ``pip install -e .`` alike, since the directory is found
    through the package, not the working directory.

    Returns:
        The directory holding the default ``config.json`` and ``model.safetensors``.

    Raises:
        RuntimeError: If ``model`` is installed somewhere that is not a plain directory (a zip).
    """
    directory = importlib.resources.files("model.bigram") / "default"
    if not isinstance(directory, Path):
        raise RuntimeError(f"the packaged model is not on the file system: {directory!r}")
    return directory


@dataclass(frozen=True, eq=False)
class Bigram:
    """A loaded byte bigram model; immutable and shared by every request of a worker.

    Attributes:
        weight: ``W``, shape ``(256, 256)`` float32, read-only; ``W[prev, next]`` is the logit
            of byte ``next`` after byte ``prev``.
        vocab_size: Number of token ids (256, one per byte).
        config: The model directory's ``config.json``.
        checksum: Lower-case hex SHA-256 of ``model.safetensors`` (the model version).
        model_dir: The directory the model was loaded from.
    """

    weight: np.ndarray = field(repr=False)
    config: dict
    checksum: str
    model_dir: Path
    vocab_size: int = VOCAB_SIZE

    @classmethod
    def load(cls, model_dir: str | os.PathLike | None = None) -> Self:
        """Load and validate a bigram model directory.

        Args:
            model_dir: Directory with ``config.json`` and ``model.safetensors``; ``None`` means
                :func:`default_model_dir`.

        Returns:
            The model.

        Raises:
            ValueError: If the config or weights break docs/ARCHITECTURE.md §12; the message names the file
                and the field or tensor.

        Source: docs/ARCHITECTURE.md §12 (the bigram).
        """
        directory = default_model_dir() if model_dir is None else Path(model_dir)
        # Config first: a directory for another architecture is refused by its config, not by
        # whatever its weights happen to look like.
        config = load_config(directory)
        weight, checksum = load_bigram_file(directory / WEIGHTS_NAME)
        return cls(weight=weight, config=config, checksum=checksum, model_dir=directory)

    def logits(self, prev: int) -> np.ndarray:
        """Return the logits of the byte that follows ``prev``.

        This is row ``prev`` of ``W``, which equals ``one_hot(prev) @ W`` bit for bit.

        Args:
            prev: The previous byte, ``0 <= prev < 256``.

        Returns:
            Shape ``(256,)`` float32, a read-only view into ``weight`` (copy before changing it).

        Raises:
            IndexError: If ``prev`` is outside ``0..255`` (negative ids do not wrap around).
            TypeError: If ``prev`` is not an integer.

        Source: docs/ARCHITECTURE.md §12 (the bigram).
        """
        index = operator.index(prev)
        if not 0 <= index < self.vocab_size:
            raise IndexError(f"token id {index} is outside 0..{self.vocab_size - 1}")
        return self.weight[index]
