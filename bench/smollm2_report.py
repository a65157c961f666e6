"""The SmolLM2 serving benchmark's run facts, its targets and its Markdown (see ``bench.smollm2_serving``)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Any

from bench import procstat, servers, serving

# The targets: greenserve's tokens/s over llama.cpp's at 1 and 32 streams, TTFT p99 at 16 streams
# (ms), /healthz p99 (ms), and the share of the weight file each of two workers must not be
# charged for in its PSS (both map every page: ideally half of it).
ONE_STREAM_RATIO = 0.3
MANY_STREAMS_RATIO = 2.5
MANY_STREAMS = 32
TTFT_STREAMS = 16
TTFT_P99_MS = 1000.0
HEALTHZ_P99_MS = 50.0
SHARED_WEIGHTS_SHARE = 0.4


def meta(server_cores: list[int], client_cores: list[int], llamacpp: str) -> dict[str, Any]:
    """Return the run's facts: commit, machine, cores, load average and busy cores before it."""

    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=servers.ROOT).stdout
        except OSError:
            return ""

    all_cores = server_cores + client_cores
    before = procstat.core_busy_s(all_cores)
    time.sleep(1.0)
    busy = procstat.core_busy_s(all_cores) - before
    dirty = sh("git", "status", "--porcelain", "--untracked-files=no").strip()
    return {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": sh("git", "rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else ""),
        "python": platform.python_version(),
        "cpu": sh("sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "cpus": os.cpu_count(),
        "server_cores": server_cores,
        "client_cores": client_cores,
        "loadavg_start": list(os.getloadavg()),
        "busy_cores_before": round(busy, 2),
        "llamacpp": llamacpp,
    }


