"""What one load run counts and measures, and its result object (see ``bench.loadgen``).

``bench.loadgen`` imports this module; what this one reads of the generator's connections and run
description is spelled out as protocols (:class:`Answered`, :class:`RunShape`), so the two modules
do not import each other.
"""

from __future__ import annotations

from typing import Any, Protocol

from bench import procstat


class Answered(Protocol):
    """What :func:`account` reads of a finished request (``bench.loadgen.Conn``).

    Attributes:
        t0: ``perf_counter`` when the request was sent, seconds.
        t_first: ``perf_counter`` of its first token event, or None.
        t_head: ``perf_counter`` when its status line and headers were read, or None.
        tokens: tokens the answer carried.
    """

    t0: float
    t_first: float | None
    t_head: float | None
    tokens: int


class RunShape(Protocol):
    """What :func:`report` reads of the run's description (``bench.loadgen.LoadSpec``)."""

    concurrency: int
    stream: bool
    expect_tokens: int
    extra_events: int
    spin: bool
    probe_ports: tuple[int, ...]


class Window:
    """The measurement window (``perf_counter`` seconds) and what every answer must carry."""

    __slots__ = ("start", "end", "stream_spec", "expect")

    def __init__(self, start: float, end: float, stream: bool, expect: int) -> None:
        self.start, self.end, self.stream_spec, self.expect = start, end, stream, expect


class Results:
    """Counters and samples of one run (times in seconds)."""

    def __init__(self) -> None:
        self.completed = 0
        self.completed_in_window = 0
        self.errors: dict[str, int] = {}
        self.tokens_in_window = 0
        self.ttft: list[float] = []
        self.ttfb: list[float] = []
        self.latency: list[float] = []
        self.gaps: list[float] = []
        self.zero_gaps = 0
        self.probes: dict[int, list[float]] = {}
        self.probe_errors = 0

    def error(self, kind: str) -> None:
        """Count one failed request of ``kind``."""
        self.errors[kind] = self.errors.get(kind, 0) + 1


def account(conn: Answered, outcome: str, now: float, res: Results, w: Window) -> None:
    """Count a finished request: completions and tokens in the window, TTFT and latency of the
    requests that started in it; a failure only by its kind."""
    if outcome != "ok":
        res.error(outcome)
        return
    res.completed += 1
    if w.start <= now < w.end:
        res.completed_in_window += 1
        if not w.stream_spec:
            res.tokens_in_window += conn.tokens
    if w.start <= conn.t0 < w.end:
        if conn.t_first is not None:
            res.ttft.append(conn.t_first - conn.t0)
        if conn.t_head is not None:
            res.ttfb.append(conn.t_head - conn.t0)
        res.latency.append(now - conn.t0)


def report(spec: RunShape, res: Results, snap: dict[str, float], dropped: int) -> dict[str, Any]:
    """Return the run's result object (rates per second of the window, latencies in ms).

    Raises:
        RuntimeError: the window never closed (the run was cut short).
    """
    window = snap.get("end_t", 0.0) - snap.get("t", 0.0)
    if window <= 0:
        raise RuntimeError("the measurement window never closed")
    qs = (0.5, 0.9, 0.99)
    client_cpu = snap["end_cpu"] - snap["cpu"]
    tokens = res.tokens_in_window
    if spec.stream and spec.extra_events:
        tokens *= spec.expect_tokens / (spec.expect_tokens + spec.extra_events)
    server_cpu = snap["end_server"] - snap["server"]
    out: dict[str, Any] = {
        "concurrency": spec.concurrency,
        "stream": spec.stream,
        "max_tokens": spec.expect_tokens,
        "window_s": round(window, 3),
        "completed": res.completed,
        "completed_in_window": res.completed_in_window,
        "errors": dict(sorted(res.errors.items())),
        "dropped_at_end": dropped,
        "tokens_per_s": round(tokens / window, 1),
        "requests_per_s": round(res.completed_in_window / window, 2),
        "ttft_ms": procstat.ms(res.ttft, qs),
        # Time to the response's status line and headers (a stream's opening comment comes with them).
        "ttfb_ms": procstat.ms(res.ttfb, qs),
        "latency_ms": procstat.ms(res.latency, (0.5, 0.99)),
        "itl_ms": procstat.ms(res.gaps, (0.5, 0.99, 1.0), res.zero_gaps),
        "client_cpu_s": round(client_cpu, 3),
        "client_busy": round((snap["end_busy"] - snap["busy"]) / window, 3),
        "spin": spec.spin,
        "server_cpu_s": round(server_cpu, 3),
        "server_cpu_util": round(server_cpu / window, 3),
        # Tokens per CPU-second the server used: its efficiency, much less disturbed than tokens/s
        # when something else shares the server's core.
        "tokens_per_server_cpu_s": round(tokens / server_cpu, 1) if server_cpu else None,
        # Busy time of the server's core(s) that the server itself did not use: other processes,
        # interrupts. Near 0 in a clean run.
        "server_core_other_util": round((snap["end_core"] - snap["core"] - server_cpu) / window, 3),
        "server_rss_mb": round(snap["rss"] / 2**20, 1),
        "server_threads": snap["threads"],
    }
    for port, lat in res.probes.items():
        out.setdefault("healthz_ms", {})[str(port)] = {
            **procstat.ms(lat, (0.5, 0.99, 1.0)),
            "n": len(lat),
        }
    if spec.probe_ports:
        out["healthz_errors"] = res.probe_errors
    return out
