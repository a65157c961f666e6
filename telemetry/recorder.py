"""In-memory per-minute aggregates of one worker's finished requests, waiting for the next flush.

``HistoryRecorder.observe`` is a few dict updates per request; ``telemetry.flusher.Flusher`` moves the
sums into the SQLite store (``telemetry.history``) every ``STATS_FLUSH_S`` seconds. Time comes from an
injectable ``clock`` (Unix seconds), so tests can step through minutes and days.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from telemetry.sketch import bin_key

__all__ = ["COLUMNS", "SKETCHED", "Batch", "HistoryRecorder"]

# The per-minute sums, one ``minutes`` column each (``_s`` columns are seconds, the rest counts).
COLUMNS = (
    "requests",
    "failed",
    "slow_ttft",
    "bad",
    "prompt_tokens",
    "completion_tokens",
    "ttft_count",
    "ttft_sum_s",
    "e2e_count",
    "e2e_sum_s",
)


# The latencies kept as DDSketch bins per minute (``telemetry.sketch``), for their quantiles.
SKETCHED = ("ttft", "e2e", "queue_wait", "itl")


@dataclass
class Batch:
    """Per-minute sums not yet written: ``rows[minute][column]`` and the sketch bin counts
    ``bins[(minute, metric, key)]`` (``metric`` one of :data:`SKETCHED`)."""

    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    bins: dict[tuple[int, str, int], int] = field(default_factory=dict)

    def merge(self, other: Batch) -> None:
        """Add ``other``'s sums to this batch."""
        for minute, row in other.rows.items():
            mine = self.rows.setdefault(minute, dict.fromkeys(COLUMNS, 0))
            for c, v in row.items():
                mine[c] += v
        for key, n in other.bins.items():
            self.bins[key] = self.bins.get(key, 0) + n


class HistoryRecorder:
    """Aggregate finished requests per minute in memory until the next flush.

    Args:
        clock: returns Unix time in seconds (``time.time``; a fake in tests).
        slo_ttft_s: a request whose first token came later than this is ``slow_ttft`` (``SLO_TTFT_S``).
    """

    def __init__(self, clock: Callable[[], float], slo_ttft_s: float) -> None:
        self.clock = clock
        self.slo_ttft_s = slo_ttft_s
        self._batch = Batch()

    def observe(
        self,
        *,
        failed: bool,
        ttft_s: float | None,
        e2e_s: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        queue_wait_s: float | None = None,
        itl_bins: Mapping[int, int] | None = None,
    ) -> None:
        """Count one finished request in the current minute.

        Args:
            failed: a 5xx, or an error after the first byte.
            ttft_s: seconds to the first token, or None.
            e2e_s: seconds from arrival to the end, or None when it was never admitted.
            prompt_tokens, completion_tokens: usage counts.
            queue_wait_s: seconds from arrival to a slot (or to giving up), or None.
            itl_bins: the request's inter-token gaps as sketch bins (``telemetry.sketch.bin_counts``).
        """
        minute = int(self.clock() // 60)
        row = self._batch.rows.get(minute)
        if row is None:
            row = self._batch.rows[minute] = dict.fromkeys(COLUMNS, 0)
        slow = ttft_s is not None and ttft_s > self.slo_ttft_s
        row["requests"] += 1
        row["failed"] += failed
        row["slow_ttft"] += slow
        row["bad"] += failed or slow
        row["prompt_tokens"] += prompt_tokens
        row["completion_tokens"] += completion_tokens
        bins = self._batch.bins
        for metric, value in (("ttft", ttft_s), ("e2e", e2e_s), ("queue_wait", queue_wait_s)):
            if value is None:
                continue
            if metric != "queue_wait":
                row[f"{metric}_count"] += 1
                row[f"{metric}_sum_s"] += value
            key = (minute, metric, bin_key(value))
            bins[key] = bins.get(key, 0) + 1
        for b, n in (itl_bins or {}).items():
            key = (minute, "itl", b)
            bins[key] = bins.get(key, 0) + n

    def drain(self) -> Batch:
        """Return everything counted since the last drain and start afresh."""
        batch, self._batch = self._batch, Batch()
        return batch

    def restore(self, batch: Batch) -> None:
        """Put back a batch that could not be written (it is retried at the next flush)."""
        self._batch.merge(batch)
