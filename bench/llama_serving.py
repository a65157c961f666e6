"""Benchmark greenserve serving a Llama model (stories260K, converted from the shared llama2.c files).

Runs, on one worker pinned to the server core: streamed generation (``max_tokens`` 128, ``ignore_eos``)
at 1, 8 and 32 concurrent streams (tokens/s shows the gain from continuous batching), TTFT, and
``/healthz`` on both ports while 8 streams generate; then RSS with 2 workers (each maps the same weight
file, so their proportional set sizes show the shared pages). Writes ``bench/results/<time>-llama.json``
and ``.md``.

    python -m bench.llama_serving [--window 5] [--data ../shared/data]

Source: docs/ARCHITECTURE.md §5 (the engine contract).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procstat, servers
from bench.loadgen import LoadSpec, run_load
from model.llama.convert import convert_llama2c

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MAX_TOKENS = 128


def _body(max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "stories260K",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()


def _spec(srv: servers.Server, conc: int, window_s: float, probe: bool = False) -> LoadSpec:
    return LoadSpec(
        port=srv.port,
        body=_body(MAX_TOKENS),
        stream=True,
        expect_tokens=MAX_TOKENS,
        concurrency=conc,
        warmup_s=1.0,
        ramp_s=0.5,
        duration_s=window_s,
        drain_s=10.0,
        probe_ports=(srv.port, srv.health_port) if probe else (),
        server_pids=srv.serving_pids(),
        server_cores=servers.cores()[0],
    )


def _pss_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KiB from /proc/PID/smaps_rollup."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0])
    return values["Rss"], values["Pss"]


def _two_workers(model_dir: Path, logdir: Path) -> dict[str, Any]:
    port, health = servers.free_port(), servers.free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MODEL_DIR": str(model_dir),
        "WEB_CONCURRENCY": "2",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "HEALTH_PORT": str(health),
        "STATS_DB": str(logdir / "stats2.db"),
    }
    log = open(logdir / "two-workers.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            str(ROOT / "gunicorn.conf.py"),
            "--no-control-socket",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        workers: list[int] = []
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.5)
            workers = [p for p in procstat.tree(proc.pid) if p != proc.pid]
        time.sleep(3)  # both loaded their model
        # One request per worker touches the weights in both.
        run_load(
            LoadSpec(
                port=port,
                body=_body(16),
                stream=True,
                expect_tokens=16,
                concurrency=4,
                warmup_s=0.2,
                duration_s=1.0,
                drain_s=5.0,
                spin=False,
            )
        )
        per = {str(p): dict(zip(("rss_kib", "pss_kib"), _pss_kb(p), strict=True)) for p in workers}
        weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) // 1024
        return {"workers": per, "weights_kib": weights}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument(
        "--data",
        default=os.environ.get("GREENSERVE_SHARED_DATA") or str(ROOT.parent / "shared" / "data"),
        help="folder holding stories260K/",
    )
    args = parser.parse_args(argv)
    src = Path(args.data) / "stories260K"
    work = Path(tempfile.mkdtemp(prefix="greenserve-llama-bench-"))
    model_dir = convert_llama2c(src / "stories260K.bin", src / "tok512.bin", work / "stories260K")
    srv = servers.start(
        "greenserve", work, {"MODEL_DIR": str(model_dir), "STATS_DB": str(work / "stats.db")}
    )
    runs = []
    try:
        for conc in (1, 8, 32):
            runs.append(run_load(_spec(srv, conc, args.window)))
            srv.wait_idle()
        healthz = run_load(_spec(srv, 8, args.window, probe=True))
    finally:
        srv.stop()
    result = {
        "model": "stories260K",
        "max_tokens": MAX_TOKENS,
        "runs": runs,
        "healthz_8": healthz,
        "two_workers": _two_workers(model_dir, work),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stamp}-llama.json").write_text(json.dumps(result, indent=2) + "\n")
    md = _markdown(result)
    (RESULTS / f"{stamp}-llama.md").write_text(md)
    print(md)
    return result


def _markdown(result: dict[str, Any]) -> str:
    base = result["runs"][0]["tokens_per_s"]
    lines = [
        "| streams | tok/s | × 1 stream | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        t, i = run["ttft_ms"], run["itl_ms"]
        lines.append(
            f"| {run['concurrency']} | {run['tokens_per_s']:.0f} | {run['tokens_per_s'] / base:.2f}× "
            f"| {t['p50']} / {t['p99']} | {i['p50']} / {i['p99']} | {sum(run['errors'].values())} |"
        )
    probes = result["healthz_8"].get("healthz_ms", {})
    p99 = ", ".join(
        f"port {port}: p50 {v['p50']} / p99 {v['p99']} ms" for port, v in probes.items()
    )
    lines.append("")
    lines.append(f"- `/healthz` while 8 streams generate: {p99}.")
    workers = result["two_workers"]["workers"]
    rss = ", ".join(
        f"RSS {w['rss_kib'] // 1024} MiB / PSS {w['pss_kib'] // 1024} MiB" for w in workers.values()
    )
    lines.append(
        f"- 2 workers (weights file {result['two_workers']['weights_kib']} KiB, "
        f"memory-mapped): {rss}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
