"""``/healthz`` while eight 1 MB prompts are in flight.

Starts one SmolLM2 gunicorn (one worker), sends eight concurrent requests whose prompt (a completion's
``prompt`` or a chat message) is ~1 MB of text, each refused or served, and meanwhile probes ``/healthz``
on the API port every 10 ms. Reports the probes' p50/p99/max and the requests' statuses. Run it with
``PYTHONPATH`` naming the checkout to measure (the server runs that checkout's code).

Run: ``PYTHONPATH=$PWD python bench/big_prompts.py [--rounds 3]``; writes
``bench/results/<UTC time>-big-prompts.json``.
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
from pathlib import Path

from bench.harness import run_together
from tests.server import ROOT, GunicornServer

GGUF = Path.home() / ".cache" / "greenserve" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "The quick brown fox jumps over the lazy dog. " * 22_000  # ~990 KB


def bodies(kind: str) -> bytes:
    if kind == "chat":
        body = {
            "model": GGUF.stem,
            "messages": [{"role": "user", "content": TEXT}],
            "max_tokens": 1,
        }
        return json.dumps(body).encode()
    return json.dumps({"model": GGUF.stem, "prompt": TEXT, "max_tokens": 1}).encode()


def post(port: int, path: str, body: bytes, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        out.append(resp.status)
    finally:
        conn.close()


def probe(port: int, stop: threading.Event, samples: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        t = time.perf_counter()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        samples.append(time.perf_counter() - t)
        time.sleep(0.01)
    conn.close()


def one_round(srv: GunicornServer, kind: str) -> dict:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = bodies(kind)
    samples: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(srv.port, stop, samples))
    prober.start()
    time.sleep(0.2)
    statuses: list[int] = []
    senders = [
        threading.Thread(target=post, args=(srv.port, path, body, statuses)) for _ in range(8)
    ]
    wall = run_together(senders)
    time.sleep(0.1)
    stop.set()
    prober.join()
    ms = sorted(x * 1000 for x in samples)
    return {
        "kind": kind,
        "statuses": sorted(statuses),
        "wall_s": round(wall, 3),
        "healthz_ms": {
            "n": len(ms),
            "p50": round(statistics.median(ms), 2),
            "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
            "max": round(ms[-1], 2),
        },
    }


def main() -> None:
    """Measure and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", default=os.environ.get("GREENSERVE_CACHE_DIR", ""))
    parser.add_argument("--label", default="", help="added to the result file's name")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="greenserve-big-prompts-"))
    env = {"MODEL_DIR": str(GGUF)}
    if args.cache:
        env["GREENSERVE_CACHE_DIR"] = args.cache
    runs = []
    srv = GunicornServer(work, env).start(timeout_s=300)
    try:
        for _ in range(args.rounds):
            for kind in ("completion", "chat"):
                runs.append(one_round(srv, kind))
    finally:
        srv.stop()
    result = {
        "bench": "big-prompts",
        "checkout": str(ROOT),
        "loadavg": os.getloadavg(),
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = f"-{args.label}" if args.label else ""
    out = Path(args.out) / f"{stamp}-big-prompts{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
