"""Benchmark prefix caching on SmolLM2-135M-Instruct: TTFT with the cache against without it.

Two greenserve servers, one worker each, both pinned to the server core (``bench.servers``; only one
works at a time), ``PREFIX_CACHE=1`` (the default) and ``PREFIX_CACHE=0``; the client is pinned to the
other core. TTFT is the server's own (``ttft_s`` of the request's log line: arrival to the first
generated token), so client and connection costs stay out of it. Every answer of the cache-on server
is also checked against the cache-off server's: same text (the bits are the tests' business; a
benchmark that sped up by changing answers would still be caught here). Scenarios (chat completions,
``temperature`` 0):

- ``repeat``: a system prompt of ~1,500 tokens and a user message of <= 10 tokens, one output token:
  the first request (cold), the same again, then the same history with a new last message.
- ``chat``: 10 turns after that system prompt (questions <= 20 tokens, answers <= 64 tokens
  appended): each turn's TTFT against the same request on the cache-off server (cold). Also run
  without the system prompt (``chat-short``), which the 128-token block granularity serves worse.
- ``burst``: one request primes a ~1,000-token system prompt, then 16 users with different questions
  arrive at once (``max_tokens`` 16): TTFT p50/p99 and total tok/s against the same burst without
  the cache (``REQUEST_TIMEOUT_S`` 900 so the cold burst does not time out).
- ``distinct``: no shared prefixes (12 completions of distinct ~300-token prompts, 4 at a time,
  ``max_tokens`` 32): wall time and server CPU seconds with and without the cache, alternated.

    python -m bench.prefix_cache [--scenarios repeat,chat,chat-short,burst,distinct]

Writes ``bench/results/<time>-prefix.json`` and ``.md`` with the load average before and after.
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
from typing import Any

from bench import procstat, servers
from bench.harness import RESULTS, run_together, utc_stamp, write_pair
from model.fetch import fetch
from model.loader import load_model

WORDS = (
    "library reader shelf novel author chapter quiet table lamp window garden river stone "
    "bridge market winter summer morning evening letter story question answer kitchen bread "
    "teacher student music painting mountain forest village harbour captain journey candle "
    "clock mirror blanket pencil notebook ticket station corner street planet ocean cloud"
).split()
QUESTIONS = [
    "What time do you open?", "Can I renew a book?", "Where is the map room?",
    "Do you lend music?", "Is there a quiet floor?", "How long is a loan?",
    "Can children join?", "Do you sell coffee?", "Where can I print?", "Is parking free?",
    "Are dogs allowed?", "Who runs the chess club?", "Can I book a room?",
    "Do you have comics?", "Is Wi-Fi free?", "When do you close?", "Can I donate books?",
]  # fmt: skip
ENV = {"REQUEST_TIMEOUT_S": "900", "STATS_FLUSH_S": "1"}


def text_of(n_words: int, seed: int) -> str:
    """Return ``n_words`` words of deterministic filler, sentences of 12 words."""
    out = []
    for i in range(n_words):
        out.append(WORDS[(seed * 7919 + i * 31 + (i * i) % 17) % len(WORDS)])
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def system_prompt(tokens: int, tok: Any) -> str:
    """Return filler text of about ``tokens`` tokens (counted with the model's tokenizer)."""
    words = tokens
    while len(tok.encode(text_of(words, 1))) > tokens:
        words -= 10
    return "You answer questions about the library. " + text_of(words, 1)


class Client:
    """Requests to one server, with the server's TTFT read from its log line."""

    def __init__(self, srv: servers.Server) -> None:
        self.srv = srv
        self._n = 0
        self._lock = threading.Lock()

    def ask(self, path: str, payload: dict) -> dict:
        """POST ``payload``; return the answer, its server TTFT (s) and client latency (s)."""
        with self._lock:
            self._n += 1
            rid = f"bench-{os.getpid()}-{self._n}"
        conn = http.client.HTTPConnection("127.0.0.1", self.srv.port, timeout=1800)
        t0 = time.perf_counter()
        conn.request(
            "POST",
            path,
            json.dumps(payload),
            {"Content-Type": "application/json", "X-Request-Id": rid},
        )
        resp = conn.getresponse()
        raw = resp.read()
        latency = time.perf_counter() - t0
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {raw[:300]!r}")
        doc = json.loads(raw)
        return {"doc": doc, "ttft_s": self._ttft(rid), "latency_s": latency}

    def _ttft(self, rid: str) -> float:
        needle = f'"request_id": "{rid}"'
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.srv.log_path.read_text(errors="replace").splitlines():
                if needle in line:
                    return json.loads(line)["ttft_s"]
            time.sleep(0.05)
        raise RuntimeError(f"no log line for {rid}")


def chat(system: str | None, turns: list[dict], max_tokens: int) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def answer_text(doc: dict) -> str:
    choice = doc["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cached_of(doc: dict) -> int | None:
    return doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens")


def same(a: dict, b: dict) -> bool:
    return answer_text(a["doc"]) == answer_text(b["doc"])


def repeat(on: Client, off: Client, system: str) -> dict:
    q = [{"role": "user", "content": "What time do you open?"}]
    q2 = [{"role": "user", "content": "Can I renew a book?"}]
    cold_off = off.ask("/v1/chat/completions", chat(system, q, 1))
    cold = on.ask("/v1/chat/completions", chat(system, q, 1))
    again = on.ask("/v1/chat/completions", chat(system, q, 1))
    new_last = on.ask("/v1/chat/completions", chat(system, q2, 1))
    new_off = off.ask("/v1/chat/completions", chat(system, q2, 1))
    return {
        "prompt_tokens": cold["doc"]["usage"]["prompt_tokens"],
        "cold_off_s": cold_off["ttft_s"],
        "cold_s": cold["ttft_s"],
        "again_s": again["ttft_s"],
        "new_last_s": new_last["ttft_s"],
        "again_ratio": again["ttft_s"] / cold["ttft_s"],
        "new_last_ratio": new_last["ttft_s"] / cold["ttft_s"],
        "cached_tokens": [cached_of(x["doc"]) for x in (cold, again, new_last)],
        "same_answers": same(cold, cold_off) and same(again, cold_off) and same(new_last, new_off),
    }


def conversation(on: Client, off: Client, system: str | None, turns: int = 10) -> dict:
    history: list[dict] = []
    rows = []
    for t in range(turns):
        history.append({"role": "user", "content": QUESTIONS[t]})
        cold = off.ask("/v1/chat/completions", chat(system, history, 64))
        warm = on.ask("/v1/chat/completions", chat(system, history, 64))
        rows.append(
            {
                "turn": t + 1,
                "prompt_tokens": warm["doc"]["usage"]["prompt_tokens"],
                "cached_tokens": cached_of(warm["doc"]),
                "cold_s": cold["ttft_s"],
                "cached_s": warm["ttft_s"],
                "ratio": warm["ttft_s"] / cold["ttft_s"],
                "same_answer": same(warm, cold),
            }
        )
        history.append({"role": "assistant", "content": answer_text(warm["doc"])})
    later = [r["ratio"] for r in rows[1:]]
    return {"turns": rows, "max_ratio_turns_2_10": max(later)}


def burst_of(client: Client, system: str, users: int = 16) -> dict:
    results: list[dict] = [{}] * users

    def one(i: int) -> None:
        results[i] = client.ask(
            "/v1/chat/completions",
            {**chat(system, [{"role": "user", "content": QUESTIONS[i]}], 16), "ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    wall = run_together(threads)
    ttfts = [r["ttft_s"] for r in results]
    tokens = sum(r["doc"]["usage"]["completion_tokens"] for r in results)
    p50, p99 = procstat.percentiles(ttfts, (0.5, 0.99))
    texts = [answer_text(r["doc"]) for r in results]
    return {
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "tok_s": tokens / wall,
        "wall_s": wall,
        "texts": texts,
    }


def burst(on: Client, off: Client, system: str) -> dict:
    prime = on.ask("/v1/chat/completions", chat(system, [{"role": "user", "content": "Hello"}], 1))
    warm = burst_of(on, system)
    cold = burst_of(off, system)
    same_texts = warm.pop("texts") == cold.pop("texts")
    return {
        "prime_ttft_s": prime["ttft_s"],
        "cached": warm,
        "cold": cold,
        "ttft_p99_ratio": warm["ttft_p99_s"] / cold["ttft_p99_s"],
        "tok_s_ratio": warm["tok_s"] / cold["tok_s"],
        "same_answers": same_texts,
    }


def distinct(on: Client, off: Client, rounds: int = 2) -> dict:
    def workload(client: Client, salt: int) -> tuple[float, float]:
        pids = client.srv.serving_pids()
        cpu0, t0 = procstat.cpu_s(pids), time.perf_counter()
        for wave in range(3):
            threads = []
            for i in range(4):
                prompt = f"{salt} {wave} {i}: " + text_of(240, 1000 * salt + 10 * wave + i)
                body = {"model": "m", "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
                threads.append(threading.Thread(target=client.ask, args=("/v1/completions", body)))
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        return time.perf_counter() - t0, procstat.cpu_s(pids) - cpu0

    runs: dict[str, list] = {"on": [], "off": []}
    for r in range(rounds):
        for name, client in (
            (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
        ):
            runs[name].append(workload(client, 10 * r + (name == "on")))
    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    return {
        "runs": runs,
        "wall_ratio": wall["on"] / wall["off"],
        "cpu_ratio": cpu["on"] / cpu["off"],
    }


def render_md(result: dict) -> str:
    lines = [
        f"# Prefix cache benchmark ({result['started']})",
        "",
        f"Load before/after: {result['load_before']} / {result['load_after']}",
        "",
    ]
    for name, value in result["scenarios"].items():
        lines += [f"## {name}", "", "```", json.dumps(value, indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="repeat,chat,chat-short,burst,distinct")
    parser.add_argument("--rounds", type=int, default=2, help="distinct: runs per server")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    model_path = fetch("smollm2")
    tok = load_model(model_path).tokenizer
    os.sched_setaffinity(0, servers.cores()[1])
    started = utc_stamp()
    result: dict[str, Any] = {"started": started, "load_before": os.getloadavg(), "scenarios": {}}
    logdir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    long_system, mid_system = system_prompt(1500, tok), system_prompt(1000, tok)
    for name in scenarios:
        env = {"MODEL_DIR": str(model_path), **ENV}
        on_srv = start(logdir / f"{name}-on", env)
        off_srv = start(logdir / f"{name}-off", {**env, "PREFIX_CACHE": "0"})
        try:
            on, off = Client(on_srv), Client(off_srv)
            t0 = time.perf_counter()
            if name == "repeat":
                value = repeat(on, off, long_system)
            elif name == "chat":
                value = conversation(on, off, long_system)
            elif name == "chat-short":
                value = conversation(on, off, None)
            elif name == "burst":
                value = burst(on, off, mid_system)
            else:
                value = distinct(on, off, args.rounds)
            value["load"] = os.getloadavg()
            value["elapsed_s"] = time.perf_counter() - t0
            result["scenarios"][name] = value
            print(name, json.dumps(value), flush=True)
        finally:
            on_srv.stop()
            off_srv.stop()
        result["load_after"] = os.getloadavg()
        write(result)  # after every scenario: a long run that fails later keeps what it measured
    print(RESULTS / f"{started}-prefix.md")


def write(result: dict) -> None:
    """Write the run's JSON and Markdown under ``bench/results/``."""
    write_pair(RESULTS / f"{result['started']}-prefix.json", result, render_md(result), indent=1)


def start(logdir: Path, env: dict[str, str]) -> servers.Server:
    """Start greenserve pinned to the server core, waiting up to 180 s: on a loaded machine hashing
    the GGUF at start outlasts ``bench.servers``' default 30 s."""
    return servers.start("greenserve", logdir, env, ready_s=180.0)


if __name__ == "__main__":
    main()
