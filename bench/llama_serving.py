"""Benchmark greenserve serving a Llama model (stories260K, converted from the shared llama2.c files).

Runs, on one worker pinned to the server core: streamed generation (``max_tokens`` 128, ``ignore_eos``)
at 1, 8 and 32 concurrent streams (tokens/s shows the gain from continuous batching), TTFT, and
``/healthz`` on both ports while 8 streams generate; then RSS with 2 workers (each maps the same weight
file, so their proportional set sizes show the shared pages). Writes ``bench/results/<time>-llama.json``
and ``.md``.

    python -m bench.llama_serving [--window 5] [--data ../shared/data]

Source: docs/ARCHITECTURE.md §5 (the engine contract).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import servers, serving
from bench.harness import RESULTS, utc_stamp, write_pair
from bench.loadgen import run_load
from model.llama.formats.convert import convert_llama2c

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 128


def _body(max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "stories260K",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument(
        "--data",
        default=os.environ.get("GREENSERVE_SHARED_DATA") or str(ROOT.parent / "shared" / "data"),
        help="folder holding stories260K/",
    )
    args = parser.parse_args(argv)
    src = Path(args.data) / "stories260K"
    work = Path(tempfile.mkdtemp(prefix="greenserve-llama-bench-"))
    model_dir = convert_llama2c(src / "stories260K.bin", src / "tok512.bin", work / "stories260K")
    env = {"MODEL_DIR": str(model_dir), "STATS_DB": str(work / "stats.db")}
    srv = servers.start("greenserve", work, env)
    body = _body(MAX_TOKENS)
    runs = []
    try:
        for conc in (1, 8, 32):
            runs.append(run_load(serving.stream_spec(srv, body, MAX_TOKENS, conc, args.window)))
            srv.wait_idle()
        spec = serving.stream_spec(srv, body, MAX_TOKENS, 8, args.window, probe_every_s=0.02)
        healthz = run_load(spec)
    finally:
        srv.stop()
    weights_kib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) // 1024
    two_env = {**env, "STATS_DB": str(work / "stats2.db")}
    result = {
        "model": "stories260K",
        "max_tokens": MAX_TOKENS,
        "runs": runs,
        "healthz_8": healthz,
        "two_workers": serving.two_workers(work / "two", two_env, _body(16), 16, weights_kib),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    md = _markdown(result)
    write_pair(RESULTS / f"{utc_stamp()}-llama.json", result, md)
    print(md)
    return result


def _markdown(result: dict[str, Any]) -> str:
    lines = serving.runs_table(result["runs"])
    lines.append("")
    lines.append(
        f"- `/healthz` while 8 streams generate: {serving.healthz_text(result['healthz_8'])}."
    )
    two = result["two_workers"]
    lines.append(
        f"- 2 workers (weights file {two['weights_kib']} KiB, memory-mapped): "
        f"{serving.workers_text(two)}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
