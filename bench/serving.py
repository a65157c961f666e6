"""What the model-serving benchmarks share: streamed load runs, two workers' memory, the tables.

Used by ``bench.llama_serving`` (stories260K) and ``bench.smollm2_serving`` (SmolLM2 against
llama.cpp). Every run is a closed loop of streamed answers of a fixed length (see
``bench.loadgen``); two workers show whether they share the memory-mapped weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import procstat, servers
from bench.loadgen import LoadSpec, run_load


def stream_spec(
    srv: servers.Server,
    body: bytes,
    max_tokens: int,
    concurrency: int,
    window_s: float,
    *,
    probe_every_s: float | None = None,
    extra_events: int = 0,
    drain_s: float = 10.0,
    warmup_s: float = 1.0,
) -> LoadSpec:
    """Return a streamed load run of ``concurrency`` answers of ``max_tokens`` tokens on ``srv``.

    Args:
        srv: the server under test (its serving processes and core are measured).
        body: the JSON request body (asks for a stream of exactly ``max_tokens`` tokens).
        max_tokens: tokens every answer carries.
        concurrency: streams in flight.
        window_s: seconds measured (after ``warmup_s``).
        probe_every_s: when set, ``GET /healthz`` on greenserve's API and health ports this often
            (seconds) throughout the run.
        extra_events: data events an answer carries besides its tokens (see ``LoadSpec``).
        drain_s: seconds after the window for the answers started in it to finish; every request
            may wait that long, so a server that answers one request at a time needs about
            ``concurrency`` answers' time here for its TTFT to be measured at all.
        warmup_s: seconds of load before the window; the first streams start spread over half of
            it, so that a closed loop of long answers does not run in lockstep.
    """
    probe = probe_every_s is not None and srv.health_port is not None
    return LoadSpec(
        port=srv.port,
        body=body,
        stream=True,
        expect_tokens=max_tokens,
        extra_events=extra_events,
        concurrency=concurrency,
        warmup_s=warmup_s,
        ramp_s=warmup_s / 2,
        duration_s=window_s,
        drain_s=drain_s,
        timeout_s=window_s + drain_s + 2.0,
        probe_ports=(srv.port, srv.health_port) if probe else (),
        probe_every_s=probe_every_s or 0.02,
        server_pids=srv.serving_pids(),
        server_cores=servers.cores()[0],
    )


def two_workers(
    logdir: Path, env: dict[str, str], body: bytes, max_tokens: int, weights_kib: int
) -> dict[str, Any]:
    """Start greenserve with 2 workers, let both answer a few streams, and read their memory.

    Args:
        logdir: where the server's log goes.
        env: greenserve's settings (``MODEL_DIR``...).
        body: a streamed request body for ``max_tokens`` tokens (short: it only has to touch the
            weights in both workers).
        max_tokens: tokens each answer carries.
        weights_kib: size of the memory-mapped weight file(s), KiB.

    Returns:
        ``{"workers": {pid: {"rss_kib", "pss_kib"}}, "weights_kib": ...}``.

    Raises:
        RuntimeError: the server did not start, or fewer than 2 workers appeared within 30 s.
    """
    srv = servers.start("greenserve", logdir, env, workers=2)
    try:
        deadline = time.monotonic() + 30
        while len(srv.serving_pids()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"2 workers did not start:\n{srv.log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(3)  # both loaded their model
        # Several concurrent answers land on both workers and touch every weight page in each.
        spec = LoadSpec(
            port=srv.port,
            body=body,
            stream=True,
            expect_tokens=max_tokens,
            concurrency=4,
            warmup_s=0.2,
            duration_s=2.0,
            drain_s=20.0,
            spin=False,
            server_pids=srv.serving_pids(),
        )
        run_load(spec)
        per = {}
        for pid in srv.serving_pids():
            rss, pss = procstat.rss_pss_kib(pid)
            per[str(pid)] = {"rss_kib": rss, "pss_kib": pss}
        return {"workers": per, "weights_kib": weights_kib}
    finally:
        srv.stop()


def runs_table(runs: list[dict[str, Any]]) -> list[str]:
    """Return Markdown table lines: streams, tok/s, × 1 stream, TTFT and ITL, server CPU, errors.

    Tokens per server CPU-second (the server's own user + system time) move far less than tokens/s
    when other processes share the server's core.
    """
    base = runs[0]["tokens_per_s"] or 1.0
    lines = [
        "| streams | tok/s | × 1 stream | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| server CPU | tok per server CPU-s | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        t, i = run["ttft_ms"], run["itl_ms"]
        lines.append(
            f"| {run['concurrency']} | {run['tokens_per_s']:.1f} "
            f"| {run['tokens_per_s'] / base:.2f}× | {t['p50']} / {t['p99']} "
            f"| {i['p50']} / {i['p99']} | {run['server_cpu_util']} "
            f"| {run['tokens_per_server_cpu_s']} | {sum(run['errors'].values())} |"
        )
    return lines


def healthz_text(run: dict[str, Any]) -> str:
    """Return ``port N: p50 a / p99 b ms`` for each probed port of ``run``."""
    probes = run.get("healthz_ms", {})
    return ", ".join(
        f"port {port}: p50 {v['p50']} / p99 {v['p99']} ms (n={v['n']})"
        for port, v in probes.items()
    )


def workers_text(two: dict[str, Any]) -> str:
    """Return one line per worker of :func:`two_workers`'s result: RSS and PSS in MiB."""
    return ", ".join(
        f"RSS {w['rss_kib'] // 1024} MiB / PSS {w['pss_kib'] // 1024} MiB"
        for w in two["workers"].values()
    )
