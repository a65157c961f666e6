"""Neighbours' pace beside constraints whose token masks are costly (``y{60000}``).

One greenserve (one gevent worker) pinned to the server core, this client on the other
(``bench.servers``). Two neighbour streams decode all along (unconstrained, T = 1, ``ignore_eos``,
300 tokens; each starts again when it ends: ``bench.prefill_share.decode_forever``) while
``/healthz`` is probed every 10 ms on the API port. Three windows of ``--window`` seconds: alone,
then while costly constrained requests are sent again and again, then alone again (the machine's
load drifts); each costly client sends its next request when the last is answered, at most one
every 0.25 s (a refusal in a tight loop would measure the hub's load of answering 400s, not masks).
Reported per window: ``/healthz`` p50 / p99 / max and the neighbours' inter-token gaps (client
side, between token events of one answer) p50 / p99; and what the costly requests got (status,
finish reason or error message, its numbers as N).

- ``bigram`` (the packaged default model): first, alone, the pace of one cheap constrained stream
  (``[a-z ]{4096}``, 4,096 tokens, the best of three): what computing masks off the hub costs; then
  16 concurrent requests, ``structured_outputs``
  ``{"regex": "y{60000}"}``, ``max_tokens`` 256; then the same with ``y{6000}`` (masks of ~1 ms on
  the byte vocabulary: within the default bounds, so they are computed all along).
- ``smollm2`` (SmolLM2-135M Q4_1): one request ``n: 8`` with ``{"regex": "y{60000}"}``, and one
  ``n: 8`` with the Lark grammar :data:`AFTER_A_CHOICE` (``"a"`` or ``"b"``, then ``y{20000}``: its
  first mask is cheap, the costly ones, ~6-18 ms each, come after the first token), ``max_tokens``
  64.

Run it once per checkout: ``python -m bench.grammar_cost --label after`` and, for the code before
the change, ``--checkout PATH`` naming a copy of it (its server runs that code; this client is the
same). Writes ``bench/results/<UTC time>-grammar-cost[-LABEL].json`` and ``.md`` with the CPU and
the load average at start and end (the machine is shared: rerun when it is noisy).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import servers
from bench.harness import RESULTS, utc_stamp, write_pair
from bench.prefill_share import decode_forever, gaps_ms, token_times
from model.fetch import fetch

RESEND_S = 0.25  # a refused request is sent again after this, not in a tight loop (hub load)
AFTER_A_CHOICE = 'start: ("a" | "b") Y\nY: /y{20000}/'
# (label, concurrent clients, request fields, structured_outputs)
CASES = {
    "bigram": [
        ("y{60000} x16", 16, {"n": 1, "max_tokens": 256}, {"regex": "y{60000}"}),
        ("y{6000} x16", 16, {"n": 1, "max_tokens": 256}, {"regex": "y{6000}"}),
    ],
    "smollm2": [
        ("y{60000} n8", 1, {"n": 8, "max_tokens": 64}, {"regex": "y{60000}"}),
        ("(a|b) y{20000} n8", 1, {"n": 8, "max_tokens": 64}, {"grammar": AFTER_A_CHOICE}),
    ],
}


def cpu_model() -> str:
    """Return the CPU's model name and its vector flags (avx2, avx512f), from /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text()
    name = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    return f"{name} ({', '.join(f for f in ('avx2', 'avx512f') if f in flags) or 'no avx2'})"


