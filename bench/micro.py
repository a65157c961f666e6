"""Micro-benchmark: model work per token (sampling, UTF-8 decoding, chunk encoding), no sockets.

Drives the server's own per-token path: ``BigramEngine`` steps through ``Completion.chunks()`` (which
calls ``Choice.advance`` and ``ChunkEncoder.chunk``) with a no-op pacer (``Unpaced``). The straightforward
numpy version of the same work (``bench.straightforward``, what the FastAPI reference runs) is timed
beside it for scale.

Run: ``python -m bench.micro``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from bench import straightforward
from model.bigram.engine import BigramEngine
from model.bigram.model import Bigram
from wsgi_app.api.completions import parse_completion_request
from wsgi_app.generation.completion import Completion
from wsgi_app.generation.inputs import generation_input
from wsgi_app.generation.pacer import Unpaced

PROMPT = "ROMEO:"
MAX_TOKENS = 256


def _completion(engine: BigramEngine, temperature: float, seed: int) -> Completion:
    body = {
        "model": "bigram",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
    }
    req = generation_input(parse_completion_request(body))
    return Completion(engine, req, seed, "cmpl-" + "0" * 24, 1_700_000_000, Unpaced())


def server_path(engine: BigramEngine, temperature: float, requests: int) -> float:
    """Return seconds per token of the server's per-token path over ``requests`` streams."""
    tokens = 0
    elapsed = 0.0
    for seed in range(requests):
        completion = _completion(engine, temperature, seed)
        t0 = time.perf_counter()
        for _frame in completion.chunks():
            pass
        elapsed += time.perf_counter() - t0
        tokens += completion.completion_tokens
    return elapsed / tokens


def naive_path(weight: np.ndarray, temperature: float, requests: int) -> float:
    """Return seconds per token of the straightforward version (``bench.straightforward``)."""
    tokens = 0
    t0 = time.perf_counter()
    for seed in range(requests):
        texts = straightforward.token_texts(weight, PROMPT.encode(), MAX_TOKENS, temperature, seed)
        for i, text in enumerate(texts):
            finish = "length" if i == MAX_TOKENS - 1 else None
            straightforward.chunk_event("cmpl-" + "0" * 24, 1_700_000_000, "bigram", text, finish)
            tokens += 1
    return (time.perf_counter() - t0) / tokens


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """Return the smallest of ``repeats`` measurements (the least disturbed one)."""
    return min(fn() for _ in range(repeats))


def run(requests: int = 40, repeats: int = 5) -> dict[str, float]:
    """Measure both paths for greedy and T=1; return microseconds per token by name."""
    model = Bigram.load()
    engine = BigramEngine(model)
    weight = np.asarray(model.weight)
    out: dict[str, float] = {}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        server_path(engine, temperature, 2)  # warm caches, imports
        out[f"{name}_us_per_token"] = 1e6 * best_of(
            lambda t=temperature: server_path(engine, t, requests), repeats
        )
        out[f"naive_{name}_us_per_token"] = 1e6 * best_of(
            lambda t=temperature: naive_path(weight, t, requests // 4 or 1), max(1, repeats // 2)
        )
    return out


def main() -> None:
    """Print the micro-benchmark as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="streams of 256 tokens per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({k: round(v, 3) for k, v in run(args.requests, args.repeats).items()}))


if __name__ == "__main__":
    main()
