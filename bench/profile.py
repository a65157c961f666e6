"""Profile greenserve's worker under load: where the CPU of one request and one token goes.

Starts greenserve (one gevent worker, pinned like ``bench.run``), drives one closed-loop scenario with
``bench.loadgen``, and samples the worker meanwhile with ``py-spy record`` (``pip install py-spy``).
Prints (and with ``--out`` writes) the top functions by own time and by inclusive time, as shares of
the samples, beside the run's throughput and latency.

Run: ``python -m bench.profile --stream --conc 128`` or ``python -m bench.profile --conc 128``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import servers
from bench.harness import print_json
from bench.loadgen import LoadSpec, run_load


def _body(stream: bool, max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "bigram", "prompt": "ROMEO:", "max_tokens": max_tokens, "stream": stream}
    ).encode()


def _frame(raw: str) -> str:
    """``name (path/file.py:line)`` -> ``name (file.py)``: one entry per function, not per line."""
    name, _, where = raw.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if "site-packages" in parts or "lib" in parts else path
    return f"{name} ({short})"


def top(collapsed: str, n: int = 30) -> dict[str, list[tuple[str, float]]]:
    """Return the ``n`` heaviest functions of py-spy's collapsed stacks, by own and inclusive share.

    Args:
        collapsed: py-spy ``--format raw`` output: ``frame;frame;... count`` per line, root first.
        n: how many entries of each list.
    """
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        total += k
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    total = total or 1

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100.0 * k / total, 1)) for f, k in c.most_common(n)]

    return {"samples": total, "own_pct": share(own), "inclusive_pct": share(incl)}


def main() -> None:
    """Profile one scenario and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stream", action="store_true", help="256-token streams (else 64-token JSON)"
    )
    parser.add_argument("--conc", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE server setting")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write the report here as JSON")
    parser.add_argument("--no-spy", action="store_true", help="measure only, do not sample")
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    _, client_cores = servers.cores()
    os.sched_setaffinity(0, client_cores)
    logdir = Path(tempfile.mkdtemp(prefix="greenserve-profile-"))
    srv = servers.start("greenserve", logdir, env)
    max_tokens = 256 if args.stream else 64
    try:
        (pid,) = srv.serving_pids()
        raw = logdir / "profile.txt"
        spy = (
            None
            if args.no_spy
            else subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                ]
                + ["-d", str(int(args.seconds + 2)), "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        result = run_load(
            LoadSpec(
                port=srv.port,
                body=_body(args.stream, max_tokens),
                stream=args.stream,
                expect_tokens=max_tokens,
                concurrency=args.conc,
                warmup_s=1.0,
                ramp_s=0.5,
                duration_s=args.seconds,
                drain_s=1.0,
                server_pids=[pid],
                server_cores=servers.cores()[0],
            )
        )
        if spy is not None:
            spy.wait(timeout=60)
        report: dict[str, Any] = {
            "scenario": "stream" if args.stream else "plain",
            "concurrency": args.conc,
            "env": env,
            "load_average": os.getloadavg(),
            "tokens_per_s": result["tokens_per_s"],
            "tokens_per_server_cpu_s": result["tokens_per_server_cpu_s"],
            "server_core_other_util": result["server_core_other_util"],
            "requests_per_s": result["requests_per_s"],
            "ttft_ms": result["ttft_ms"],
            "errors": result["errors"],
            **(top(raw.read_text(), args.top) if spy is not None else {}),
        }
    finally:
        srv.stop()
    print_json(report, args.out, indent=1)


if __name__ == "__main__":
    main()
