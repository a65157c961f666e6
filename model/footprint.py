"""What a loaded model's weights hold: their bytes in memory and their parameter count.

Counted from the arrays the model serves with (a ``PackedWeight``'s quants, scales and mins; a tied
output matrix once), so the numbers are what a worker keeps resident for it, whether the pages are
mapped from a file (shared by the workers through the page cache) or its own copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np

from model.bigram.model import Bigram


def _arrays(model: Any) -> Iterator[Any]:
    """Yield each weight of ``model`` once: numpy arrays and packed matrices."""
    if isinstance(model, Bigram):
        yield model.weight
        return
    seen: set[int] = set()
    layers = [model.tok_embeddings, model.rms_final, model.wcls]
    for layer in model.layers:
        layers += [getattr(layer, f.name) for f in fields(layer)]
    for weight in layers:
        if id(weight) not in seen:
            seen.add(id(weight))
            yield weight


def weights_bytes(model: Any) -> int:
    """Return the bytes of ``model``'s weights (a ``Bigram`` or a ``Llama``)."""
    total = 0
    for weight in _arrays(model):
        if isinstance(weight, np.ndarray):
            total += weight.nbytes
        else:  # model.kernels.packed.PackedWeight
            total += weight.qs.nbytes + weight.d.nbytes + weight.m.nbytes
    return total


def parameters(model: Any) -> int:
    """Return the number of weights of ``model`` (a tied output matrix counted once)."""
    total = 0
    for weight in _arrays(model):
        if isinstance(weight, np.ndarray) or not is_dataclass(weight):
            total += int(weight.size)
        else:  # a packed matrix: its logical shape, whatever its storage
            total += weight.out * weight.in_
    return total
