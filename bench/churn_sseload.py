"""Connection churn through the shared Rust load generator: greenserve, the canned server, FastAPI.

``sseload`` (``../shared/tools/sseload``, built with ``cargo build --release``) opens one connection
per request with no ramp, as many clients and every load-balancer health check do. For each round,
in order, each server (one process pinned to the server core; ``sseload --spin`` pinned to the
client core) takes:

- **stream**: sseload's defaults at C = 128 (1,000 requests of 256 tokens, T = 1, prompt
  "ROMEO:"): tok/s and TTFT p50 / p90 / p99;
- **json**: the same, non-streamed, C = 128: req/s;
- **probes** (greenserve only): ``GET /healthz`` on a new connection every 10 ms, on the API port,
  while 50 closed-loop JSON clients run (sseload ``--no-stream -c 50``, not busy-polling: the
  prober runs beside it on the client core): p50 / p99; then the same probe on both ports while
  500 streams arrive at once (``-c 500 -n 500``): p50 / p99 / max.

Between runs it waits for loopback's ``TIME_WAIT`` sockets to drain below ``--max-time-wait`` (the
churn leaves tens of thousands, which slow the client's ``connect``; widen
``net.ipv4.ip_local_port_range`` too). Medians over the rounds are what to compare: a run moves
±25 % on this machine. ``--before DIR`` adds greenserve from another checkout (a worktree of an
earlier commit) as ``before``, alternated with the current one.

    python -m bench.churn_sseload --sseload PATH [--rounds 3] [--before DIR]

Writes ``bench/results/<time>-churn-sseload.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import servers
from bench.harness import RESULTS, ElapsedLog, utc_stamp, write_pair
from bench.procstat import ms

PROBE_EVERY_S = 0.01


def time_wait_sockets() -> int:
    """Return the number of TCP sockets in ``TIME_WAIT`` (``ss -tan``)."""
    out = subprocess.run(["ss", "-tan", "state", "time-wait"], capture_output=True, text=True)
    return max(0, len(out.stdout.splitlines()) - 1)


def sseload(path: str, port: int, *args: str, spin: bool = True) -> dict[str, Any]:
    """Run ``sseload`` pinned to the client core against ``port`` (busy-polling with ``spin``);
    return its JSON summary.

    Raises:
        RuntimeError: sseload failed (its stderr in the message).
    """
    client = ",".join(map(str, servers.cores()[1]))
    argv = ["taskset", "-c", client, path, "--url", f"http://127.0.0.1:{port}/v1/completions"]
    done = subprocess.run(
        [*argv, *(["--spin"] if spin else []), *args], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"sseload failed: {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_latencies(port: int, stop: threading.Event, out: list[float]) -> None:
    """Append the seconds each ``GET /healthz`` on a new connection took, one every 10 ms, until
    ``stop`` is set."""
    while not stop.is_set():
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        conn.close()
        out.append(time.perf_counter() - t0)
        stop.wait(PROBE_EVERY_S)


def one_round(srv: servers.Server, path: str, probes: bool, settle: Any) -> dict[str, Any]:
    """Return one round's stream, JSON (and probe) figures for ``srv``."""
    settle()
    stream = sseload(path, srv.port, "-c", "128")
    settle()
    plain = sseload(path, srv.port, "-c", "128", "--no-stream")
    row = {
        "stream_tok_s": round(stream["tokens_per_s"]),
        "ttft_ms": stream["ttft_ms"],
        "stream_errors": stream["errors_total"],
        "json_req_s": round(plain["requests_per_s"]),
        "json_errors": plain["errors_total"],
    }
    if probes:
        settle()
        stop, lat = threading.Event(), []
        prober = threading.Thread(target=probe_latencies, args=(srv.port, stop, lat))
        prober.start()
        # Not busy-polling: the prober shares the client core and must not wait for its turn.
        clients = sseload(
            path, srv.port, "-c", "50", "--no-stream", "-n", "1000000", "-d", "5", spin=False
        )
        stop.set()
        prober.join()
        row["healthz_ms_50_json"] = ms(lat, [0.5, 0.99])
        row["healthz_n"] = len(lat)
        row["json_clients_errors"] = clients["errors_total"]
        settle()
        row.update(burst_probes(srv, path))
    return row


