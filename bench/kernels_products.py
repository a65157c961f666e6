"""Time every SmolLM2-135M weight product of one step: our kernels vs numpy float32.

One step is the 30 layers' q, k, v, o, gate, up, down products (Q4_1) and the tied Q8_0 head
(49152 x 576), for ``R`` rows at once. Ours multiply the packed GGUF blocks
(:func:`model.kernels.products.matmul_t`); the baseline is ``x @ W.T`` on the same matrices
dequantized to float32 (numpy, OpenBLAS on one thread). The two alternate within each repeat so
drift on the shared machine hits both; the medians of thread CPU time (``time.thread_time``) and
wall time are reported with the CPU model, and written to
``bench/results/<UTC timestamp>-kernels-products.json``.

    python -m bench.kernels_products --model PATH --rows 1 8 32 --repeats 7
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

# isort: split
import numpy as np  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/greenserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parent / "results"
LAYER_PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, object]:
    """Return the CPU's model name and whether it has AVX2 / AVX-512F (from ``/proc/cpuinfo``)."""
    name, flags = "unknown", set()
    for line in Path(path).read_text(encoding="ascii", errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip()
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model_name": name, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}


def step_matrices(path: Path) -> tuple[list, list[np.ndarray], float]:
    """Return ``(packed, dequantized float32, seconds to pack)`` of one step's matrices, in order."""
    import gguf

    from model.kernels.packed import PackedWeight
    from model.llama.formats.gguf import read_gguf

    tensors = read_gguf(path).tensors
    names = [
        f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight"
        for i in range(30)
        for p in LAYER_PRODUCTS
    ] + ["model.embed_tokens.weight"]
    shapes = {n: (int(tensors[n].shape[1]), int(tensors[n].shape[0])) for n in names}
    start = time.perf_counter()
    packed = [
        PackedWeight.from_gguf(tensors[n].tensor_type.name, tensors[n].data, shapes[n])
        for n in names
    ]
    pack_s = time.perf_counter() - start
    floats = [
        np.ascontiguousarray(
            gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type)
            .reshape(shapes[n])
            .astype(np.float32)
        )
        for n in names
    ]
    return packed, floats, pack_s


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Return ``(thread CPU seconds, wall seconds)`` of one call."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def run(path: Path, rows: list[int], repeats: int) -> dict[str, object]:
    """Time both ways at every row count; return the results record."""
    from model.kernels.products import matmul_t

    packed, floats, pack_s = step_matrices(path)
    rng = np.random.default_rng(0)
    out: dict[str, object] = {
        "cpu": cpu_info(),
        "model": str(path),
        "matrices": len(packed),
        "pack_seconds": pack_s,
        "packed_bytes": sum(p.nbytes for p in packed),
        "float32_bytes": sum(f.nbytes for f in floats),
        "repeats": repeats,
        "rows": {},
    }
    for r in rows:
        xs = {n: rng.normal(0, 1, (r, n)).astype(np.float32) for n in {p.in_ for p in packed}}

        def ours(xs: dict = xs) -> None:
            for p in packed:
                matmul_t(xs[p.in_], p)

        def numpy(xs: dict = xs) -> None:
            for f in floats:
                xs[f.shape[1]] @ f.T

        ours(), numpy()  # warm caches and pages
        samples: dict[str, list[tuple[float, float]]] = {"ours": [], "numpy": []}
        for _ in range(repeats):
            samples["ours"].append(timed(ours))
            samples["numpy"].append(timed(numpy))
        out["rows"][str(r)] = {
            name: {
                "thread_cpu_ms": 1e3 * statistics.median(c for c, _ in s),
                "wall_ms": 1e3 * statistics.median(w for _, w in s),
            }
            for name, s in samples.items()
        }
        print(r, json.dumps(out["rows"][str(r)]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run, print and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="SmolLM2 Q4_1 GGUF")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="rows per step")
    parser.add_argument("--repeats", type=int, default=7, help="alternated runs per row count")
    args = parser.parse_args(argv)
    compile_start = time.thread_time()
    import model.kernels.products  # noqa: F401  (compiles, or loads numba's cache)

    compile_s = time.thread_time() - compile_start
    result = run(args.model, args.rows, max(1, args.repeats))
    result["import_kernels_cpu_seconds"] = compile_s
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    target = RESULTS / f"{stamp}-kernels-products.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
