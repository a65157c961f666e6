"""How long requests wait while a reload (``SIGHUP``) loads new weights, and when the new workers serve.

A server (2 workers by default, unpinned: the machine's two cores) serves a models file; a client
sends a short greedy request (model ``m``, 2 tokens) every ``--period-ms`` (20 ms), each in its own
thread, so that a request waiting in the listen backlog does not hold back the ones after it
(open loop). One second in, the models file is replaced by another and the master gets ``SIGHUP``;
the client goes on until every new worker serves and 25 answers of the new version came back, then
one more second. Every request's send time (from the ``SIGHUP``), latency, status and
``X-Model-Version`` is kept, with the times (from the ``SIGHUP``) of the server's log lines that mark
the reload: the master's check done ("models file applied"), each new worker's "serving" (its models
loaded) and, with the hand-off (``wsgi_app.server.handoff``), "Worker accepts".

Scenarios (``m`` is the model the client asks for; both files name the same models):

- ``bigram``: ``m`` the packaged bigram, replaced by a bigram trained here;
- ``smollm2``: the same with SmolLM2 (``s``, fetched beforehand: ``python -m model.fetch smollm2``)
  served beside it, so that each new worker loads SmolLM2 too (its packed weights cache and
  compiled kernels are warm: the master's check built them at the first start).

``--before PATH`` runs each round on the checkout at PATH too (a worktree of an older commit),
alternated, for comparison. Results with the CPU model and flags and the load average go to
``bench/results/<stamp>-reload-wait.json`` and ``.md``.

    python -m bench.reload_wait [--scenarios bigram smollm2] [--rounds 3] [--before PATH]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, ElapsedLog, utc_stamp, write_pair
from bench.kernels_attention import cpu_info
from model.bigram.train import train_bigram, write_model
from tests.server import GunicornServer, wait_until

SCENARIOS = {
    "bigram": ('[models.m]\nsource = "bigram"\n', '[models.m]\nsource = "trained"\n'),
    "smollm2": (
        'default = "m"\n[models.m]\nsource = "bigram"\n[models.s]\nsource = "smollm2"\n',
        'default = "m"\n[models.m]\nsource = "trained"\n[models.s]\nsource = "smollm2"\n',
    ),
}
BODY = json.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "temperature": 0}).encode()
MARKS = {"applied": "models file applied", "serving": '"serving"', "accepts": "Worker accepts"}


def ask(port: int, out: list[dict[str, Any]]) -> None:
    """Send one request on a new connection; append its send time (seconds from the SIGHUP, once
    sent), latency (ms), status and version (or the error) to ``out``."""
    sent = time.time()
    t0 = time.perf_counter()
    row: dict[str, Any] = {}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        row = {"status": resp.status, "version": resp.getheader("X-Model-Version")}
    except OSError as exc:
        row = {"status": None, "error": repr(exc)}
    row["latency_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    row["sent_wall"] = sent
    out.append(row)


def log_times(srv: GunicornServer, since: float) -> dict[str, list[float]]:
    """Return the times (seconds from ``since``, a Unix time) of the log lines in :data:`MARKS`
    written after ``since``."""
    times: dict[str, list[float]] = {key: [] for key in MARKS}
    for line in srv.log_text().splitlines():
        if not line.startswith("{"):
            continue
        stamp = datetime.datetime.fromisoformat(json.loads(line)["time"].replace("Z", "+00:00"))
        at = stamp.timestamp() - since
        for key, text in MARKS.items():
            if text in line and at >= -0.001:
                times[key].append(round(at, 3))
    return times


def one_round(
    scenario: str, root: Path, workdir: Path, workers: int, period_s: float
) -> dict[str, Any]:
    """Start a server on the checkout ``root``, reload it under the client's requests, stop it."""
    before, after = SCENARIOS[scenario]
    models_file = workdir / "models.toml"
    models_file.write_text(before)
    srv = GunicornServer(workdir / "run", {"MODELS_FILE": str(models_file)}, workers=workers)
    # The checkout under test: its config file and, first on the path, its packages.
    srv.cmd[srv.cmd.index("-c") + 1] = str(root / "gunicorn.conf.py")
    srv.cwd, srv.env["PYTHONPATH"] = root, str(root)
    srv.start(timeout_s=300)
    rows: list[dict[str, Any]] = []
    sighup: list[float] = []
    stop = threading.Event()

    def client(pool: ThreadPoolExecutor) -> None:
        tick = time.perf_counter()
        while not stop.is_set():
            pool.submit(ask, srv.port, rows)
            tick += period_s
            time.sleep(max(0.0, tick - time.perf_counter()))

    try:
        with ThreadPoolExecutor(max_workers=512) as pool:
            sender = threading.Thread(target=client, args=(pool,))
            sender.start()
            time.sleep(1.0)
            old = {r.get("version") for r in rows}
            models_file.write_text(after)
            sighup.append(time.time())
            srv.signal(signal.SIGHUP)
            wait_until(lambda: srv.log_text().count('"serving"') >= 2 * workers, 300)
            wait_until(lambda: sum(r.get("version") not in old for r in rows) >= 25, 300)
            time.sleep(1.0)
            stop.set()
            sender.join()
    finally:
        srv.stop()
    t_hup = sighup[0]
    for row in rows:
        row["sent_s"] = round(row.pop("sent_wall") - t_hup, 4)
        row["new"] = row.get("version") not in old
    rows.sort(key=lambda r: r["sent_s"])
    marks = log_times(srv, t_hup)
    return {
        "summary": summarize(rows, marks),
        "marks": marks,
        "rows": [[r["sent_s"], r["latency_ms"], r["status"], r["new"]] for r in rows],
        "errors_seen": [r["error"] for r in rows if "error" in r],
    }