def _by_conc(series: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {r["concurrency"]: r for r in (series or {}).get("runs", [])}


def _ratio(ours: dict[int, dict], ref: dict[int, dict], conc: int, need: float, tag: str):
    if conc not in ours:
        return f"not measured ({conc} streams not run)", None
    if conc not in ref:
        return f"greenserve {ours[conc]['tokens_per_s']} tok/s; llama.cpp not measured", None
    a, b = ours[conc]["tokens_per_s"], ref[conc]["tokens_per_s"]
    ratio = a / b if b else float("inf")
    text = f"{tag}{a} / {b} tok/s = {ratio:.2f}×"
    per_cpu = ours[conc]["tokens_per_server_cpu_s"], ref[conc]["tokens_per_server_cpu_s"]
    if all(per_cpu):
        text += (
            f" (per server CPU-second {per_cpu[0]} / {per_cpu[1]} = {per_cpu[0] / per_cpu[1]:.2f}×)"
        )
    return text, ratio >= need


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Return each target of the benchmark with the measured figure and whether it was met.

    ``met`` is None when the figure was not measured (a shorter run, or no llama.cpp reference).
    """
    ours = _by_conc(result["greenserve"].get("batch_invariant_1"))
    fast = _by_conc(result["greenserve"].get("batch_invariant_0"))
    ref = _by_conc(result.get("llamacpp"))
    out = []
    for conc, need, what in (
        (1, ONE_STREAM_RATIO, "one stream"),
        (MANY_STREAMS, MANY_STREAMS_RATIO, f"{MANY_STREAMS} streams (total)"),
    ):
        text, met = _ratio(ours, ref, conc, need, "")
        if conc in fast:
            text += "; BATCH_INVARIANT=0: " + _ratio(fast, ref, conc, need, "")[0]
        out.append({"target": f"{what} ≥ {need}× llama.cpp's", "measured": text, "met": met})
    if TTFT_STREAMS in ours:
        p99 = ours[TTFT_STREAMS]["ttft_ms"]["p99"]
        text, met = f"{p99} ms", p99 is not None and p99 <= TTFT_P99_MS
    else:
        text, met = "not measured", None
    out.append(
        {"target": f"TTFT p99 at {TTFT_STREAMS} streams ≤ 1 s", "measured": text, "met": met}
    )
    worst = max(
        (
            (v["p99"], f"{run['concurrency']} streams, port {port}")
            for series in result["greenserve"].values()
            for run in series["runs"]
            for port, v in run.get("healthz_ms", {}).items()
            if v["p99"] is not None
        ),
        default=None,
    )
    out.append(
        {
            "target": f"/healthz p99 < {HEALTHZ_P99_MS:.0f} ms throughout (both ports)",
            "measured": "not measured" if worst is None else f"worst {worst[0]} ms ({worst[1]})",
            "met": None if worst is None else worst[0] < HEALTHZ_P99_MS,
        }
    )
    two = result["two_workers"]
    shared = [w["rss_kib"] - w["pss_kib"] for w in two["workers"].values()]
    need_kib = SHARED_WEIGHTS_SHARE * two["weights_kib"]
    out.append(
        {
            "target": "two workers share the weights (PSS well below RSS)",
            "measured": serving.workers_text(two) + f"; weights {two['weights_kib'] // 1024} MiB",
            "met": len(shared) == 2 and all(s >= need_kib for s in shared),
        }
    )
    return out


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def markdown(result: dict[str, Any]) -> str:
    """Return the results as Markdown: run facts, the comparison, each server's runs, targets."""
    m = result["meta"]
    ref = result.get("llamacpp", {})
    lines = [
        f"# SmolLM2 serving: greenserve vs llama.cpp ({m['utc']}, commit {m['git']})",
        "",
        f"- Model `{result['model']}`; prompt {result['prompt']!r}, {result['max_tokens']} tokens,"
        f" temperature 0, streamed; {result['window_s']} s measured per run.",
        f"- Server core {m['server_cores']}, client core {m['client_cores']} ({m['cpus']} × "
        f"{m['cpu']}, Python {m['python']}); busy cores before the run {m['busy_cores_before']}.",
        f"- Load average at start {_load(m['loadavg_start'])}, at end {_load(m.get('loadavg_end'))}"
        " (the machine is shared with other engineers' test runs).",
    ]
    if "skipped" in ref:
        lines.append(f"- llama.cpp reference skipped: {ref['skipped']}.")
    else:
        lines.append(
            f"- llama.cpp: llama-cpp-python {m['llamacpp']}, `{' '.join(ref['flags'])}`, "
            "logit_bias -100 on the end-of-generation ids, repeat_penalty 1.0."
        )
    ours = _by_conc(result["greenserve"].get("batch_invariant_1"))
    fast = _by_conc(result["greenserve"].get("batch_invariant_0"))
    theirs = _by_conc(ref)
    lines += [
        "",
        "| streams | greenserve tok/s | BATCH_INVARIANT=0 tok/s | llama.cpp tok/s | ÷ llama.cpp "
        "| ÷ llama.cpp per server CPU-s | TTFT p50 / p99 ms greenserve "
        "| TTFT p50 / p99 ms llama.cpp | ITL p99 ms greenserve | ITL p99 ms llama.cpp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for conc, run in ours.items():
        other = theirs.get(conc)
        ratio = per_cpu = "–"
        if other:
            ratio = f"{run['tokens_per_s'] / other['tokens_per_s']:.2f}×"
            mine, ref_cpu = run["tokens_per_server_cpu_s"], other["tokens_per_server_cpu_s"]
            per_cpu = f"{mine / ref_cpu:.2f}×" if mine and ref_cpu else "–"
        lines.append(
            f"| {conc} | {run['tokens_per_s']} | {fast[conc]['tokens_per_s'] if conc in fast else '–'}"
            f" | {other['tokens_per_s'] if other else '–'} | {ratio} | {per_cpu} | {_ttft(run)}"
            f" | {_ttft(other)} | {run['itl_ms']['p99']} | {other['itl_ms']['p99'] if other else '–'} |"
        )
    for key, title in (
        ("batch_invariant_1", "greenserve (BATCH_INVARIANT=1, the default)"),
        ("batch_invariant_0", "greenserve, BATCH_INVARIANT=0"),
    ):
        series = result["greenserve"].get(key)
        if series:
            lines += ["", f"## {title}", "", *serving.runs_table(series["runs"]), ""]
            for run in series["runs"]:
                lines.append(
                    f"- {run['concurrency']} streams: `/healthz` {serving.healthz_text(run)}; "
                    f"other load on the server's core {run['server_core_other_util']}, "
                    f"RSS {run['server_rss_mb']} MB."
                )
    if theirs:
        lines += ["", "## llama.cpp", "", *serving.runs_table(ref["runs"]), ""]
        for run in ref["runs"]:
            lines.append(
                f"- {run['concurrency']} streams: other load on the server's core "
                f"{run['server_core_other_util']}, RSS {run['server_rss_mb']} MB."
            )
    lines += ["", "## Answers (greedy, non-streamed)", ""]
    answers = {"greenserve": result["greenserve"]["batch_invariant_1"]["answer"]}
    if theirs:
        answers["llama.cpp"] = ref["answer"]
    for who, a in answers.items():
        lines.append(
            f"- {who}: {a['completion_tokens']} tokens in {a['seconds']} s: {a['text'][:120]!r}…"
        )
    if len(answers) == 2:
        same = _common_prefix(answers["greenserve"]["text"], answers["llama.cpp"]["text"])
        lines.append(
            f"- The same first {same} characters (float32 weights against llama.cpp's 8-bit "
            "activations in its Q4_1 products)."
        )
    two = result["two_workers"]
    lines += [
        "",
        f"Two workers (float32 weight cache {two['weights_kib'] // 1024} MiB, memory-mapped): "
        f"{serving.workers_text(two)} (PSS also divides the pages with any other process "
        "mapping the same cache file).",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    return "\n".join(lines) + "\n"


def _ttft(run: dict[str, Any] | None) -> str:
    if not run:
        return "–"
    return f"{run['ttft_ms']['p50']} / {run['ttft_ms']['p99']}"


def _load(avg: list[float] | None) -> str:
    return "–" if not avg else " / ".join(f"{x:.2f}" for x in avg)
