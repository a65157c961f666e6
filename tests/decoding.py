"""Generate with a Llama model in tests, the two reference ways: a ``BatchScheduler`` stepped until
idle, and greedy decoding by hand (prefill, then argmax and a one-token decode at a time)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from model.engine import GenerationRequest
from model.llama.serving.scheduler import BatchScheduler
from model.llama.serving.sequence import steps_of


def run_to_end(scheduler: BatchScheduler, reqs: Sequence[GenerationRequest]) -> list[list]:
    """Add ``reqs`` to ``scheduler`` together and step it until idle; return each request's
    ``Step`` list (ids, logprobs, finish reason, cached tokens), in the order of ``reqs``."""
    seqs = [scheduler.add(r, None) for r in reqs]
    out: list[list] = [[] for _ in reqs]
    while not scheduler.idle:
        scheduler.step()
        for steps, seq in zip(out, seqs, strict=True):
            steps += steps_of(seq)
    return out


def greedy_by_hand(model, prompt_ids: Sequence[int], n: int, cache=None) -> list[int]:
    """Return the ``n`` greedy ids after ``prompt_ids``, from ``model.prefill`` and ``model.decode``
    alone (no sampler, no scheduler); ``cache`` defaults to ``model.new_cache()``."""
    cache = model.new_cache() if cache is None else cache
    logits = model.prefill(prompt_ids, cache)
    ids: list[int] = []
    for _ in range(n):
        ids.append(int(np.argmax(logits)))
        logits = model.decode([ids[-1]], [cache])[0]
    return ids