def summarize(rows: list[dict[str, Any]], marks: dict[str, list[float]]) -> dict[str, Any]:
    """The figures of one round: the latencies before the SIGHUP and from it on, the longest, the
    requests that waited over 100 ms, errors, the first new answer and the log marks."""
    before = [r["latency_ms"] for r in rows if r["sent_s"] < 0]
    during = [r for r in rows if r["sent_s"] >= 0]
    versions = [r["new"] for r in rows if r["status"] == 200]
    first_new = next((r for r in rows if r["new"] and r["status"] == 200), None)
    return {
        "requests": len(rows),
        "errors": sum(r["status"] != 200 for r in rows),
        "flips_once": versions == sorted(versions),  # False..., then True...
        "p50_ms_before": round(statistics.median(before), 2),
        "max_ms_before": max(before),
        "max_ms_after_sighup": max(r["latency_ms"] for r in during),
        "waited_over_100ms": sum(r["latency_ms"] > 100 for r in during),
        "first_new_answer_sent_s": first_new and first_new["sent_s"],
        "master_check_s": marks["applied"][0] if marks["applied"] else None,
        "new_workers_serving_s": marks["serving"],
        "new_workers_accept_s": marks["accepts"],
    }


def markdown(result: dict[str, Any]) -> str:
    """A table of each round's summary."""
    cpu = result["cpu"]
    lines = [
        f"# Reload wait on {cpu['model']} ({', '.join(cpu['flags'])}), {result['workers']} workers, "
        f"a request every {result['period_ms']} ms; load average before {result['loadavg_before']}, "
        f"after {result['loadavg_after']}",
        "",
        "| scenario | code | round | requests | errors | flips once | p50 before (ms) | longest "
        "wait from SIGHUP (ms) | waited > 100 ms | master check (s) | new workers serve (s) | "
        "accept (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(
            f"| {run['scenario']} | {run['code']} | {run['round']} | {s['requests']} | "
            f"{s['errors']} | {s['flips_once']} | {s['p50_ms_before']} | "
            f"{s['max_ms_after_sighup']} | {s['waited_over_100ms']} | {s['master_check_s']} | "
            f"{', '.join(map(str, s['new_workers_serving_s']))} | "
            f"{', '.join(map(str, s['new_workers_accept_s'])) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the rounds and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--period-ms", type=float, default=20.0)
    parser.add_argument("--before", type=Path, help="a checkout of older code, run alternated")
    args = parser.parse_args()
    log = ElapsedLog()
    codes = {"this": Path(__file__).resolve().parent.parent}
    if args.before:
        codes["before"] = args.before.resolve()
    result: dict[str, Any] = {
        "cpu": cpu_info(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "workers": args.workers,
        "period_ms": args.period_ms,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "row_fields": ["sent_s (from the SIGHUP)", "latency_ms", "status", "new version"],
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="greenserve-reload-") as tmp:
        trained = Path(tmp) / "trained"
        write_model(trained, train_bigram([b"xyz" * 200]), {"trained_on": ["xyz"]})
        for scenario in args.scenarios:
            for r in range(args.rounds):
                for code, root in codes.items():
                    workdir = Path(tempfile.mkdtemp(dir=tmp))
                    (workdir / "trained").symlink_to(trained)
                    run = one_round(scenario, root, workdir, args.workers, args.period_ms / 1000)
                    result["runs"].append({"scenario": scenario, "code": code, "round": r, **run})
                    log(f"{scenario} {code} round {r}: {json.dumps(run['summary'])}")
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    path = RESULTS / f"{utc_stamp()}-reload-wait.json"
    text = markdown(result)
    write_pair(path, result, text, indent=None)
    print(text)


if __name__ == "__main__":
    main()
