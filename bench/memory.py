"""What a burst of the largest ``logprobs`` answers makes one worker hold, and what it gives back.

Starts a real gunicorn (one gevent worker, the packaged bigram), warms it up with one request of each
kind, then per scenario sends ``--parallel`` (16) identical requests at once and samples the worker's
resident memory every 10 ms from /proc: the baseline before the burst, the peak during it (also
``VmHWM`` after resetting it through ``/proc/<pid>/clear_refs``), and the RSS ``--settle-s`` (5) seconds
after the last answer, with ``smaps_rollup``'s anonymous memory. The requests are as large as
``MAX_LOGPROB_ENTRIES`` (262144) allows:

- ``completions``: ``n`` 8, ``max_tokens`` 4096, ``echo`` of a 1365-byte prompt, ``logprobs`` 5:
  8 × (4096 + 1365) × 6 = 262128 entries (~5 MB of JSON each);
- ``completions_stream``: the same, streamed;
- ``chat``: ``n`` 8, ``top_logprobs`` 20, ``max_tokens`` 1560 (8 × 1560 × 21 = 262080 entries);
- ``chat_stream``: the same, streamed.

``--inprocess`` instead runs the same burst in this process through ``Completion`` (16 completions
advanced round-robin, as the worker's greenlets interleave them, then encoded) and reports where the
memory goes: ``sys.getallocatedblocks()`` and pymalloc's arenas (``sys._debugmallocstats()``, 1 MiB
each) before, once generated, once encoded and after the answers are dropped; with ``--trace``,
``tracemalloc``'s top lines once generated.

Run: ``python -m bench.memory [--out bench/results/<stamp>-memory.json]`` (4-6 minutes), and
``python -m bench.memory --inprocess [--trace --parallel 4]``.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench import servers

PROMPT = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:1365]
COMPLETIONS = {
    "model": "bigram",
    "prompt": PROMPT,
    "n": 8,
    "max_tokens": 4096,
    "echo": True,
    "logprobs": 5,
    "seed": 7,
}
CHAT = {
    "model": "bigram",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "n": 8,
    "max_tokens": 1560,
    "logprobs": True,
    "top_logprobs": 20,
    "ignore_eos": True,
    "seed": 7,
}
SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", COMPLETIONS),
    "completions_stream": ("/v1/completions", {**COMPLETIONS, "stream": True}),
    "chat": ("/v1/chat/completions", CHAT),
    "chat_stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
}
MIB = 1 << 20


def status_kib(pid: int) -> dict[str, int]:
    """Return ``VmRSS``, ``VmHWM``, ``RssAnon`` of ``pid`` in KiB (/proc/<pid>/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0])
    return out


def anonymous_kib(pid: int) -> int:
    """Return ``pid``'s anonymous resident memory in KiB (``Anonymous`` of smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return int(re.search(r"^Anonymous:\s+(\d+)", f.read(), re.M).group(1))


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, int, bool]:
    """POST ``body``; return (status, bytes of the answer read, whether it held an error event)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        size, tail, failed = 0, b"", False
        while chunk := resp.read(1 << 16):
            size += len(chunk)
            failed = failed or b'data: {"error"' in tail + chunk
            tail = chunk[-16:]
        return resp.status, size, failed
    finally:
        conn.close()


