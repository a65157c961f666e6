"""A benign schema's wait for the compile pool behind a burst of costly regexes (``x{99999990}``).

One SmolLM2 greenserve (one gevent worker, ``API_KEYS=hostile,benign``) of ``--checkout`` pinned
to the server core, this client on the other (``bench.servers``). Each round sends ``--burst``
requests at once under the key ``hostile``, each with a regex of its own, ``x{99999990}``,
``x{99999991}``, ... (each refused with a 400 after its compile); 0.5 s later, one request with a
JSON schema new to the cache (a ``title`` of its own), ``max_tokens`` 1, under the key ``benign``
(another client) and then, in a second round, under the key ``hostile`` (the same client).
Reported per round: the benign request's latency and status, and the burst's statuses and
latencies (p50 / max).

    python -m bench.compile_pool [--checkout PATH] [--burst 16 40] [--label L]

Writes ``bench/results/<UTC time>-compile-pool[-LABEL].json`` with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench import servers
from bench.grammar_cost import run_header
from bench.harness import RESULTS, print_json, utc_stamp
from model.fetch import fetch

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def post(port: int, body: dict, key: str, out: list) -> None:
    """POST ``body`` under API key ``key``; append (status, seconds)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    out.append((resp.status, time.perf_counter() - start))


def one_round(port: int, burst: int, benign_key: str, first: int) -> dict:
    """Send the burst and, 0.5 s later, the benign schema; return what each got."""
    base = {"model": "m", "prompt": "x", "max_tokens": 1}
    hostile: list = []
    threads = [
        threading.Thread(
            target=post,
            args=(port, {**base, "structured_outputs": {"regex": f"x{{{first + i}}}"}}, "hostile", hostile),
        )
        for i in range(burst)
    ]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(0.5)
    benign: list = []
    schema = {**SCHEMA, "title": f"bench-{time.time_ns()}"}
    post(port, {**base, "structured_outputs": {"json": schema}}, benign_key, benign)
    for t in threads:
        t.join()
    waits = [s for _, s in hostile]
    return {
        "burst": burst,
        "benign_key": benign_key,
        "benign_status": benign[0][0],
        "benign_s": round(benign[0][1], 2),
        "burst_statuses": dict(Counter(status for status, _ in hostile)),
        "burst_s_p50": round(statistics.median(waits), 2),
        "burst_s_max": round(max(waits), 2),
    }


def main() -> None:
    """Measure and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=str(servers.ROOT), help="the code the server runs")
    parser.add_argument("--burst", type=int, nargs="+", default=[16, 40])
    parser.add_argument("--label", default="", help="added to the result file's name")
    args = parser.parse_args()
    _, client = servers.cores()
    os.sched_setaffinity(0, client)
    checkout = Path(args.checkout).resolve()
    started, load_start = utc_stamp(), os.getloadavg()
    env = {
        "MODEL_DIR": str(fetch("smollm2")),
        "API_KEYS": "hostile,benign",
        "REQUEST_TIMEOUT_S": "60",
    }
    logdir = Path(tempfile.mkdtemp(prefix="greenserve-compile-pool-"))
    srv = servers.start("greenserve", logdir, env, ready_s=300, root=checkout)
    rounds = []
    first = 99_999_990
    try:
        warm: list = []  # the tokenizer bridge, built by the worker's first compile
        post(srv.port, {"model": "m", "prompt": "x", "max_tokens": 1,
                        "structured_outputs": {"regex": "[a-z]+"}}, "benign", warm)  # fmt: skip
        for burst in args.burst:
            for benign_key in ("benign", "hostile"):
                rounds.append(one_round(srv.port, burst, benign_key, first))
                first += burst
                print(rounds[-1], flush=True)
                srv.wait_idle(60)
    finally:
        srv.stop()
    header = run_header("compile-pool", started, args.label, checkout, load_start)
    report = {**header, "rounds": rounds}
    suffix = f"-{args.label}" if args.label else ""
    print_json(report, RESULTS / f"{started}-compile-pool{suffix}.json")


if __name__ == "__main__":
    main()
