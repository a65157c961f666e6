"""Benchmark structured outputs on SmolLM2-135M-Instruct (Q4_1 GGUF): what the token masks cost.

greenserve runs one gevent worker pinned to one core (``bench.servers``), the client on the other.
Two runs of 32 concurrent streams on ``/v1/completions`` (prompt ``"Once upon a time"``,
``temperature`` 0.8, seeds 0..31, ``max_tokens`` 64): unconstrained (``ignore_eos``: all 64 tokens),
then each stream with a ``json_schema`` ``response_format`` (an object of an 8-string list and two
bounded numbers; it ends when the schema is complete). Reported for each: tokens/s over the run, the
median inter-token gap (one engine step: every stream gets one token a step), and for the constrained
run the mask time the server logged per request (``mask_s``), summed over the run and divided by
the steps it took, against the step time: the mask's share of a step (target <= 10 %). Then the
TTFT added by compiling: each schema of ``tests/schemas.py`` (made new to the cache by a ``title``)
is sent alone with ``max_tokens`` 1, and the server's ``compile_s`` (the request's wait for its
grammar) gives p50 and p99; the first request of the run also builds the tokenizer bridge (shown
apart). Writes ``bench/results/<time>-structured.json`` and ``.md`` with the load average.

    python -m bench.structured [--streams 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import servers
from bench.harness import RESULTS, utc_stamp, write_pair
from model.fetch import fetch
from model.loader import load_model
from tests.schemas import SCHEMAS

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 8,
            "maxItems": 8,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "rank": {"type": "integer", "minimum": 1, "maximum": 1000},
    },
    "required": ["items", "score", "rank"],
    "additionalProperties": False,
}


def _stream(port: int, body: dict[str, Any]) -> list[float]:
    """POST a streamed completion; return the arrival time of each token event (perf_counter)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    times = []
    for line in resp:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["text"] is not None:
                times.append(time.perf_counter())
    conn.close()
    return times


