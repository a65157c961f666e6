"""Benchmark an agent loop on SmolLM2-135M-Instruct: each turn reuses the previous prompt and answer.

One greenserve server, one worker, its defaults (prefix cache and speculation on), pinned to the server
core; the client on the other. An agent's conversation (a system prompt of instructions and tools, a
task) runs ``--turns`` turns of ``/v1/chat/completions`` (greedy, ``max_tokens`` 64); each turn appends
the answer and a tool-result-like user message of ~40 tokens. For every turn:

- ``cached_tokens`` of the agent's request against the common token prefix of its prompt with the
  previous turn's prompt + answer (the answer's generated ids, its end-of-turn token included; the
  prompt ids from the real template and tokenizer, the answer's from its logprobs' bytes): the target
  is cached >= that prefix - 16;
- whether re-tokenizing the answer (it comes back as text) changed its ids: the next prompt leaves
  the generated ids before the answer's end;
- its TTFT (the server's own, the log line's ``ttft_s``) against the same request cold (a fresh
  ``cache_salt``: nothing is cached under it), run just before; the target is <= 0.15x. The cold and
  the cached answers must be the same text and logprobs.

``--lanes`` conversations run side by side, turn by turn, each under its own salt (the loop is
greedy, so they are the same conversation): a turn's figures are the lanes' medians.
``--micro`` also times the cache itself in-process on SmolLM2's shapes: the key chain, publishing
and restoring the blocks of a 2,048-token prompt, 16-token blocks against 128-token ones.

    python -m bench.prefix_turns [--turns 10] [--lanes 3] [--system-tokens 1000] [--micro]

Writes ``bench/results/<time>-prefix-turns.json`` and ``.md`` with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import servers
from bench.harness import RESULTS, utc_stamp, write_pair
from bench.kernels_products import cpu_info
from bench.prefix_cache import Client, start, text_of
from model.fetch import fetch
from model.loader import LoadedModel, load_model
from wsgi_app.http.chat import serving_template
from wsgi_app.settings import Settings

BLOCK = 16  # model.llama.serving.prefix_cache.BLOCK_TOKENS
TASK = "Find out why the nightly report job failed and fix the configuration."
TOOLS = ("read_file", "list_dir", "run_shell", "search_code", "write_file", "http_get")


def system_prompt(tokens: int, tok: Any) -> str:
    """Return agent instructions and tool descriptions of about ``tokens`` tokens."""
    head = (
        "You are a coding agent. Use one tool per turn and wait for its result. Tools: "
        + "; ".join(f"{t}(path, args): {text_of(12, i)}" for i, t in enumerate(TOOLS))
    )
    words = max(0, tokens - len(tok.encode(head)))
    while words and len(tok.encode(head + " " + text_of(words, 3))) > tokens:
        words -= 10
    return head + (" Notes: " + text_of(words, 3) if words > 0 else "")


def tool_result(turn: int, tok: Any) -> str:
    """Return a tool result of about 40 tokens."""
    words = 40
    while len(tok.encode(f"Tool result {turn}: " + text_of(words, 100 + turn))) > 40:
        words -= 1
    return f"Tool result {turn}: " + text_of(words, 100 + turn)


def generated_ids(choice: dict, ids_of_bytes: dict[bytes, list[int]]) -> list[int]:
    """Return a choice's generated ids, read off its logprobs' bytes (each maps to one id)."""
    out = []
    for entry in choice["logprobs"]["content"]:
        ids = ids_of_bytes[bytes(entry["bytes"])]
        if len(ids) != 1:
            raise RuntimeError(f"bytes {entry['bytes']} are {len(ids)} tokens")
        out.append(ids[0])
    return out


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agent_loop(client: Client, model: LoadedModel, turns: int, lanes: int, system: str) -> dict:
    """Run ``lanes`` copies of the agent's conversation turn by turn; return per-turn figures."""
    tok = model.tokenizer
    template = serving_template(model, Settings.from_env({}))
    ids_of_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tok.token_bytes):
        ids_of_bytes.setdefault(bytes(b), []).append(i)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
    rows, previous = [], None  # previous: (prompt ids, generated ids, finish reason)
    for turn in range(1, turns + 1):
        prompt = template.encode(messages, tok)
        body = {"model": "m", "messages": messages, "max_tokens": 64, "temperature": 0}
        body["logprobs"] = True
        cold, warm = [], []
        for lane in range(lanes):
            cold.append(
                client.ask("/v1/chat/completions", {**body, "cache_salt": f"cold-{turn}-{lane}"})
            )
            warm.append(client.ask("/v1/chat/completions", {**body, "cache_salt": f"agent-{lane}"}))
        choices = [x["doc"]["choices"] for x in cold + warm]
        same = all(c == choices[0] for c in choices)
        doc = warm[0]["doc"]
        assert doc["usage"]["prompt_tokens"] == len(prompt), (doc["usage"], len(prompt))
        cached = [x["doc"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in warm]
        ratios = [w["ttft_s"] / c["ttft_s"] for w, c in zip(warm, cold, strict=True)]
        row: dict[str, Any] = {
            "turn": turn,
            "prompt_tokens": len(prompt),
            "cached_tokens": cached[0] if len(set(cached)) == 1 else cached,
            "cold_ttft_s": statistics.median(c["ttft_s"] for c in cold),
            "cached_ttft_s": statistics.median(w["ttft_s"] for w in warm),
            "ttft_ratio": statistics.median(ratios),
            "ttft_ratios": ratios,
            "cold_ttfts_s": [c["ttft_s"] for c in cold],
            "cached_ttfts_s": [w["ttft_s"] for w in warm],
            "same_answers": same,
        }
        if previous is not None:
            prev_prompt, prev_answer, prev_finish = previous
            answer_end = len(prev_prompt) + len(prev_answer)
            shared = common(prompt, prev_prompt + prev_answer)
            # the end-of-turn token the model sampled is the answer's too (its last, never fed)
            if prev_finish == "stop" and shared == answer_end and prompt[shared] in tok.eos_ids:
                shared += 1
            row["common_prefix"] = shared
            row["answer_retokenized_differently"] = shared < answer_end
            row["cached_target_met"] = min(cached) >= shared - BLOCK
            row["ttft_target_met"] = row["ttft_ratio"] <= 0.15
        choice = doc["choices"][0]
        previous = (prompt, generated_ids(choice, ids_of_bytes), choice["finish_reason"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        messages += [
            {"role": "assistant", "content": choice["message"]["content"]},
            {"role": "user", "content": tool_result(turn, tok)},
        ]
    later = rows[1:]
    return {
        "turns": rows,
        "answers_retokenized_differently": sum(r["answer_retokenized_differently"] for r in later),
        "cached_target_met": all(r["cached_target_met"] for r in later),
        "max_ttft_ratio_turns_2_on": max(r["ttft_ratio"] for r in later),
        "ttft_target_met": all(r["ttft_target_met"] for r in later),
        "same_answers": all(r["same_answers"] for r in rows),
    }


def micro(model: LoadedModel, tokens: int = 2048, repeats: int = 7) -> dict:
    """Time the cache on SmolLM2's shapes: keys, publishing, restoring ``tokens`` positions."""
    from model.llama.forward.kv_cache import KVPool
    from model.llama.serving.prefix_cache import PrefixCache, block_keys

    config = model.model.config
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, config.vocab_size, tokens)]
    pool = KVPool(config.n_layers, config.n_kv_heads, config.head_dim, config.max_seq_len)
    logits = rng.standard_normal(config.vocab_size).astype(np.float32)
    out: dict[str, Any] = {"prompt_tokens": tokens}
    for block in (16, 128):
        times: dict[str, list[float]] = {
            "keys": [], "miss": [], "publish": [], "restore": [], "republish": []
        }  # fmt: skip
        for _ in range(repeats):
            cache = PrefixCache.for_model(config, block, 1 << 34)
            lane, missed, target = (pool.take(tokens) for _ in range(3))
            lane.k[:, :, :tokens] = 0.5
            lane.v[:, :, :tokens] = 1.0
            lane.length = tokens
            t0 = time.perf_counter()
            block_keys(prompt, "salt", block)
            t1 = time.perf_counter()
            hit = cache.restore(prompt, "salt", missed)  # keys and a lookup that misses
            t2 = time.perf_counter()
            cache.publish_prompt(hit, lane, logits)  # copies every block and the end
            t3 = time.perf_counter()
            again = cache.restore(prompt, "salt", target)  # keys, lookups and the copies
            t4 = time.perf_counter()
            cache.publish_blocks(again, prompt, lane)  # all held: the walk and the touch
            t5 = time.perf_counter()
            assert again.cached_tokens == tokens
            for name, seconds in zip(
                times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
            ):
                times[name].append(seconds)
            for c in (lane, missed, target):
                pool.release(c)
        out[f"block_{block}"] = {
            k + "_ms": round(1e3 * statistics.median(v), 3) for k, v in times.items()
        }
    return out


def render_md(result: dict) -> str:
    lines = [
        f"# Agent turns and the prefix cache ({result['started']})",
        "",
        f"CPU: {result['cpu']}; load before/after: {result['load_before']} / {result['load_after']}",
        "",
        "| turn | prompt | cached | common prefix | retokenized | cold TTFT s | cached TTFT s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["agent"]["turns"]:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{r.get('common_prefix', '')} | {r.get('answer_retokenized_differently', '')} | "
            f"{r['cold_ttft_s']:.3f} | {r['cached_ttft_s']:.3f} | {r['ttft_ratio']:.3f} |"
        )
    summary = {k: v for k, v in result["agent"].items() if k != "turns"}
    lines += ["", "```", json.dumps(summary, indent=1), "```", ""]
    if "micro" in result:
        lines += [
            "## The cache in-process",
            "",
            "```",
            json.dumps(result["micro"], indent=1),
            "```",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--lanes", type=int, default=3, help="conversations side by side")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--micro", action="store_true", help="also time the cache in-process")
    args = parser.parse_args()
    model_path = fetch("smollm2")
    model = load_model(model_path)
    os.sched_setaffinity(0, servers.cores()[1])
    started = utc_stamp()
    result: dict[str, Any] = {
        "started": started,
        "cpu": cpu_info(),
        "load_before": os.getloadavg(),
        "args": vars(args),
    }
    system = system_prompt(args.system_tokens, model.tokenizer)
    logdir = Path(tempfile.mkdtemp(prefix="bench-prefix-turns-"))
    srv = start(
        logdir, {"MODEL_DIR": str(model_path), "REQUEST_TIMEOUT_S": "900", "STATS_FLUSH_S": "1"}
    )
    try:
        result["agent"] = agent_loop(Client(srv), model, args.turns, args.lanes, system)
    finally:
        srv.stop()
    if args.micro:
        result["micro"] = micro(model)
    result["load_after"] = os.getloadavg()
    path = RESULTS / f"{started}-prefix-turns.json"
    write_pair(path, result, render_md(result), indent=1)
    print(path.with_suffix(".md"))


if __name__ == "__main__":
    main()
