"""Run the whole benchmark with one command: ``python -m bench.run`` (~6 min) or ``--quick`` (~45 s).

Starts each server on its own core (greenserve with one gevent worker, the canned-frames
``gevent.pywsgi`` ceiling, the FastAPI + uvicorn reference), drives it from this process on another
core, and writes ``bench/results/<UTC time>-<mode>.json`` plus the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import micro, procstat, report, servers
from bench.harness import RESULTS, ElapsedLog, utc_stamp, write_pair
from bench.hold import run_hold
from bench.loadgen import LoadSpec, run_load

# Benchmark-only server settings: room for every connection of every scenario on one worker; slots
# and queue keep their defaults (sized to the model: 1024 each for the bigram).
GREENSERVE_ENV = {"WORKER_CONNECTIONS": "12000"}
# The hold scenario holds 10,000 streams (slots raised for it), read slowly for longer than the default
# send timeout allows.
HOLD_ENV = {
    **GREENSERVE_ENV,
    "MAX_SLOTS": "12000",
    "MAX_QUEUE": "12000",
    "SEND_TIMEOUT_S": "600",
    "REQUEST_TIMEOUT_S": "600",
}

FULL_MODE: dict[str, Any] = {
    "stream": (1, 16, 128, 1024),
    "plain": (1, 16, 128, 1024),
    # The same clients keeping their connection open between requests (the runs above open
    # one per request, as most clients and every load balancer health check do).
    "stream-keepalive": (16, 128),
    "plain-keepalive": (16, 128),
    "warmup_s": 2.0,
    "ramp_s": 2.0,
    "window_s": 8.0,
    "drain_s": 3.0,
    "healthz_streams": 1000,
    "healthz_json": 50,
    "healthz_burst": 500,
    "healthz_window_s": 6.0,
    "hold": {"target": 10_000, "ramp_s": 10.0, "hold_s": 10.0},
    "micro": {"requests": 40, "repeats": 5},
}
MODES: dict[str, dict[str, Any]] = {
    "full": FULL_MODE,
    # Fewer runs, shorter windows and a smaller hold; the /healthz loads stay those of the full run.
    "quick": {
        **FULL_MODE,
        "stream": (1, 128),
        "plain": (16,),
        "stream-keepalive": (128,),
        "plain-keepalive": (16,),
        "warmup_s": 0.5,
        "ramp_s": 0.5,
        "window_s": 2.0,
        "drain_s": 1.0,
        "healthz_window_s": 2.0,
        "hold": {"target": 2_000, "ramp_s": 3.0, "hold_s": 3.0},
        "micro": {"requests": 10, "repeats": 3},
    },
}


def _body(stream: bool, max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "bigram", "prompt": "ROMEO:", "max_tokens": max_tokens, "stream": stream}
    ).encode()


def wait_quiet(max_s: float, busy_cores: float = 0.1) -> float:
    """Wait up to ``max_s`` until the machine's cores are idle (under ``busy_cores`` busy over 2 s).

    On a shared machine other processes disturb a run; this waits them out. Returns the busy cores
    measured last.
    """
    cores = servers.cores()[0] + servers.cores()[1]
    deadline = time.monotonic() + max_s
    while True:
        before = procstat.core_busy_s(cores)
        time.sleep(2.0)
        busy = (procstat.core_busy_s(cores) - before) / 2.0
        if busy < busy_cores or time.monotonic() >= deadline:
            return busy


def _load(
    srv: servers.Server, mode: dict, stream: bool, conc: int, keepalive: bool = False
) -> dict[str, Any]:
    max_tokens = 256 if stream else 64
    if mode.get("wait_quiet_s"):
        wait_quiet(mode["wait_quiet_s"])
    spec = LoadSpec(
        port=srv.port,
        body=_body(stream, max_tokens),
        stream=stream,
        expect_tokens=max_tokens,
        concurrency=conc,
        warmup_s=mode["warmup_s"],
        ramp_s=mode["ramp_s"],
        duration_s=mode["window_s"],
        drain_s=mode["drain_s"],
        keepalive=keepalive,
        server_pids=srv.serving_pids(),
        server_cores=servers.cores()[0],
    )
    result = run_load(spec)
    srv.wait_idle()
    return result


def _healthz(
    srv: servers.Server, mode: dict, conc: int, stream: bool = True, burst: bool = False
) -> dict[str, Any]:
    """Probe ``/healthz`` on both ports, one probe at a time each every 20 ms, while ``conc``
    clients run: long streams (none ends), closed-loop 64-token JSON requests, or, with ``burst``,
    ``conc`` long streams that all arrive at once (the window opens as they connect)."""
    if mode.get("wait_quiet_s"):
        wait_quiet(mode["wait_quiet_s"])
    max_tokens = 4096 if stream else 64
    spec = LoadSpec(
        port=srv.port,
        body=_body(stream, max_tokens),
        stream=stream,
        expect_tokens=max_tokens,
        concurrency=conc,
        warmup_s=0.0 if burst else 3.0,
        ramp_s=0.0 if burst else 2.0,
        duration_s=mode["healthz_window_s"],
        drain_s=0.0 if stream else mode["drain_s"],
        probe_ports=(srv.port, srv.health_port),
        server_pids=srv.serving_pids(),
        server_cores=servers.cores()[0],
    )
    result = run_load(spec)
    srv.wait_idle()
    return result


def _family(name: str, mode: dict, logdir: Path, log) -> list[dict[str, Any]]:
    srv = servers.start(name, logdir, GREENSERVE_ENV if name == "greenserve" else None)
    runs = []
    try:
        for scenario in ("stream", "plain", "stream-keepalive", "plain-keepalive"):
            stream, keepalive = scenario.startswith("stream"), scenario.endswith("keepalive")
            for conc in mode[scenario]:
                result = _load(srv, mode, stream, conc, keepalive)
                runs.append({"server": name, "scenario": scenario, **result})
                log(
                    f"{name:10s} {runs[-1]['scenario']:6s} c={conc:<5d} "
                    f"{result['tokens_per_s']:>9.0f} tok/s  ttft p99 {result['ttft_ms']['p99']} ms  "
                    f"errors {result['errors']}  client busy {result['client_busy']}"
                )
        if name == "greenserve" and mode["healthz_streams"]:
            for scenario, conc, kind in (
                ("healthz", mode["healthz_streams"], {}),
                ("healthz-json", mode["healthz_json"], {"stream": False}),
                ("healthz-burst", mode["healthz_burst"], {"burst": True}),
            ):
                result = _healthz(srv, mode, conc, **kind)
                runs.append({"server": name, "scenario": scenario, **result})
                log(f"{name:10s} {scenario} c={conc}: {result['healthz_ms']}")
    finally:
        srv.stop()
    return runs


def _hold(mode: dict, logdir: Path) -> dict[str, Any]:
    if mode.get("wait_quiet_s"):
        wait_quiet(mode["wait_quiet_s"])
    srv = servers.start("greenserve", logdir / "hold", HOLD_ENV)
    try:
        return run_hold(
            srv.port,
            server_pids=srv.serving_pids(),
            probe_ports=(srv.port, srv.health_port),
            **mode["hold"],
        )
    finally:
        srv.stop()


def _meta(mode_name: str, argv: list[str]) -> dict[str, Any]:
    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(
                cmd, capture_output=True, text=True, cwd=servers.ROOT
            ).stdout.strip()
        except OSError:
            return ""

    server_cores, client_cores = servers.cores()
    return {
        "mode": mode_name,
        "command": "python -m bench.run " + " ".join(argv),
        "utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": sh("git", "rev-parse", "--short", "HEAD")
        + ("+dirty" if sh("git", "status", "--porcelain", "--untracked-files=no") else ""),
        "python": platform.python_version(),
        "cpu": sh("sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "cpus": os.cpu_count(),
        "server_cores": server_cores,
        "client_cores": client_cores,
        "server_env": GREENSERVE_ENV,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print progress and the table; return the results."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (about 45 s)")
    parser.add_argument("--servers", default=",".join(servers.NAMES), help="comma-separated subset")
    parser.add_argument("--no-hold", action="store_true", help="skip the hold scenario")
    parser.add_argument("--no-micro", action="store_true", help="skip the micro-benchmark")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/<time>.json)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to leave the cores idle",
    )
    args = parser.parse_args(argv)
    mode_name = "quick" if args.quick else "full"
    mode = {**MODES[mode_name], "wait_quiet_s": args.wait_quiet}
    _, client_cores = servers.cores()
    os.sched_setaffinity(0, client_cores)
    log = ElapsedLog()
    stamp = utc_stamp()
    out = args.out or RESULTS / f"{stamp}-{mode_name}.json"
    logdir = Path("/tmp") / f"greenserve-bench-{stamp}"

    results: dict[str, Any] = {"meta": _meta(mode_name, argv), "runs": []}
    all_cores = servers.cores()[0] + servers.cores()[1]
    before = procstat.core_busy_s(all_cores)
    time.sleep(1.0)
    results["meta"]["busy_cores_before"] = round(procstat.core_busy_s(all_cores) - before, 2)
    if results["meta"]["busy_cores_before"] > 0.1:
        log(
            f"warning: {results['meta']['busy_cores_before']} cores busy before the run; other "
            "processes will disturb it (see server_core_other_util in each result)"
        )
    if not args.no_micro:
        if mode["wait_quiet_s"]:
            wait_quiet(mode["wait_quiet_s"])
        results["micro"] = micro.run(**mode["micro"])
        log(f"micro: {results['micro']}")
    for name in args.servers.split(","):
        results["runs"] += _family(name.strip(), mode, logdir, log)
    if not args.no_hold and "greenserve" in args.servers:
        results["hold"] = _hold(mode, logdir)
        log(f"hold: {results['hold']}")
    results["meta"]["duration_s"] = log.elapsed_s()
    results["summary"] = report.summary(results)
    table = report.markdown(results)
    write_pair(out, results, table, indent=1)
    print(table)
    log(f"wrote {out} and {out.with_suffix('.md').name}; server logs in {logdir}")
    return results


if __name__ == "__main__":
    main()
