"""Benchmark speculative decoding on SmolLM2-135M: greenserve with it off and on against llama.cpp, one run.

Three servers, one after another, each one process pinned to the server core and driven by the same
client on the other core (``bench.servers``): greenserve with ``SPECULATIVE_TOKENS=0``, greenserve
with its default, llama.cpp's OpenAI server (llama-cpp-python; setup in
:mod:`bench.smollm2_serving`). Each answers, one request at a time:

- **grounded**: "Repeat this text exactly:" and a paragraph of ~110 tokens, as a chat prompt (the
  model's ChatML: token ids to greenserve, the text to llama.cpp, which parses its special tokens),
  greedy, ``max_tokens`` 200; the answer ends where the model ends it (both stop on the same
  end-of-turn id);
- **free**: "Once upon a time", 128 tokens at temperature 1 (seeds 1..``--answers``), the end of
  generation forced off (``ignore_eos``; llama.cpp: ``logit_bias`` -100 on its end ids);

tok/s = completion tokens / seconds of the answers (non-streamed, request to last byte, prompt
processing included). Then greenserve (default) and llama.cpp take 32 concurrent streams of 128
greedy tokens (:func:`bench.smollm2_serving.series`), so the batch figure comes from the same run.
Writes ``bench/results/<time>-speculative.json`` and ``.md`` with the load average at start and end
(the machine is shared: compare the ratios, which come from one run).

    python -m bench.speculative_serving [--llamacpp-python PY] [--answers 3] [--window 20]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench import servers, smollm2_report, smollm2_serving
from bench.smollm2_serving import answer, bodies, llamacpp_python
from model.loader import load_model

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips after "
    "decades of salt wind. Every evening the keeper climbed the spiral stairs, one hundred and "
    "twelve of them, to light the great lamp that warned ships away from the rocks below. He had "
    "done this for forty years, through storms that shook the glass and calm nights when the sea "
    "lay flat as a mirror. The villagers said he never missed a single night, not even when his "
    "daughter was born in the winter of the great flood."
)
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nRepeat this text exactly: {text}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
FREE_TOKENS = 128


def grounded_prompt(model: Path) -> list[int]:
    """Return the grounded chat prompt's token ids (SmolLM2's ChatML, special tokens parsed)."""
    tokenizer = load_model(model).tokenizer  # the weights are memory-mapped, not read
    return tokenizer.encode(CHAT.format(text=PARAGRAPH), special=True, bos=False)


def one_stream(port: int, name: str, eog: list[int], prompt: list[int], n: int, ours: bool):
    """Return the grounded and free figures of ``n`` answers each (one at a time) on ``port``."""
    out: dict[str, Any] = {}
    grounded = {"model": name, "prompt": prompt, "max_tokens": 200, "temperature": 0}
    if not ours:
        grounded.update(prompt=CHAT.format(text=PARAGRAPH), repeat_penalty=1.0)
    free_bodies = []
    for seed in range(1, n + 1):
        body = {"model": name, "prompt": smollm2_serving.PROMPT, "max_tokens": FREE_TOKENS}
        body.update(temperature=1.0, seed=seed)
        if ours:
            body["ignore_eos"] = True
        else:
            body.update(repeat_penalty=1.0, logit_bias={str(i): -100 for i in eog})
        free_bodies.append(body)
    answer(port, json.dumps(grounded).encode())  # warm
    for key, runs in (("grounded", [grounded] * n), ("free", free_bodies)):
        answers = [answer(port, json.dumps(b).encode()) for b in runs]
        tokens = sum(a["completion_tokens"] for a in answers)
        seconds = sum(a["seconds"] for a in answers)
        out[key] = {
            "tokens_per_s": round(tokens / seconds, 2),
            "completion_tokens": [a["completion_tokens"] for a in answers],
            "seconds": [a["seconds"] for a in answers],
            "text": answers[0]["text"],
        }
    return out


def drafted(srv: servers.Server) -> dict[str, float]:
    """Return greenserve's speculation counters from its ``/metrics``."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.health_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        for key in ("draft", "accepted"):
            if line.startswith(f"greenserve_spec_decode_{key}_tokens_total "):
                out[key] = float(line.split()[1])
    return out


