"""``/stats`` latency percentiles come from the observations: DDSketch bins kept per worker and minute,
merged across workers and minutes, within 1 % of the observed order statistic (not a value interpolated
inside the first histogram bucket). ``count`` and ``mean`` stay those of the Prometheus histograms."""

from __future__ import annotations

import json
import math

from tests.server import wait_until

QS = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
FIELDS = {"e2e": "latency_s", "ttft": "ttft_s", "queue_wait": "queue_wait_s"}


def request_lines(log: str) -> list[dict]:
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("message") == "request" and x["path"] == "/v1/completions"]


def order_statistic(values: list[float], q: float) -> float:
    """The observation at rank ``q * (n - 1)`` rounded down: what a DDSketch quantile estimates."""
    return sorted(values)[math.floor(q * (len(values) - 1))]


def test_stats_percentiles_are_observed_values_merged_over_workers(succ_dir, serve):
    srv = serve(workers=2, MODEL_DIR=str(succ_dir), STATS_FLUSH_S="0.05")
    srv.wait_workers(2)
    sizes = [1, 4, 16, 64, 256, 1024, 4096] * 4
    for k, max_tokens in enumerate(sizes):
        body = {"model": "m", "prompt": "a", "max_tokens": max_tokens, "seed": k}
        assert srv.complete(body)[0] == 200
    lines = wait_until(
        lambda: len(x := request_lines(srv.log_text())) == len(sizes) and x, 10, "28 log lines"
    )
    exact = {
        metric: {name: order_statistic([x[field] for x in lines], q) for name, q in QS.items()}
        for metric, field in FIELDS.items()
    }

    def close(got: dict) -> bool:
        # 1 % from the sketch, 1 us from the log's rounding of each value to 6 decimals.
        return all(
            got[m][name] is not None and abs(got[m][name] - value) <= 0.01 * value + 1e-6
            for m, per in exact.items()
            for name, value in per.items()
        )

    seen: list[dict] = []

    def stats() -> dict | None:
        status, _, raw = srv.get("/stats")
        assert status == 200
        seen[:] = [json.loads(raw)["latency"]]
        return seen[0] if close(seen[0]) else None

    latency = wait_until(stats, 10, lambda: f"{seen} to match {exact}")
    assert latency["e2e"]["count"] == len(sizes)
    # The Prometheus mean, of the same observations the log rounds to 6 decimals.
    total = sum(x["latency_s"] for x in lines)
    assert abs(latency["e2e"]["mean"] * len(sizes) - total) <= len(sizes) * 1e-6
    waits = [x["queue_wait_s"] for x in lines]
    assert latency["queue_wait"]["p99"] <= 1.01 * max(waits) + 1e-6
    assert 0 < latency["itl"]["p50"] <= latency["itl"]["p90"] <= latency["itl"]["p99"]
