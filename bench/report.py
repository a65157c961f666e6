"""Turn a benchmark results object into its summary ratios and the README's Markdown tables."""

from __future__ import annotations

from typing import Any


def _find(results: dict, server: str, scenario: str, conc: int) -> dict | None:
    for run in results.get("runs", []):
        if (run["server"], run["scenario"], run["concurrency"]) == (server, scenario, conc):
            return run
    return None


def _ratio(a: dict | None, b: dict | None, key: str = "tokens_per_s") -> float | None:
    if a is None or b is None or not b.get(key) or a.get(key) is None:
        return None
    return round(a[key] / b[key], 2)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Return greenserve's tokens/s ratios to the canned-frames ceiling and to FastAPI, per scenario."""
    out: dict[str, Any] = {}
    for run in results.get("runs", []):
        if run["server"] != "greenserve" or run["scenario"] == "healthz":
            continue
        key = f"{run['scenario']}_c{run['concurrency']}"
        args = (run["scenario"], run["concurrency"])
        canned, fastapi = _find(results, "pywsgi", *args), _find(results, "fastapi", *args)
        out[key] = {
            "vs_pywsgi_ceiling": _ratio(run, canned),
            "vs_fastapi": _ratio(run, fastapi),
            "per_cpu_s_vs_pywsgi_ceiling": _ratio(run, canned, "tokens_per_server_cpu_s"),
            "per_cpu_s_vs_fastapi": _ratio(run, fastapi, "tokens_per_server_cpu_s"),
        }
    return out


def _ms(d: dict | None, *keys: str) -> str:
    if not d:
        return "–"
    return " / ".join("–" if d.get(k) is None else f"{d[k]:.1f}" for k in keys)


# What each probe scenario of ``bench.run`` loads the server with, by its name.
HEALTHZ_LOADS = {
    "healthz": "{} streams run",
    "healthz-json": "{} closed-loop JSON clients run",
    "healthz-burst": "{} streams arrive at once",
}


def _errors(run: dict) -> str:
    return str(sum(run["errors"].values())) if run["errors"] else "0"


def markdown(results: dict[str, Any]) -> str:
    """Return the comparison table, greenserve's detail table, and the healthz, hold and micro lines."""
    lines = [
        "| scenario | conc | greenserve tok/s | pywsgi canned tok/s | FastAPI tok/s "
        "| ÷ canned | ÷ FastAPI | ÷ canned, per CPU-s | ÷ FastAPI, per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    detail = [
        "| server | scenario | conc | tok/s | tok per CPU-s | req/s | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p99 ms | errors | server CPU util | other load on its core | RSS MB "
        "| client busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    for run in results.get("runs", []):
        r = run
        per_cpu = r.get("tokens_per_server_cpu_s")
        detail.append(
            f"| {r['server']} | {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.0f} "
            f"| {'–' if per_cpu is None else f'{per_cpu:.0f}'} | {r['requests_per_s']:.1f} "
            f"| {_ms(r['ttft_ms'], 'p50', 'p90', 'p99')} | {_ms(r['itl_ms'], 'p50', 'p99')} "
            f"| {_errors(r)} | {r['server_cpu_util']:.2f} | {r['server_core_other_util']:.2f} "
            f"| {r['server_rss_mb']:.0f} | {r['client_busy']:.2f} |"
        )
        key = (r["scenario"], r["concurrency"])
        if r["scenario"].startswith("healthz") or key in seen:
            continue
        seen.add(key)
        cells = [_find(results, s, *key) for s in ("greenserve", "pywsgi", "fastapi")]
        tps = ["–" if c is None else f"{c['tokens_per_s']:.0f}" for c in cells]
        ratios = [_ratio(cells[0], cells[1]), _ratio(cells[0], cells[2])]
        ratios += [_ratio(cells[0], c, "tokens_per_server_cpu_s") for c in cells[1:]]
        lines.append(
            f"| {key[0]} {256 if key[0].startswith('stream') else 64} tok | {key[1]} | {' | '.join(tps)} | "
            + " | ".join("–" if x is None else f"{x:.2f}×" for x in ratios)
            + " |"
        )
    out = lines + [""] + detail + [""]
    for run in results.get("runs", []):
        if run["scenario"].startswith("healthz"):
            ports = list(run.get("healthz_ms", {}).values())
            api, health = (ports + [None, None])[:2]
            load = HEALTHZ_LOADS.get(run["scenario"], "{} streams run").format(run["concurrency"])
            out.append(
                f"- `/healthz` while {load}: API port p50/p99 "
                f"{_ms(api, 'p50', 'p99')} ms, health port {_ms(health, 'p50', 'p99')} ms "
                f"({run.get('healthz_errors', 0)} probe errors; stream TTFT p99 "
                f"{_ms(run['ttft_ms'], 'p99')} ms)."
            )
    hold = results.get("hold")
    if hold:
        api = list(hold["healthz_ms"].values())[:1]
        out.append(
            f"- hold: {hold['held_at_end']} of {hold['target']} slowly-read streams held on one worker "
            f"(errors {sum(hold['errors'].values())}, closed by server {hold['closed_by_server']}); "
            f"RSS {hold['server_rss_mb_idle']:.0f} → {hold['server_rss_mb_held']:.0f} MB, "
            f"{hold['rss_kib_per_stream']} KiB per stream; `/healthz` p99 meanwhile "
            f"{_ms(api[0] if api else None, 'p99')} ms."
        )
    m = results.get("micro")
    if m:
        out.append(
            f"- model work per token (sampling + UTF-8 + chunk encoding): greedy "
            f"{m['greedy_us_per_token']:.2f} µs, T=1 {m['t1_us_per_token']:.2f} µs "
            f"(a straightforward numpy version: {m['naive_greedy_us_per_token']:.1f} / "
            f"{m['naive_t1_us_per_token']:.1f} µs)."
        )
    meta = results.get("meta", {})
    out.append(
        f"- `{meta.get('command', '')}` at {meta.get('git', '')} on {meta.get('cpus')} × "
        f"{meta.get('cpu', '')}, server on core {meta.get('server_cores')}, client on core "
        f"{meta.get('client_cores')}, {meta.get('duration_s')} s."
    )
    return "\n".join(out) + "\n"
