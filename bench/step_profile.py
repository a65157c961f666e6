"""Where one Llama decode step's time goes, for a lone stream: the split of a step of the scheduler.

Loads SmolLM2-135M (``python -m model.fetch smollm2``), prefills ``--prompt`` and decodes
``--tokens`` tokens of one sequence through :class:`model.llama.serving.scheduler.BatchScheduler` (speculation
off, so every step is one token), timing the pieces of each step by wrapping them: the weight
products (:func:`model.kernels.products.matmul_t`, the head's included), attention
(``StepAttention.__call__``), RMSNorm, RoPE, SiLU (``silu_mul``, with the up product's multiply),
sampling and making the Step; "other" is the rest of the step (Python dispatch,
embedding, concatenation, the scheduler's bookkeeping). The wrappers add ~1 µs a call.

    python -m bench.step_profile [--tokens 100] [--temperature 0] [--out FILE.json]

Run it with ``PYTHONPATH`` pointing at another checkout to profile that code in the same
conditions (the wrapped names exist in both). Pin it (``taskset -c 1``): the machine is shared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported

import argparse  # noqa: E402
import collections  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import model.kernels.mathf as mathf  # noqa: E402
import model.kernels.products as products  # noqa: E402
import model.llama.forward.attend as attend  # noqa: E402
import model.llama.forward.model as llama_model  # noqa: E402
import model.llama.serving.scheduler as scheduler  # noqa: E402
from bench.harness import print_json  # noqa: E402
from model.engine import GenerationRequest  # noqa: E402
from model.fetch import fetch  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

PIECES = (
    (products, "matmul_t", "weight products"),  # the model's own reference is replaced too
    (attend.StepAttention, "__call__", "attention"),
    (llama_model.Llama, "_rmsnorm", "rmsnorm"),
    (llama_model, "apply_rope", "rope"),
    (mathf, "silu_mul", "silu"),
    (scheduler, "sample", "sampling"),
    (scheduler, "make_step", "make_step"),
)


def instrument(seconds: collections.Counter, calls: collections.Counter) -> None:
    """Wrap every piece of :data:`PIECES` to add its time to ``seconds[name]``."""
    for owner, attr, name in PIECES:
        if not hasattr(owner, attr):
            continue
        inner = getattr(owner, attr)

        def timed(*args: Any, _inner=inner, _name=name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                seconds[_name] += time.perf_counter() - t0
                calls[_name] += 1

        setattr(owner, attr, timed)


def profile(prompt: str, tokens: int, temperature: float) -> dict[str, Any]:
    """Return the mean ms per step of each piece, over ``tokens`` decode steps of one stream."""
    loaded = load_model(fetch("smollm2"))
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    instrument(seconds, calls)
    loaded.model._matmul_t = products.matmul_t  # the model took the function when it was built
    sch = scheduler.BatchScheduler(loaded.model, loaded.tokenizer.eos_ids, 1)
    ids = tuple(loaded.tokenizer.encode(prompt, bos=False))
    params = SamplingParams(temperature=temperature)
    sch.add(GenerationRequest(ids, tokens + 6, params, 1, ignore_eos=True), None)
    for _ in range(6):  # the prefill, then a few warm steps
        sch.step()
    seconds.clear()
    calls.clear()
    steps = 0
    t0 = time.perf_counter()
    while not sch.idle:
        sch.step()
        steps += 1
    wall = time.perf_counter() - t0
    split = {name: round(s / steps * 1e3, 3) for name, s in seconds.most_common()}
    split["other"] = round(wall / steps * 1e3 - sum(split.values()), 3)
    return {
        "step_ms": round(wall / steps * 1e3, 3),
        "split_ms": split,
        "calls_per_step": {name: round(n / steps, 1) for name, n in calls.items()},
        "steps": steps,
    }


def main() -> None:
    """Parse arguments, profile, print (and with ``--out`` write) one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = profile(args.prompt, args.tokens, args.temperature)
    result["temperature"] = args.temperature
    result["loadavg"] = list(os.getloadavg())
    result["affinity"] = sorted(os.sched_getaffinity(0))
    here = Path(llama_model.__file__).resolve().parents[2]  # the checkout profiled
    rev = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    result["code"] = f"{llama_model.__file__} ({rev.stdout.strip()})"
    print_json(result, args.out)


if __name__ == "__main__":
    main()
