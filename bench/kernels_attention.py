"""Micro-benchmark: greenserve's numba attention kernel against the numpy ``decode_attention``.

SmolLM2-135M shapes (9 query heads, 3 key/value heads of 64). Cases: one decoding row at several
lengths, 32 decoding lanes of one slab, and a prompt attending causally (every row its own length)
for every layer, one kernel call per layer against the numpy runs of ``model.llama.forward.attend``.
Results, with the CPU model and flags, go to ``bench/results/<UTC>-kernels-attention.json``.

Usage: ``python -m bench.kernels_attention [--repeat 20] [--prompt-tokens 1500] [--layers 30]``
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
N_HEADS, N_KV_HEADS, HEAD_DIM = 9, 3, 64
KV_BLOCK = 64
RUN_ROWS = 16  # model.llama.forward.attend's rows per numpy call


def cpu_info() -> dict[str, object]:
    """Return the CPU model and the SIMD flags that matter here (Linux /proc/cpuinfo)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def median_s(fn, repeat: int) -> float:
    """Return the median thread CPU time of ``repeat`` calls of ``fn`` (after one warm-up), in seconds.

    Thread CPU time (``time.thread_time``), not wall time: the machine's cores are shared, and
    another process's turn on ours would otherwise count against the kernel.
    """
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times))


def decode_case(attend, decode_attention, rng, n_rows: int, length: int, repeat: int) -> dict:
    """Time ``n_rows`` decoding lanes of one slab, each at ``length`` positions, one layer."""
    rows = -(-length // KV_BLOCK) * KV_BLOCK
    shape = (n_rows, 1, N_KV_HEADS, rows, HEAD_DIM)
    k, v = (
        rng.standard_normal(shape, dtype=np.float32),
        rng.standard_normal(shape, dtype=np.float32),
    )
    q = rng.standard_normal((n_rows, N_HEADS, HEAD_DIM), dtype=np.float32)
    idx = np.arange(n_rows, dtype=np.int64)
    lengths = np.full(n_rows, length, dtype=np.int64)
    out = np.empty((n_rows, N_HEADS * HEAD_DIM), dtype=np.float32)
    ours = median_s(lambda: attend(q, k, v, 0, idx, idx, lengths, out), repeat)
    theirs = median_s(lambda: decode_attention(q, k[:, 0], v[:, 0], lengths, KV_BLOCK), repeat)
    diff = float(np.abs(out - decode_attention(q, k[:, 0], v[:, 0], lengths, KV_BLOCK)).max())
    return {
        "rows": n_rows,
        "length": length,
        "kernel_s": ours,
        "numpy_s": theirs,
        "max_abs_diff": diff,
    }


def prompt_case(attend, decode_attention, rng, tokens: int, layers: int) -> dict:
    """Time a ``tokens``-token prompt's attention, one call per layer, both ways (median layer)."""
    rows = -(-tokens // KV_BLOCK) * KV_BLOCK
    shape = (1, layers, N_KV_HEADS, rows, HEAD_DIM)
    k, v = (
        rng.standard_normal(shape, dtype=np.float32),
        rng.standard_normal(shape, dtype=np.float32),
    )
    q = rng.standard_normal((tokens, N_HEADS, HEAD_DIM), dtype=np.float32)
    idx = np.arange(tokens, dtype=np.int64)
    lanes = np.zeros(tokens, dtype=np.int64)
    lengths = idx + 1
    out = np.empty((tokens, N_HEADS * HEAD_DIM), dtype=np.float32)
    ours = []
    for layer in range(layers):
        t0 = time.thread_time()
        attend(q, k, v, layer, idx, lanes, lengths, out)
        ours.append(time.thread_time() - t0)
    ref = np.empty_like(out)
    theirs = []
    for layer in range(layers):
        t0 = time.thread_time()
        for a in range(0, tokens, RUN_ROWS):
            b = min(tokens, a + RUN_ROWS)
            ks = np.broadcast_to(k[0, layer], (b - a, *k.shape[2:]))  # the lane once per row
            vs = np.broadcast_to(v[0, layer], (b - a, *v.shape[2:]))
            ref[a:b] = decode_attention(q[a:b], ks, vs, lengths[a:b], KV_BLOCK)
        theirs.append(time.thread_time() - t0)
    diff = float(np.abs(out - ref).max())
    return {
        "tokens": tokens,
        "layers": layers,
        "kernel_layer_s": float(np.median(ours)),
        "numpy_layer_s": float(np.median(theirs)),
        "kernel_s": float(np.sum(ours)),
        "numpy_s": float(np.sum(theirs)),
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> None:
    """Run the cases and write the JSON results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per decode case")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=30, help="layers of the prompt case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    from model.kernels.attention import attend  # compiles, or loads numba's cache

    import_s = time.perf_counter() - t0
    from model.llama.forward.ops import decode_attention

    rng = np.random.default_rng(args.seed)
    decode = [
        decode_case(attend, decode_attention, rng, n, length, args.repeat)
        for n, length in [(1, 128), (1, 1024), (1, 4096), (32, 512)]
    ]
    for d in decode:
        print(
            f"decode rows={d['rows']:2d} length={d['length']:5d}: kernel {d['kernel_s'] * 1e6:8.1f} us,"
            f" numpy {d['numpy_s'] * 1e6:8.1f} us"
        )
    prompt = prompt_case(attend, decode_attention, rng, args.prompt_tokens, args.layers)
    print(
        f"prompt {prompt['tokens']} tokens, median of {prompt['layers']} layers: kernel"
        f" {prompt['kernel_layer_s'] * 1e3:.1f} ms, numpy {prompt['numpy_layer_s'] * 1e3:.1f} ms"
    )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "bench": "kernels-attention",
        "utc": stamp,
        "cpu": cpu_info(),
        "shapes": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM},
        "args": vars(args),
        "kernel_import_s": import_s,
        "decode": decode,
        "prompt": prompt,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{stamp}-kernels-attention.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(path)


if __name__ == "__main__":
    main()
