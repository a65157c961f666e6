"""What a shadow variant costs its primary's clients: SmolLM2 alone against SmolLM2 with a 10 %
shadow of the same weights.

Two greenserve servers (one gevent worker each, default settings, SmolLM2-135M Q4_1 from
``python -m model.fetch smollm2``), both pinned to the server core, this client on the other
(``bench.servers``): ``none`` serves a models file with ``smollm2`` alone, ``shadow`` the same plus
``[models.smollm2.variants.copy]`` with ``source = "smollm2"`` and ``shadow = 10``. Every request
asks for 64 greedy tokens (``ignore_eos``, streamed) after one of :data:`PROMPTS` in turn. The
loads: closed loops of ``--conc`` clients (default 1, 2 and 4; each sends its next request when its
answer ends), which leave a worker idle only between one answer and the next request (1 client) or
hardly ever; and an open loop (``--open``, default one request every 1.5 s on average, at
exponential gaps of one seeded schedule), whose idle gaps are where shadows run, and where a
client's request comes while one runs. Each load runs ``--warmup`` seconds, then a measured
``--window``. The two configurations alternate (none, shadow, none, shadow, ... for ``--rounds``
rounds), so that a drift of the shared machine's load touches both; before each window both
servers are waited on to go quiet (the shadow server runs what its queue still holds once the load
stops).

Per window: the primary's TTFT p50 / p90 (client side: request sent to first token event, for the
requests sent in the window), total tok/s (token events received in the window, over its length),
and, for ``shadow``, the mirrored requests' outcomes counted in the window (from its ``/metrics``:
exact, diverged, dropped by reason) and once its queue ran out after the window. Pooled per
configuration and load: TTFT p50 over every round's requests, tok/s summed over the rounds'
windows, and the ratios shadow / none (target: within 1.15 ×).

``python -m bench.shadow_cost`` (~11 min with the defaults) writes
``bench/results/<UTC time>-shadow-cost.json`` and ``.md`` with the CPU (model name and vector
flags, from /proc/cpuinfo) and the load average before every window.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import servers
from bench.harness import RESULTS, ElapsedLog, utc_stamp, write_pair
from bench.prefill_share import token_times
from model.fetch import fetch

PROMPTS = (
    "Once upon a time",
    "The history of the Roman Empire",
    "Write a short poem about the sea.",
    "How do plants make their food?",
    "In a small village by the mountains",
    "The best way to learn a language is",
    "Explain what a computer does.",
    "My favourite food is",
)
BODY = {"model": "smollm2", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
SHADOW_PERCENT = 10
MODELS = {
    "none": '[models.smollm2]\nsource = "smollm2"\n',
    "shadow": '[models.smollm2]\nsource = "smollm2"\n\n[models.smollm2.variants.copy]\n'
    f'source = "smollm2"\nshadow = {SHADOW_PERCENT}\n',
}
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
OUTCOMES = ("exact", "diverged", "dropped")


@dataclass(frozen=True)
class Load:
    """A load: ``clients`` in a closed loop, or (``clients`` 0) an open loop of one request every
    ``gap_s`` seconds on average."""

    clients: int = 0
    gap_s: float = 0.0

    @property
    def label(self) -> str:
        """How tables name it."""
        if self.clients:
            return f"{self.clients} client{'s' if self.clients > 1 else ''}"
        return f"open, 1 per {self.gap_s:g} s"


REASONS = ("queue_full", "preempted", "failed", "shutdown")


def cpu() -> dict[str, Any]:
    """Return the CPU's model name, its count here and the vector flags it has (/proc/cpuinfo)."""
    text = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in text if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text if ln.startswith("flags")), [])
    return {"model": name, "cpus": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def shadow_counts(port: int) -> dict[str, int]:
    """The shadow's outcomes and drop reasons so far, from ``/metrics`` (zeros without one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = dict.fromkeys((*OUTCOMES, *REASONS), 0)
    for family in text_string_to_metric_families(text):
        if family.name in ("greenserve_shadow_requests", "greenserve_shadow_dropped"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels.get("outcome") or sample.labels["reason"]
                    out[key] += int(sample.value)
    return out


def one(port: int, k: int, requests: list[tuple]) -> None:
    """Send request ``k`` (prompt ``k`` of :data:`PROMPTS`, in turn); append ``(sent, token
    times)``."""
    times: list[float] = []
    sent = time.perf_counter()
    token_times(port, "/v1/completions", {**BODY, "prompt": PROMPTS[k % len(PROMPTS)]}, times)
    requests.append((sent, times))


def closed_loop(port: int, first: int, stop: threading.Event, requests: list[tuple]) -> None:
    """One client: send requests one after another until ``stop``."""
    k = first
    while not stop.is_set():
        one(port, k, requests)
        k += 1


def open_loop(port: int, gap_s: float, stop: threading.Event, requests: list[tuple]) -> None:
    """Send a request at exponentially distributed gaps of mean ``gap_s`` (the same seeded
    schedule every run), each on a thread of its own, until ``stop``; then wait for them."""
    rng = random.Random(1)
    senders: list[threading.Thread] = []
    at, k = time.perf_counter(), 0
    while not stop.wait(max(0.0, at - time.perf_counter())):
        senders.append(threading.Thread(target=one, args=(port, k, requests)))
        senders[-1].start()
        at, k = at + rng.expovariate(1.0 / gap_s), k + 1
    for sender in senders:
        sender.join()


def window(srv: servers.Server, load: Load, warmup_s: float, window_s: float) -> dict[str, Any]:
    """Apply ``load`` for ``warmup_s`` then ``window_s`` seconds; return the window's figures."""
    stop = threading.Event()
    requests: list[tuple[float, list[float]]] = []
    if load.clients:
        threads = [
            threading.Thread(target=closed_loop, args=(srv.port, i * 3, stop, requests))
            for i in range(load.clients)
        ]
    else:
        threads = [threading.Thread(target=open_loop, args=(srv.port, load.gap_s, stop, requests))]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    t0 = time.perf_counter()
    before = shadow_counts(srv.port)
    time.sleep(window_s)
    t1 = time.perf_counter()
    during = shadow_counts(srv.port)
    stop.set()
    for t in threads:
        t.join()
    ttft = [(times[0] - sent) * 1000 for sent, times in requests if t0 <= sent < t1 and times]
    tokens = sum(t0 <= t < t1 for _, times in requests for t in times)
    srv.wait_idle(max_s=120.0)
    after = shadow_counts(srv.port)
    ttft.sort()
    return {
        "requests": len(ttft),
        "ttft_ms": ttft,
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p90_ms": round(ttft[int(len(ttft) * 0.9)], 1),
        "tokens": tokens,
        "window_s": round(t1 - t0, 3),
        "tok_per_s": round(tokens / (t1 - t0), 1),
        "shadow_in_window": {k: during[k] - before[k] for k in during},
        "shadow_after_window": {k: after[k] - during[k] for k in after},
    }


def pooled(runs: list[dict], config: str, load: str) -> dict[str, Any]:
    """Pool the windows of one configuration under one load."""
    mine = [r for r in runs if r["config"] == config and r["load"] == load]
    ttft = sorted(x for r in mine for x in r["ttft_ms"])
    tokens = sum(r["tokens"] for r in mine)
    seconds = sum(r["window_s"] for r in mine)
    shadow = {
        k: sum(r["shadow_in_window"][k] + r["shadow_after_window"][k] for r in mine)
        for k in (*OUTCOMES, *REASONS)
    }
    return {
        "requests": len(ttft),
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p90_ms": round(ttft[int(len(ttft) * 0.9)], 1),
        "tok_per_s": round(tokens / seconds, 1),
        "shadow": shadow,
    }


def markdown(result: dict[str, Any]) -> str:
    """Return the results as Markdown."""
    lines = [
        f"# A {SHADOW_PERCENT} % shadow's cost to its primary ({result['started']})",
        "",
        f"CPU {result['cpu']['model']} ({result['cpu']['cpus']} CPUs; {', '.join(result['cpu']['flags'])}); "
        "two servers of one gevent worker each pinned to one core, the client on the other; "
        f"SmolLM2-135M Q4_1, {BODY['max_tokens']} greedy tokens a request; "
        f"windows of {result['window_s']:g} s after {result['warmup_s']:g} s of warm-up, "
        "none and shadow alternated.",
        "",
        "| load | none TTFT p50 (ms) | shadow TTFT p50 | ratio | none tok/s | shadow tok/s | "
        "ratio (none / shadow) | shadows exact / diverged / dropped (queue_full, preempted) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["pooled"]:
        a, b, s = row["none"], row["shadow"], row["shadow"]["shadow"]
        lines.append(
            f"| {row['load']} | {a['ttft_p50_ms']} | {b['ttft_p50_ms']} | "
            f"{row['ttft_ratio']:.3f} | {a['tok_per_s']} | {b['tok_per_s']} | "
            f"{row['tok_per_s_ratio']:.3f} | {s['exact']} / {s['diverged']} / {s['dropped']} "
            f"({s['queue_full']}, {s['preempted']}) |"
        )
    lines += [
        "",
        "Each window (in the order run; load average at its start):",
        "",
        "| load | config | load avg | TTFT p50 / p90 (ms) | tok/s | requests | "
        "shadows in window (exact, diverged, queue_full, preempted) | after it |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in result["runs"]:
        w, a = r["shadow_in_window"], r["shadow_after_window"]
        lines.append(
            f"| {r['load']} | {r['config']} | {r['loadavg']} | {r['ttft_p50_ms']} / "
            f"{r['ttft_p90_ms']} | {r['tok_per_s']} | {r['requests']} | "
            f"{w['exact']}, {w['diverged']}, {w['queue_full']}, {w['preempted']} | "
            f"{a['exact']}, {a['diverged']}, {a['queue_full']}, {a['preempted']} |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    """Measure and write the result files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, nargs="*", default=[1, 2, 4], help="closed loops")
    parser.add_argument(
        "--open", type=float, nargs="*", default=[1.5], help="open loops: mean seconds between"
    )
    parser.add_argument("--rounds", type=int, default=2, help="none/shadow pairs per load")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before each window")
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured")
    args = parser.parse_args()
    loads = [Load(clients=c) for c in args.conc] + [Load(gap_s=g) for g in args.open]
    log = ElapsedLog()
    fetch("smollm2")
    started = utc_stamp()
    folder = Path(tempfile.mkdtemp(prefix="greenserve-shadow-cost-"))
    running: dict[str, servers.Server] = {}
    try:
        for config, text in MODELS.items():
            (folder / f"{config}.toml").write_text(text)
            env = {"MODELS_FILE": str(folder / f"{config}.toml")}
            running[config] = servers.start("greenserve", folder / config, env, ready_s=300)
            log(f"{config} server ready on port {running[config].port}")
        runs = []
        for load in loads:
            for round_ in range(args.rounds):
                for config, srv in running.items():  # none, shadow, none, shadow, ...
                    for other in running.values():
                        other.wait_idle(max_s=120.0)
                    loadavg = [round(x, 2) for x in os.getloadavg()]
                    figures = window(srv, load, args.warmup, args.window)
                    runs.append({"load": load.label, "round": round_, "config": config,
                                 "loadavg": loadavg, **figures})  # fmt: skip
                    log(json.dumps({k: v for k, v in runs[-1].items() if k != "ttft_ms"}))
    finally:
        for srv in running.values():
            srv.stop()
    table = []
    for load in loads:
        none, shadow = pooled(runs, "none", load.label), pooled(runs, "shadow", load.label)
        table.append({
            "load": load.label,
            "none": none,
            "shadow": shadow,
            "ttft_ratio": round(shadow["ttft_p50_ms"] / none["ttft_p50_ms"], 3),
            "tok_per_s_ratio": round(none["tok_per_s"] / shadow["tok_per_s"], 3),
        })  # fmt: skip
    result = {
        "bench": "shadow_cost",
        "started": started,
        "cpu": cpu(),
        "shadow_percent": SHADOW_PERCENT,
        "body": BODY,
        "warmup_s": args.warmup,
        "window_s": args.window,
        "rounds": args.rounds,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "pooled": table,
        "runs": runs,
    }
    path = RESULTS / f"{started}-shadow-cost.json"
    write_pair(path, result, markdown(result))
    log(f"wrote {path}")
    print(markdown(result))


if __name__ == "__main__":
    main()
