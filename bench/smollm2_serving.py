"""Benchmark greenserve serving SmolLM2-135M-Instruct (Q4_1 GGUF) against llama.cpp's OpenAI server.

Both servers run one process pinned to the server core and are driven by the same client
(``bench.loadgen``, pinned to the other core) in the same run: streamed answers of exactly 128
tokens at 1, 4, 16 and 32 concurrent streams (tokens/s, TTFT p50/p99, ITL p99), greenserve's
``/healthz`` probed on both its ports throughout every run, greenserve once more with
``BATCH_INVARIANT=0`` at 1 and 32 streams, then greenserve with two workers (RSS against PSS:
the float32 weights are one memory-mapped cache file). Writes ``bench/results/<time>-smollm2.json``
and ``.md`` (the load average at the start and end of the run included: the machine is shared).
greenserve runs with its default settings but ``REQUEST_TIMEOUT_S`` 600 (:data:`GREENSERVE_ENV`).

    python -m bench.smollm2_serving [--llamacpp-python PY] [--window 20] [--streams 1,4,16,32]
        [--variant-streams 1,32] [--wait-quiet S]

The request, the same for both: the plain prompt ``"Once upon a time"`` on ``/v1/completions``,
``temperature`` 0, ``max_tokens`` 128, ``stream``. Forcing all 128 tokens: greenserve takes
``"ignore_eos": true``; llama-cpp-python's completion parameters have no ``ignore_eos``, so it
gets ``logit_bias`` -100 on every end-of-generation id of the file (SmolLM2: 0 ``<|endoftext|>``
and 2 ``<|im_end|>``, as llama.cpp counts them) and ``repeat_penalty`` 1.0 (its default 1.1
would change the greedy answer). Its stream ends with an empty chunk carrying ``finish_reason``
(129 data events), which the client counts as an extra event, not a token.

The llama.cpp reference (llama-cpp-python 0.3.36, which builds llama.cpp from source: 8 to 30
minutes on this machine's 2 cores, with the load), in its own virtualenv, built without the native
CPU flags (the default native build crashes on this VM in ``libggml-cpu.so``, whose build enables
AMX)::

    python3 -m venv /work/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON \
        -DGGML_FMA=ON -DGGML_F16C=ON" \
        /work/llamacpp-venv/bin/pip install 'llama-cpp-python[server]==0.3.36'
    LLAMACPP_PYTHON=/work/llamacpp-venv/bin/python python -m bench.smollm2_serving

It is started as ``PY -m llama_cpp.server --model FILE --model_alias NAME --host 127.0.0.1 --port N``
plus :data:`bench.servers.LLAMACPP_FLAGS` (``--n_threads 1 --n_threads_batch 1 --n_ctx 2048
--interrupt_requests False --verbose False``). Without ``--llamacpp-python`` or
``LLAMACPP_PYTHON`` (or when that interpreter cannot import ``llama_cpp.server``) the reference is
skipped with one line saying so, and the targets that need it are reported as not measured.

Source: the OpenAI API reference (completions, streaming); llama-cpp-python's server
(``llama_cpp/server/types.py``: ``CreateCompletionRequest``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench import servers, serving, smollm2_report
from bench.harness import RESULTS, ElapsedLog, utc_stamp, write_pair
from bench.loadgen import run_load
from bench.run import wait_quiet
from model.fetch import fetch
from model.files import file_sha256
from model.llama.formats.gguf import open_reader, read_metadata
from model.llama.formats.gguf_cache import cache_path, default_cache_dir
from model.llama.formats.gguf_tokenizer import tokenizer_from_gguf

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 128
PROMPT = "Once upon a time"
# /healthz on each of greenserve's two ports this often, seconds: ~40 light requests a second.
PROBE_EVERY_S = 0.05
# Benchmark-only greenserve setting: at 32 streams an answer of 128 tokens takes ~100 s on this
# shared core, past the default 60 s request deadline (which would end it with an error event).
GREENSERVE_ENV = {"REQUEST_TIMEOUT_S": "600"}
# Caps, seconds, on the warm-up before a window and the drain after it (see ``series``).
MAX_WARMUP_S = 120.0
MAX_DRAIN_S = 600.0


class Start(NamedTuple):
    """What a SmolLM2 benchmark starts from (see ``begin``)."""

    model: Path  # the GGUF file
    name: str  # the model's name in requests: the file's stem
    server_cores: list[int]
    client_cores: list[int]
    log: ElapsedLog
    work: Path  # a fresh folder for the servers' logs and history databases
    eog: list[int]  # the ids that end generation (``eog_ids``)


def begin(model: Path | None, kind: str) -> Start:
    """Start a SmolLM2 benchmark named ``kind``: the GGUF (``model``, else fetched), this process
    pinned to the client cores, a log, a work folder ``greenserve-<kind>-bench-*``.

    Raises:
        ValueError: as ``eog_ids``.
    """
    model = model or fetch("smollm2")
    server_cores, client_cores = servers.cores()
    os.sched_setaffinity(0, client_cores)
    log = ElapsedLog()
    work = Path(tempfile.mkdtemp(prefix=f"greenserve-{kind}-bench-"))
    return Start(model, model.stem, server_cores, client_cores, log, work, eog_ids(model))


def finish(
    result: dict[str, Any],
    kind: str,
    markdown: Callable[[dict[str, Any]], str],
    log: ElapsedLog,
    work: Path,
) -> None:
    """End a SmolLM2 benchmark begun with ``begin``: the load average at the end and the run's
    seconds into ``result["meta"]``, then ``bench/results/<time>-<kind>.json`` and its Markdown
    (``.md``, ``markdown(result)``, made after the end's figures are in) written and printed."""
    result["meta"]["loadavg_end"] = list(os.getloadavg())
    result["meta"]["duration_s"] = log.elapsed_s()
    path = RESULTS / f"{utc_stamp()}-{kind}.json"
    text = markdown(result)
    write_pair(path, result, text)
    print(text)
    log(f"wrote {path} and .md; server logs in {work}")


def eog_ids(model: Path) -> list[int]:
    """Return the token ids that end generation for llama.cpp in GGUF file ``model``, sorted.

    Raises:
        ValueError: the file's tokenizer metadata is not supported (see
            :func:`model.llama.formats.gguf_tokenizer.tokenizer_from_gguf`).
    """
    metadata = read_metadata(open_reader(model))
    vocab = len(metadata["tokenizer.ggml.tokens"])
    return sorted(tokenizer_from_gguf(metadata, vocab, str(model)).eog_ids)


def bodies(
    name: str, eog: list[int], stream: bool = True, max_tokens: int = MAX_TOKENS
) -> tuple[bytes, bytes]:
    """Return the request bodies (greenserve's, llama.cpp's) for exactly ``max_tokens`` greedy
    tokens of model ``name`` whose end-of-generation ids are ``eog``."""
    common = {"model": name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    common["stream"] = stream
    ours = {**common, "ignore_eos": True}
    ref = {**common, "repeat_penalty": 1.0, "logit_bias": {str(i): -100 for i in eog}}
    return json.dumps(ours).encode(), json.dumps(ref).encode()


def answer(port: int, body: bytes) -> dict[str, Any]:
    """POST a non-streamed completion; return its text, completion tokens and seconds taken.

    Raises:
        RuntimeError: the answer is not a 200.
    """
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"POST /v1/completions on port {port}: {resp.status} {data[:300]!r}")
    out = json.loads(data)
    return {
        "text": out["choices"][0]["text"],
        "completion_tokens": out["usage"]["completion_tokens"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def series(
    srv: servers.Server,
    stream_body: bytes,
    plain_body: bytes,
    streams: list[int],
    window_s: float,
    log,
    extra_events: int = 0,
) -> dict[str, Any]:
    """Run one server through ``streams`` concurrencies (greenserve probed on both ports).

    Each run's warm-up and drain follow the previous run's tokens/s (the first run's follow one
    plain answer): an answer takes about ``streams × 128 / tokens/s``; the window opens only after
    that long, once the first answers have ended and their successors started spread out (the
    first streams start over half of it), else no request would start inside the window and TTFT
    would go unmeasured; and the drain waits about as long again for the answers started in the
    window to finish (llama.cpp serves one at a time, so a request waits for all the others).
    """
    first = answer(srv.port, plain_body)
    rate = MAX_TOKENS / first["seconds"]
    probe = PROBE_EVERY_S if srv.health_port is not None else None
    runs = []
    for conc in streams:
        latency_s = conc * MAX_TOKENS / rate
        spec = serving.stream_spec(
            srv,
            stream_body,
            MAX_TOKENS,
            conc,
            window_s,
            probe_every_s=probe,
            extra_events=extra_events,
            drain_s=min(1.5 * latency_s + 10.0, MAX_DRAIN_S),
            warmup_s=min(max(latency_s, 1.0), MAX_WARMUP_S),
        )
        run = run_load(spec)
        runs.append(run)
        rate = max(run["tokens_per_s"], 1.0)
        log(
            f"{srv.name} {srv.env.get('BATCH_INVARIANT', '')} c={conc}: {run['tokens_per_s']} "
            f"tok/s, TTFT p99 {run['ttft_ms']['p99']} ms, errors {run['errors']}, "
            f"healthz {serving.healthz_text(run) or '-'}"
        )
        srv.wait_idle()
    return {"answer": first, "runs": runs}


def llamacpp_python(given: str | None) -> tuple[str | None, str]:
    """Return (interpreter, version) when ``given`` can import ``llama_cpp.server``, else (None, why)."""
    if not given:
        return None, "no --llamacpp-python and no LLAMACPP_PYTHON"
    try:
        out = subprocess.run(
            [given, "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except OSError as exc:
        return None, f"{given}: {exc}"
    if out.returncode != 0:
        return None, f"{given} cannot import llama_cpp.server: {out.stderr.strip()[-300:]}"
    return given, out.stdout.strip()


def start_reference(
    result: dict[str, Any],
    ref_python: str | None,
    ref_version: str,
    model: Path,
    work: Path,
    log: ElapsedLog,
    wait_quiet_s: float = 0.0,
) -> servers.Server | None:
    """Start llama.cpp's server on ``model`` with ``ref_python`` (see ``llamacpp_python``), after
    waiting up to ``wait_quiet_s`` for idle cores; without one, log why, record
    ``result["llamacpp"] = {"skipped": ref_version}`` and return None."""
    if ref_python is None:
        log(f"llama.cpp reference skipped: {ref_version} (setup: see bench/smollm2_serving.py)")
        result["llamacpp"] = {"skipped": ref_version}
        return None
    if wait_quiet_s:
        wait_quiet(wait_quiet_s)
    return servers.start_llamacpp(ref_python, model, model.stem, work / "llamacpp")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured per run")
    parser.add_argument("--streams", default="1,4,16,32", help="concurrencies, comma-separated")
    parser.add_argument(
        "--variant-streams",
        default="1,32",
        help="concurrencies run again with BATCH_INVARIANT=0 ('' to skip)",
    )
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("LLAMACPP_PYTHON"),
        help="python of a virtualenv with llama-cpp-python[server] (default $LLAMACPP_PYTHON)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each server's runs, wait up to S seconds for the cores to go idle",
    )
    parser.add_argument(
        "--model", type=Path, help="the GGUF (default: python -m model.fetch smollm2)"
    )
    args = parser.parse_args(argv)
    streams = [int(c) for c in args.streams.split(",") if c]
    variant = [int(c) for c in args.variant_streams.split(",") if c]
    model, name, server_cores, client_cores, log, work, eog = begin(args.model, "smollm2")
    stream_ours, stream_ref = bodies(name, eog)
    plain_ours, plain_ref = bodies(name, eog, stream=False)
    ref_python, ref_version = llamacpp_python(args.llamacpp_python)
    result: dict[str, Any] = {
        "model": name,
        "model_file": str(model),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "eog_ids": eog,
        "meta": smollm2_report.meta(server_cores, client_cores, ref_version),
        "window_s": args.window,
    }
    log(f"load average at start: {result['meta']['loadavg_start']}; work dir {work}")
    env = {**GREENSERVE_ENV, "MODEL_DIR": str(model), "STATS_DB": str(work / "stats.db")}
    result["greenserve"] = {}
    for invariant, concs in (("1", streams), ("0", variant)):
        if not concs:
            continue
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        srv = servers.start(
            "greenserve", work / f"bi{invariant}", {**env, "BATCH_INVARIANT": invariant}
        )
        try:
            key = f"batch_invariant_{invariant}"
            result["greenserve"][key] = series(
                srv, stream_ours, plain_ours, concs, args.window, log
            )
        finally:
            srv.stop()
    srv = start_reference(result, ref_python, ref_version, model, work, log, args.wait_quiet)
    if srv is not None:
        try:
            result["llamacpp"] = {
                "python": ref_python,
                "flags": list(servers.LLAMACPP_FLAGS),
                **series(srv, stream_ref, plain_ref, streams, args.window, log, extra_events=1),
            }
        finally:
            srv.stop()
    weights_kib = cache_path(default_cache_dir(), file_sha256(model)).stat().st_size // 1024
    short_ours = bodies(name, eog, max_tokens=16)[0]
    two_env = {**env, "STATS_DB": str(work / "stats2.db")}
    result["two_workers"] = serving.two_workers(work / "two", two_env, short_ours, 16, weights_kib)
    result["targets"] = smollm2_report.targets(result)
    finish(result, "smollm2", smollm2_report.markdown, log, work)
    return result


if __name__ == "__main__":
    main()