def _run(port: int, streams: int, tokens: int, constrained: bool) -> dict[str, Any]:
    bodies = []
    for i in range(streams):
        body = {
            "model": "m",
            "prompt": "Once upon a time",
            "max_tokens": tokens,
            "stream": True,
            "temperature": 0.8,
            "seed": i,
        }
        if constrained:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "b", "schema": SCHEMA},
            }
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    results: list[list[float]] = [[] for _ in bodies]
    start = threading.Barrier(len(bodies) + 1)

    def go(i: int) -> None:
        start.wait()
        results[i] = _stream(port, bodies[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = max(r[-1] for r in results) - t0
    gaps = np.concatenate([np.diff(r) for r in results if len(r) > 1])
    n_tokens = sum(len(r) for r in results)
    return {
        "streams": streams,
        "tokens": n_tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(n_tokens / wall, 2),
        "step_s_p50": round(float(np.median(gaps)), 5),
        "steps": max(len(r) for r in results),
    }


def _log_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if '"message": "request"' in line:
            out.append(json.loads(line))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="alternated runs of each (noise)")
    args = ap.parse_args()
    gguf = fetch("smollm2")
    load_model(gguf)  # builds the float32 weights cache the server maps
    load_start = os.getloadavg()
    logdir = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    env = {"MODEL_DIR": str(gguf), "MAX_SLOTS": str(args.streams), "REQUEST_TIMEOUT_S": "600"}
    os.sched_setaffinity(0, servers.cores()[1])  # the client on its own core
    srv = servers.start("greenserve", logdir, env, ready_s=180)
    try:
        # The first constrained request builds the tokenizer bridge: measured apart.
        warm = {"model": "m", "prompt": "x", "max_tokens": 1, "stream": True}
        _stream(srv.port, {**warm, "structured_outputs": {"regex": "[a-z]+"}})
        time.sleep(0.2)
        bridge_s = _log_lines(srv.log_path)[-1]["compile_s"]
        runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for _ in range(args.repeat):  # alternated, so a change of load shows in both
            free = _run(srv.port, args.streams, args.tokens, constrained=False)
            n_before = len(_log_lines(srv.log_path))
            structured = _run(srv.port, args.streams, args.tokens, constrained=True)
            time.sleep(0.5)  # the log lines of the run are written on the next loop turns
            lines = _log_lines(srv.log_path)[n_before:]
            mask_s = sum(x["mask_s"] or 0.0 for x in lines if x.get("constraint"))
            structured["mask_s_total"] = round(mask_s, 4)
            structured["mask_s_per_step"] = round(mask_s / structured["steps"], 6)
            structured["mask_share_of_step"] = round(
                structured["mask_s_per_step"] / structured["step_s_p50"], 4
            )
            runs.append((free, structured))
        compile_s = []
        for k, schema in enumerate(SCHEMAS.values()):
            fresh = {**schema, "title": f"bench-{k}-{time.time_ns()}"}
            _stream(
                srv.port,
                {
                    "model": "m",
                    "prompt": "x",
                    "max_tokens": 1,
                    "stream": True,
                    "structured_outputs": {"json": fresh},
                },
            )
            time.sleep(0.05)
            compile_s.append(_log_lines(srv.log_path)[-1]["compile_s"])
        compile_ms = np.asarray(compile_s) * 1000
    finally:
        srv.stop()
    load_end = os.getloadavg()
    result = {
        "time": utc_stamp(),
        "model": gguf.name,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "bridge_build_s": bridge_s,
        "runs": [
            {
                "unconstrained": free,
                "json_schema": structured,
                "tokens_per_s_ratio": round(structured["tokens_per_s"] / free["tokens_per_s"], 3),
                "step_time_ratio": round(structured["step_s_p50"] / free["step_s_p50"], 3),
            }
            for free, structured in runs
        ],
        "compile_schemas": len(compile_s),
        "compile_ms_p50": round(float(np.percentile(compile_ms, 50)), 3),
        "compile_ms_p99": round(float(np.percentile(compile_ms, 99)), 3),
        "compile_ms_max": round(float(compile_ms.max()), 3),
    }
    md = _markdown(result)
    write_pair(RESULTS / f"{result['time']}-structured.json", result, md)
    print(md)


def _markdown(r: dict[str, Any]) -> str:
    rows = []
    for i, run in enumerate(r["runs"], start=1):
        u, s = run["unconstrained"], run["json_schema"]
        rows += [
            f"| {i} | unconstrained | {u['streams']} | {u['tokens']} | {u['tokens_per_s']} | "
            f"{u['step_s_p50'] * 1000:.1f} | | |",
            f"| {i} | json_schema | {s['streams']} | {s['tokens']} | {s['tokens_per_s']} | "
            f"{s['step_s_p50'] * 1000:.1f} | {s['mask_s_per_step'] * 1000:.2f} | "
            f"{s['mask_share_of_step'] * 100:.1f} % |",
        ]
    ratios = "; ".join(
        f"run {i}: tok/s ratio {run['tokens_per_s_ratio']}, step time ratio {run['step_time_ratio']}"
        for i, run in enumerate(r["runs"], start=1)
    )
    return "\n".join(
        [
            f"# Structured outputs on {r['model']} ({r['time']})",
            "",
            "One gevent worker pinned to one core, the client on the other; "
            f"load average {r['loadavg_start']} at the start, {r['loadavg_end']} at the end "
            "(the machine is shared).",
            "",
            "| # | run | streams | tokens | tok/s | step p50 (ms) | mask per step (ms) | mask share |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"json_schema / unconstrained: {ratios}. The constrained streams end when their "
            "schema is complete (fewer tokens, a batch that shrinks at the end); the unconstrained "
            "ones run all their tokens.",
            "",
            f"TTFT added by compiling, {r['compile_schemas']} schemas of tests/schemas.py, each new to "
            f"the cache: p50 {r['compile_ms_p50']} ms, p99 {r['compile_ms_p99']} ms, max "
            f"{r['compile_ms_max']} ms. The worker's first constrained request also built the "
            f"tokenizer bridge: {r['bridge_build_s'] * 1000:.0f} ms (once per worker).",
            "",
        ]
    )


if __name__ == "__main__":
    main()