def markdown(r: dict[str, Any]) -> str:
    """Return the result as a short Markdown report."""
    off, on, ref = r["greenserve_off"], r["greenserve_on"], r.get("llamacpp", {})
    lines = [
        f"# Speculative decoding, SmolLM2-135M ({r['meta']['utc']}, {r['meta']['git']})",
        "",
        f"Load average at start {r['meta']['loadavg_start']}, at end {r['meta']['loadavg_end']}; "
        f"server core {r['meta']['server_cores']}, client core {r['meta']['client_cores']}.",
        "",
        "| one stream | greenserve off tok/s | greenserve on tok/s | llama.cpp tok/s | on ÷ off |"
        " on ÷ llama.cpp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key in ("grounded", "free"):
        a, b = off[key]["tokens_per_s"], on[key]["tokens_per_s"]
        c = ref.get(key, {}).get("tokens_per_s")
        ratio = f"{b / c:.2f}×" if c else "–"
        lines.append(f"| {key} | {a} | {b} | {c or '–'} | {b / a:.2f}× | {ratio} |")
    g32 = on.get("streams_32")
    l32 = ref.get("streams_32")
    if g32:
        g = g32["runs"][0]["tokens_per_s"]
        line = f"\n32 streams: greenserve {g} tok/s"
        if l32:
            c = l32["runs"][0]["tokens_per_s"]
            line += f", llama.cpp {c} tok/s: {g / c:.2f}×"
        lines.append(line + ".")
    lines.append(f"\nDrafted / accepted tokens (greenserve on): {on.get('speculation')}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=3, help="answers per one-stream figure")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of the 32-stream run")
    parser.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON"))
    parser.add_argument("--model", type=Path)
    parser.add_argument("--no-batch", action="store_true", help="skip the 32-stream runs")
    args = parser.parse_args(argv)
    model, name, server_cores, client_cores, log, work, eog = smollm2_serving.begin(
        args.model, "spec"
    )
    prompt = grounded_prompt(model)
    ref_python, ref_version = llamacpp_python(args.llamacpp_python)
    result: dict[str, Any] = {
        "model": name,
        "grounded_prompt_tokens": len(prompt),
        "meta": smollm2_report.meta(server_cores, client_cores, ref_version),
    }
    log(f"load average at start: {result['meta']['loadavg_start']}")
    env = {"REQUEST_TIMEOUT_S": "600", "MODEL_DIR": str(model)}
    stream_ours, stream_ref = bodies(name, eog)
    plain_ours, plain_ref = bodies(name, eog, stream=False)
    for key, extra in (("greenserve_off", {"SPECULATIVE_TOKENS": "0"}), ("greenserve_on", {})):
        env_key = {**env, **extra, "STATS_DB": str(work / f"{key}.db")}
        srv = servers.start("greenserve", work / key, env_key, ready_s=180.0)
        try:
            result[key] = one_stream(srv.port, name, eog, prompt, args.answers, True)
            log(f"{key}: {json.dumps({k: v['tokens_per_s'] for k, v in result[key].items()})}")
            if key == "greenserve_on" and not args.no_batch:
                srv.wait_idle()
                result[key]["streams_32"] = smollm2_serving.series(
                    srv, stream_ours, plain_ours, [32], args.window, log
                )
            if key == "greenserve_on":
                result[key]["speculation"] = drafted(srv)
        finally:
            srv.stop()
    srv = smollm2_serving.start_reference(result, ref_python, ref_version, model, work, log)
    if srv is not None:
        try:
            result["llamacpp"] = {"failed": "did not answer"}
            result["llamacpp"] = one_stream(srv.port, name, eog, prompt, args.answers, False)
            log(
                f"llamacpp: {json.dumps({k: v['tokens_per_s'] for k, v in result['llamacpp'].items()})}"
            )
            if not args.no_batch:
                srv.wait_idle()
                result["llamacpp"]["streams_32"] = smollm2_serving.series(
                    srv, stream_ref, plain_ref, [32], args.window, log, extra_events=1
                )
        except OSError as exc:  # the reference crashed (its log is in the work dir): say so
            log(f"llama.cpp failed: {exc!r}")
            result["llamacpp"]["failed"] = repr(exc)
        finally:
            srv.stop()
    smollm2_serving.finish(result, "speculative", markdown, log, work)
    return result


if __name__ == "__main__":
    main()