def run_header(bench: str, started: str, label: str, checkout: Path, load_start: tuple) -> dict:
    """Return the fields every results file of these benchmarks starts with: what ran, where, on
    which CPU, and the load average at the start and now (the end)."""
    return {
        "bench": bench,
        "started": started,
        "label": label,
        "checkout": str(checkout),
        "cpu": cpu_model(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def pct(values: list[float], q: float) -> float | None:
    """Return the ``q`` quantile (0..1, nearest rank) of ``values`` rounded to 0.01, or None."""
    if not values:
        return None
    ms = sorted(values)
    return round(ms[min(len(ms) - 1, int(len(ms) * q))], 2)


def probe(port: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """GET /healthz every 10 ms until ``stop``; append (sent at, seconds taken)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        t = time.perf_counter()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        samples.append((t, time.perf_counter() - t))
        time.sleep(0.01)
    conn.close()


def costly(port: int, body: dict, until: float, outcomes: Counter) -> None:
    """POST ``body`` (not streamed) again and again until ``until``, at most one every
    :data:`RESEND_S`; count what each answer was (its numbers as N)."""
    while time.perf_counter() < until:
        sent = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        conn.close()
        if "error" in doc:
            what = re.sub(r"\d+(\.\d+)?", "N", doc["error"]["message"])
        else:
            what = "finish_reason " + ",".join(sorted({c["finish_reason"] for c in doc["choices"]}))
        outcomes[f"{resp.status} {what}"] += 1
        time.sleep(max(0.0, sent + RESEND_S - time.perf_counter()))


def window(srv: servers.Server, probes: list, answers: list, t0: float, t1: float) -> dict:
    """Return the figures of ``[t0, t1]``: /healthz latency and the neighbours' gaps, in ms."""
    health = [s * 1000 for t, s in probes if t0 <= t <= t1]
    gaps = gaps_ms(answers, t0, t1)
    return {
        "healthz_ms": {"n": len(health), "p50": pct(health, 0.5), "p99": pct(health, 0.99),
                       "max": pct(health, 1.0)},
        "neighbour_gap_ms": {"n": len(gaps), "p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99)},
    }  # fmt: skip


def alone(port: int, rounds: int = 3) -> dict:
    """Return the pace of one constrained bigram stream alone (a cheap regex, 4,096 tokens; the
    best of ``rounds``): what computing its masks off the hub costs it."""
    body = {"model": "m", "prompt": "x", "max_tokens": 4096, "stream": True, "temperature": 1.0}
    body["structured_outputs"] = {"regex": "[a-z ]{4096}"}
    paces = []
    for seed in range(rounds):
        times: list[float] = []
        token_times(port, "/v1/completions", {**body, "seed": seed}, times)
        paces.append(len(times) / (times[-1] - times[0]))
    return {"model": "bigram", "case": "one cheap constrained stream alone",
            "tokens_per_s": round(max(paces))}  # fmt: skip


def run_model(name: str, checkout: Path, window_s: float) -> list[dict]:
    """Start ``checkout``'s server on model ``name``, measure each case, stop it."""
    env = {"REQUEST_TIMEOUT_S": "600"}
    if name == "smollm2":
        env["MODEL_DIR"] = str(fetch("smollm2"))
    logdir = Path(tempfile.mkdtemp(prefix=f"greenserve-grammar-cost-{name}-"))
    srv = servers.start("greenserve", logdir, env, ready_s=300, root=checkout)
    stop = threading.Event()
    probes: list[tuple[float, float]] = []
    answers: list[list[float]] = []
    threads = [threading.Thread(target=probe, args=(srv.port, stop, probes))]
    threads += [
        threading.Thread(target=decode_forever, args=(srv.port, i + 1, stop, answers))
        for i in range(2)
    ]
    out = []
    try:
        if name == "bigram":
            out.append(alone(srv.port))
        for t in threads:
            t.start()
        time.sleep(2)  # both neighbours decoding
        for label, clients, body, constraint in CASES[name]:
            t0 = time.perf_counter()
            time.sleep(window_s)
            sent = time.perf_counter()
            outcomes: Counter = Counter()
            full = {**body, "model": "m", "prompt": "Say y", "structured_outputs": constraint}
            senders = [
                threading.Thread(target=costly, args=(srv.port, full, sent + window_s, outcomes))
                for _ in range(clients)
            ]
            for s in senders:
                s.start()
            for s in senders:
                s.join()
            done = time.perf_counter()
            time.sleep(window_s)
            after = time.perf_counter()
            out.append(
                {
                    "model": name,
                    "case": label,
                    "alone_before": window(srv, probes, answers, t0, sent),
                    "beside_costly": window(srv, probes, answers, sent, done),
                    "alone_after": window(srv, probes, answers, done, after),
                    "costly_s": round(done - sent, 2),
                    "costly_outcomes": dict(outcomes),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    finally:
        stop.set()
        srv.stop()
        for t in threads:
            t.join(timeout=30)
    return out


def markdown(result: dict[str, Any]) -> str:
    """Return the results as a Markdown table."""
    rows = []
    paces = [r for r in result["runs"] if "tokens_per_s" in r]
    for r in result["runs"]:
        if "tokens_per_s" in r:
            continue
        for phase in ("alone_before", "beside_costly", "alone_after"):
            h, g = r[phase]["healthz_ms"], r[phase]["neighbour_gap_ms"]
            rows.append(
                f"| {r['model']} | {r['case']} | {phase} | {h['p50']} | {h['p99']} | {h['max']} | "
                f"{g['p50']} | {g['p99']} |"
            )
    outcomes = [
        f"- {r['model']} {r['case']} ({r['costly_s']} s): "
        + "; ".join(f"{n} x {what}" for what, n in r["costly_outcomes"].items())
        for r in result["runs"]
        if "costly_outcomes" in r
    ]
    outcomes += [f"- {r['model']}, {r['case']}: {r['tokens_per_s']} tokens/s" for r in paces]
    return "\n".join(
        [
            f"# Neighbours beside costly masks ({result['started']}, {result['label'] or 'run'})",
            "",
            f"Checkout {result['checkout']}; CPU {result['cpu']}; one gevent worker pinned to one "
            f"core, the client on the other; load average {result['loadavg_start']} at the start, "
            f"{result['loadavg_end']} at the end (the machine is shared).",
            "",
            "| model | costly case | window | /healthz p50 (ms) | p99 | max | neighbour gap p50 "
            "(ms) | p99 |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "What the costly requests got:",
            "",
            *outcomes,
            "",
        ]
    )


def main() -> None:
    """Measure and write the result files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=str(servers.ROOT), help="the code the server runs")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of each window")
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--label", default="", help="added to the result files' name")
    args = parser.parse_args()
    _, client = servers.cores()
    os.sched_setaffinity(0, client)
    checkout = Path(args.checkout).resolve()
    started, load_start = utc_stamp(), os.getloadavg()
    runs = [r for name in args.models for r in run_model(name, checkout, args.window)]
    result = {**run_header("grammar-cost", started, args.label, checkout, load_start), "runs": runs}
    suffix = f"-{args.label}" if args.label else ""
    md = markdown(result)
    write_pair(RESULTS / f"{started}-grammar-cost{suffix}.json", result, md)
    print(md)


if __name__ == "__main__":
    main()