class Sampler:
    """Sample ``pid``'s RSS every ``every_s`` seconds on a thread; :attr:`peak_kib` is the largest."""

    def __init__(self, pid: int, every_s: float = 0.01) -> None:
        self.pid, self.every_s, self.peak_kib = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.pid)["VmRSS"])
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        """Stop sampling; return the peak RSS in KiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_kib


def burst(port: int, pid: int, path: str, body: dict, parallel: int, settle_s: float) -> dict:
    """Send ``parallel`` copies of ``body`` at once; return the worker's memory around them, MiB."""
    before = status_kib(pid)
    anon_before = anonymous_kib(pid)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    sampler = Sampler(pid)
    results: list[tuple[int, int, bool]] = []
    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=lambda: results.append(post(port, path, body)))
        for _ in range(parallel)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    time.sleep(settle_s)
    peak = sampler.stop()
    after = status_kib(pid)
    return {
        "statuses": sorted({r[0] for r in results}),
        "answer_bytes": sorted({r[1] for r in results}),
        "error_events": sum(r[2] for r in results),
        "burst_s": round(elapsed, 2),
        "rss_before_mib": round(before["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(max(peak, after["VmHWM"]) / 1024, 1),
        "rss_after_mib": round(after["VmRSS"] / 1024, 1),
        "anon_before_mib": round(anon_before / 1024, 1),
        "anon_after_mib": round(anonymous_kib(pid) / 1024, 1),
    }


def run_server(parallel: int, settle_s: float, names: list[str]) -> dict[str, Any]:
    """Measure each scenario in ``names`` on a fresh server; return the figures by scenario."""
    out: dict[str, Any] = {}
    for name in names:
        path, body = SCENARIOS[name]
        with tempfile.TemporaryDirectory() as logdir:
            # A deadline no answer reaches: every stream runs to its end on a loaded machine.
            server = servers.start("greenserve", Path(logdir), {"REQUEST_TIMEOUT_S": "900"})
            try:
                (pid,) = server.serving_pids()
                for _ in range(2):  # warm-up: imports, caches, the first big answer
                    status, _, _ = post(server.port, path, body)
                    assert status == 200, status
                time.sleep(settle_s)
                out[name] = burst(server.port, pid, path, body, parallel, settle_s)
            finally:
                server.stop()
        print(name, json.dumps(out[name]), file=sys.stderr)
    return out


def pymalloc_arenas() -> int:
    """Return pymalloc's arenas in use now (``# arenas allocated current`` of
    ``sys._debugmallocstats()``, which writes to the C-level stderr)."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode()
    return int(re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)[1].replace(",", ""))


def run_inprocess(parallel: int, trace: bool) -> dict[str, Any]:
    """Run the ``completions`` and ``chat`` bursts in this process; return where memory goes."""
    from model.bigram.engine import BigramEngine
    from model.loader import load_model
    from wsgi_app.api.chat import parse_chat_request
    from wsgi_app.api.completions import parse_completion_request
    from wsgi_app.generation.completion import Completion
    from wsgi_app.generation.inputs import generation_input
    from wsgi_app.generation.pacer import Unpaced
    from wsgi_app.http.chat import chat_completion_request
    from wsgi_app.wire.chat import CHAT_COMPLETION
    from wsgi_app.wire.encoder import TEXT_COMPLETION

    loaded = load_model(None)
    engine = BigramEngine(loaded.model)
    template = loaded.chat_template(None)
    chat = parse_chat_request(CHAT, vocab_size=loaded.tokenizer.vocab_size)
    chat_req = chat_completion_request(
        chat, template, loaded, max_prompt_tokens=32768, chat_max_tokens=4096
    )
    reqs = {
        "completions": (generation_input(parse_completion_request(COMPLETIONS)), TEXT_COMPLETION),
        "chat": (chat_req, CHAT_COMPLETION),
    }
    out: dict[str, Any] = {}
    for name, (req, wire) in reqs.items():
        gc.collect()
        base = {"blocks": sys.getallocatedblocks(), "arenas": pymalloc_arenas()}
        if trace:
            tracemalloc.start(1)
        t0 = time.perf_counter()
        completions = [
            Completion(engine, req, 7, "x", 1700000000, Unpaced(), wire=wire)
            for _ in range(parallel)
        ]
        loops = [c.chunks(events=False) for c in completions]
        while loops:  # round-robin, as the worker's greenlets interleave
            loops = [loop for loop in loops if next(loop, StopIteration) is not StopIteration]
        generated: dict[str, Any] = {}
        if trace:  # where the generated answers' memory is, before they are encoded
            snap = tracemalloc.take_snapshot()
            tracemalloc.stop()  # (pymalloc's statistics are not printed under tracemalloc)
            generated["top"] = [str(s) for s in snap.statistics("lineno")[:8]]
            del snap
        generated.update(blocks=sys.getallocatedblocks(), arenas=pymalloc_arenas())
        answers = [c.encoder.answer(c.choices, c.usage(), lambda: None) for c in completions]
        answered = {
            "blocks": sys.getallocatedblocks(),
            "arenas": pymalloc_arenas(),
            "s": round(time.perf_counter() - t0, 2),
            "answer_bytes": sum(map(len, answers[0])),
        }
        del completions, loops, answers
        after = {"blocks": sys.getallocatedblocks(), "arenas": pymalloc_arenas()}
        out[name] = {"base": base, "generated": generated, "answered": answered, "after": after}
        print(name, json.dumps(out[name], indent=1), file=sys.stderr)
    return out


def main() -> None:
    """Measure and write the JSON results (``--out``) or print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--inprocess", action="store_true", help="in this process, no server")
    parser.add_argument("--trace", action="store_true", help="with --inprocess: tracemalloc")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--note", default="", help="what was measured (commit, load)")
    args = parser.parse_args()
    if args.inprocess:
        results = run_inprocess(args.parallel, args.trace)
    else:
        results = run_server(args.parallel, args.settle_s, args.scenarios.split(","))
    doc = {"note": args.note, "parallel": args.parallel, "settle_s": args.settle_s, **results}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
