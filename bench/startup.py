"""How long a SmolLM2 server takes to be ready, and what its workers hold: first start and warm start.

Starts greenserve (``python -m gunicorn -c gunicorn.conf.py``, pinned to the server core) on the
SmolLM2-135M-Instruct GGUF and times the command to the first ``200`` of ``/ready`` on the API port:

- ``first``: with an empty weights cache (``GREENSERVE_CACHE_DIR``) and an empty kernels cache
  (``GREENSERVE_NUMBA_CACHE_DIR``), both fresh temporary directories: the master hashes the GGUF,
  packs its weights into the cache file and compiles the kernels, then the worker boots;
- ``warm``: both caches kept from the run before: the master hashes the GGUF, checks the cache
  file's digest and loads the compiled kernels.

Each kind runs ``--rounds`` times, alternated; the medians are reported. Once ready, the worker's
resident memory is read from ``/proc/<pid>/smaps_rollup``: RSS, and of it the file-backed pages
(the weights cache is a file mapping, shared by every worker through the page cache) and the
anonymous ones (private). Results with the CPU model and flags go to
``bench/results/<stamp>-startup.json`` and ``.md``.

    python -m bench.startup [--rounds 3] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import servers
from bench.harness import utc_stamp, write_pair
from model.fetch import fetch

RESULTS = Path(__file__).resolve().parent / "results"


def cpu() -> dict[str, Any]:
    """Return the CPU's model name and whether it has AVX2 and AVX-512F (from /proc/cpuinfo)."""
    text = Path("/proc/cpuinfo").read_text()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line)
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
    return {"model": name, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}


def rollup_kib(pid: int) -> dict[str, int]:
    """Return ``Rss``, ``Pss``, ``Anonymous`` and file-backed (``Rss`` less anonymous) in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return {
        "rss_kib": fields["Rss"],
        "pss_kib": fields["Pss"],
        "anonymous_kib": fields["Anonymous"],
        "file_kib": fields["Rss"] - fields["Anonymous"],
    }


def one_start(model: Path, cache: Path, numba: Path, workers: int, logdir: Path) -> dict[str, Any]:
    """Start a server, time it to ``/ready``, read its workers' memory, stop it."""
    env = {
        "MODEL_DIR": str(model),
        "GREENSERVE_CACHE_DIR": str(cache),
        "GREENSERVE_NUMBA_CACHE_DIR": str(numba),
    }
    t0 = time.monotonic()
    srv = servers.start("greenserve", logdir, env, workers=workers, ready_s=300)
    try:
        while not servers._healthy(srv.port, "/ready"):
            time.sleep(0.05)
        ready_s = time.monotonic() - t0
        memory = [rollup_kib(pid) for pid in srv.serving_pids()]
    finally:
        srv.stop()
    return {"ready_s": round(ready_s, 2), "workers": memory}


def main() -> None:
    """Run the benchmark and write its results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    model = fetch("smollm2")
    runs: dict[str, list[dict[str, Any]]] = {"first": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="greenserve-startup-") as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            cache, numba = root / f"cache{r}", root / f"numba{r}"
            runs["first"].append(one_start(model, cache, numba, args.workers, root / "log"))
            runs["warm"].append(one_start(model, cache, numba, args.workers, root / "log"))
            print(json.dumps({k: v[-1]["ready_s"] for k, v in runs.items()}), flush=True)
    summary = {
        kind: {
            "ready_s_median": statistics.median(run["ready_s"] for run in rs),
            "worker_rss_mib_median": round(
                statistics.median(run["workers"][0]["rss_kib"] for run in rs) / 1024, 1
            ),
            "worker_anonymous_mib_median": round(
                statistics.median(run["workers"][0]["anonymous_kib"] for run in rs) / 1024, 1
            ),
            "worker_file_mib_median": round(
                statistics.median(run["workers"][0]["file_kib"] for run in rs) / 1024, 1
            ),
        }
        for kind, rs in runs.items()
    }
    result = {
        "cpu": cpu(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
        "workers": args.workers,
        "summary": summary,
        "runs": runs,
    }
    lines = [
        f"# Start-up on {result['cpu']['model']} (avx2 {result['cpu']['avx2']}, "
        f"avx512f {result['cpu']['avx512f']}), {args.workers} worker(s), {args.rounds} rounds",
        "",
        "| start | ready (s, median) | worker RSS MiB | anonymous | file-backed |",
        "|---|---|---|---|---|",
    ]
    for kind, s in summary.items():
        lines.append(
            f"| {kind} | {s['ready_s_median']} | {s['worker_rss_mib_median']} | "
            f"{s['worker_anonymous_mib_median']} | {s['worker_file_mib_median']} |"
        )
    path = RESULTS / f"{utc_stamp()}-startup.json"
    write_pair(path, result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
