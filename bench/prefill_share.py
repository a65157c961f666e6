"""Two decoding streams while a ~6k-token chat prompt is read.

One greenserve (one gevent worker, default settings, SmolLM2-135M Q4_1) pinned to the server core,
this client on the other (``bench.servers``). Two streams decode all along ("Once upon a time",
T = 1, ``ignore_eos``, 300 tokens; each starts again when it ends); after ``--window`` seconds, a
chat of 1,024 short messages (6,169 tokens) arrives, streamed, 16 tokens. Reports the
streams' inter-token latency (client-side gaps between token events of one answer) in a window
before the prompt and one after its answer ("pace", both together: the machine's load drifts) and
while it is read (from its request to its first token), and the prompt's TTFT; then, the streams
stopped, the TTFT of its first 256 messages alone (1,561 tokens, another ``cache_salt``: computed
cold). Target: ITL p50 while the prompt is read ≤ 2 × the pace's.

Run it once per checkout: ``python -m bench.prefill_share --label after`` and, for the code before the
change, ``--checkout PATH`` naming a worktree of it (its server runs that code; this client is the
same). Writes ``bench/results/<UTC time>-prefill-share[-LABEL].json`` with the load average at start
and end (the machine is shared: run it when ``uptime`` is lowest).
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

from bench import servers
from model.fetch import fetch

RESULTS = Path(__file__).resolve().parent / "results"
STREAM = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 1.0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "ok"} for _ in range(1024)]  # 6 tokens each
# The long prompt takes longer than the default 60 s deadline beside the streams on a busy core.
ENV = {"REQUEST_TIMEOUT_S": "900"}


def token_times(port: int, path: str, body: dict, times: list[float]) -> dict | None:
    """Stream ``body``; append each token event's ``perf_counter`` time; return the usage event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    usage = None
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {resp.read()[:300]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            elif doc["choices"] and (
                "text" in doc["choices"][0] or doc["choices"][0]["delta"].get("content")
            ):
                times.append(time.perf_counter())
    finally:
        conn.close()
    return usage


def decode_forever(port: int, seed: int, stop: threading.Event, answers: list[list[float]]) -> None:
    """Keep one stream decoding until ``stop``: each answer's token times go to ``answers``."""
    while not stop.is_set():
        times: list[float] = []
        answers.append(times)
        body = {**STREAM, "model": "smollm2", "seed": seed, "stream": True}
        try:
            token_times(port, "/v1/completions", body, times)
        except OSError:
            if not stop.is_set():
                raise
        seed += 100


def gaps_ms(answers: list[list[float]], t0: float, t1: float) -> list[float]:
    """Return the gaps (ms) between consecutive tokens of one answer, both within ``[t0, t1]``."""
    return [
        (b - a) * 1000
        for times in answers
        for a, b in zip(times, times[1:], strict=False)
        if t0 <= a and b <= t1
    ]


def stats(gaps: list[float]) -> dict:
    """Return n, p50, p90 and max of ``gaps`` (ms)."""
    if not gaps:
        return {"n": 0}
    ms = sorted(gaps)
    return {
        "n": len(ms),
        "p50": round(statistics.median(ms), 1),
        "p90": round(ms[int(len(ms) * 0.9)], 1),
        "max": round(ms[-1], 1),
    }


def run(checkout: Path, window_s: float) -> dict:
    """Start the server of ``checkout``, measure, stop it; return the figures."""
    model = fetch("smollm2")
    logdir = Path(tempfile.mkdtemp(prefix="greenserve-prefill-share-"))
    env = {"MODEL_DIR": str(model), **ENV}
    srv = servers.start("greenserve", logdir, env, ready_s=300, root=checkout)
    stop = threading.Event()
    answers: list[list[list[float]]] = [[], []]
    try:
        token_times(srv.port, "/v1/completions", {**STREAM, "model": "x", "max_tokens": 4}, [])
        streams = [
            threading.Thread(target=decode_forever, args=(srv.port, i + 1, stop, answers[i]))
            for i in range(2)
        ]
        for s in streams:
            s.start()
        time.sleep(3)  # both decoding
        t0 = time.perf_counter()
        time.sleep(window_s)
        sent = time.perf_counter()
        long_times: list[float] = []
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        usage = token_times(
            srv.port,
            "/v1/chat/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
            long_times,
        )
        first = long_times[0]
        done = time.perf_counter()
        time.sleep(window_s)  # the pace again, the machine's load may have changed meanwhile
        after = time.perf_counter()
        stop.set()
        for s in streams:
            s.join(timeout=60)
        # the cold cost of a prompt alone (a quarter of it, under another salt: no prefix hit)
        alone_times: list[float] = []
        quarter = {**body, "messages": MESSAGES[:256], "max_tokens": 1, "cache_salt": "alone"}
        alone_sent = time.perf_counter()
        alone_usage = token_times(
            srv.port,
            "/v1/chat/completions",
            {**quarter, "stream": True, "stream_options": {"include_usage": True}},
            alone_times,
        )
        alone = {"prompt_tokens": alone_usage["prompt_tokens"] if alone_usage else None}
        alone["ttft_s"] = round(alone_times[0] - alone_sent, 2)
    finally:
        stop.set()
        srv.stop()
    both = answers[0] + answers[1]
    pace = [stats(gaps_ms(a, t0, sent) + gaps_ms(a, done, after)) for a in answers]
    during = [stats(gaps_ms(a, sent, first)) for a in answers]
    both_pace = stats(gaps_ms(both, t0, sent) + gaps_ms(both, done, after))
    both_during = stats(gaps_ms(both, sent, first))
    return {
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "ttft_s": round(first - sent, 2),
        "window_s": window_s,
        "itl_ms_pace": both_pace,
        "itl_ms_pace_before": stats(gaps_ms(both, t0, sent)),
        "itl_ms_pace_after": stats(gaps_ms(both, done, after)),
        "itl_ms_while_read": both_during,
        "itl_ms_per_stream": {"pace": pace, "while_read": during},
        "p50_ratio": round(both_during["p50"] / both_pace["p50"], 2),
        "alone": alone,
    }


def main() -> None:
    """Measure and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=str(servers.ROOT), help="the code the server runs")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of pace first")
    parser.add_argument("--label", default="", help="added to the result file's name")
    args = parser.parse_args()
    _, client = servers.cores()
    os.sched_setaffinity(0, client)
    checkout = Path(args.checkout).resolve()
    load_start = os.getloadavg()
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    figures = run(checkout, args.window)
    result = {
        "bench": "prefill-share",
        "started": started,
        "checkout": str(checkout),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        **figures,
    }
    suffix = f"-{args.label}" if args.label else ""
    out = RESULTS / f"{started}-prefill-share{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