def burst_probes(srv: servers.Server, path: str, streams: int = 500) -> dict[str, Any]:
    """Return the ``/healthz`` latencies on both ports while ``streams`` streams arrive at once."""
    stop = threading.Event()
    lat: dict[int, list[float]] = {srv.port: [], srv.health_port or srv.port: []}
    probers = [threading.Thread(target=probe_latencies, args=(p, stop, v)) for p, v in lat.items()]
    for prober in probers:
        prober.start()
    out = sseload(path, srv.port, "-c", str(streams), "-n", str(streams))
    stop.set()
    for prober in probers:
        prober.join()
    api, health = lat.values()
    return {
        f"healthz_ms_{streams}_at_once": ms(api, [0.5, 0.99, 1.0]),
        f"health_port_ms_{streams}_at_once": ms(health, [0.5, 0.99, 1.0]),
        f"errors_{streams}_at_once": out["errors_total"],
    }


def median_of(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    """Return the median over ``rows`` of ``row[key]`` (or ``row[key][sub]``)."""
    return statistics.median(r[key][sub] if sub else r[key] for r in rows)


def markdown(result: dict[str, Any]) -> str:
    """Return the medians as a Markdown table."""
    lines = [
        f"# Connection churn, sseload --spin, C = 128 ({result['rounds']} rounds, medians)",
        "",
        "| server | stream tok/s | TTFT p50 / p99 ms | JSON req/s | /healthz p99 ms, 50 JSON clients "
        "| /healthz max ms, 500 streams at once (API / health port) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["medians"].items():
        hz, burst = m.get("healthz_p99_ms"), m.get("burst_max_ms")
        lines.append(
            f"| {name} | {m['stream_tok_s']:,.0f} | {m['ttft_p50_ms']:.1f} / {m['ttft_p99_ms']:.1f} "
            f"| {m['json_req_s']:,.0f} | {'–' if hz is None else f'{hz:.1f}'} "
            f"| {'–' if burst is None else f'{burst[0]:.1f} / {burst[1]:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rounds; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sseload", required=True, help="the built sseload binary")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a checkout to run as greenserve 'before'")
    parser.add_argument("--max-time-wait", type=int, default=1500)
    args = parser.parse_args(argv)
    log = ElapsedLog()
    os.sched_setaffinity(
        0, servers.cores()[1]
    )  # the prober runs on the client core, not the server's

    def settle() -> None:
        while time_wait_sockets() > args.max_time_wait:
            time.sleep(2)

    work = Path(tempfile.mkdtemp(prefix="churn-"))
    started = [
        ("canned", servers.start("pywsgi", work / "canned")),
        ("fastapi", servers.start("fastapi", work / "fastapi")),
    ]
    if args.before is not None:
        started.append(("before", servers.start("greenserve", work / "before", root=args.before)))
    started.append(("greenserve", servers.start("greenserve", work / "greenserve")))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in started}
    try:
        for r in range(args.rounds):
            for name, srv in started:
                row = one_round(srv, args.sseload, srv.name == "greenserve", settle)
                runs[name].append(row)
                log(f"round {r + 1} {name}: {json.dumps(row)}")
    finally:
        for _, srv in started:
            srv.stop()
    medians: dict[str, dict[str, Any]] = {}
    for name, rows in runs.items():
        m: dict[str, Any] = {
            "stream_tok_s": median_of(rows, "stream_tok_s"),
            "ttft_p50_ms": median_of(rows, "ttft_ms", "p50"),
            "ttft_p99_ms": median_of(rows, "ttft_ms", "p99"),
            "json_req_s": median_of(rows, "json_req_s"),
            "healthz_p99_ms": None,
            "burst_max_ms": None,
        }
        if "healthz_ms_50_json" in rows[0]:
            m["healthz_p99_ms"] = median_of(rows, "healthz_ms_50_json", "p99")
            m["burst_max_ms"] = [
                median_of(rows, "healthz_ms_500_at_once", "max"),
                median_of(rows, "health_port_ms_500_at_once", "max"),
            ]
        medians[name] = m
    result = {"rounds": args.rounds, "runs": runs, "medians": medians}
    ours = medians["greenserve"]
    result["ratios"] = {
        "stream_vs_canned": round(ours["stream_tok_s"] / medians["canned"]["stream_tok_s"], 3),
        "json_vs_fastapi": round(ours["json_req_s"] / medians["fastapi"]["json_req_s"], 3),
    }
    text = markdown(result)
    print(text, json.dumps(result["ratios"]))
    write_pair(RESULTS / f"{utc_stamp()}-churn-sseload.json", result, text)
    return result


if __name__ == "__main__":
    main()
