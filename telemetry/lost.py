"""Requests lost with a worker that died: read from its gauge files, counted by the master.

A worker killed by a signal (the OOM killer, ``kill -9``, gunicorn's timeout) cannot log or count
the requests it was serving: their streams end without ``[DONE]`` and their JSON answers never come.
Its last written ``greenserve_requests_running`` and ``greenserve_requests_queued`` values are still
in its ``gauge_livesum_<pid>.db`` file until the master marks it dead, so the master reads them
first (gunicorn's ``child_exit`` hook) and counts them in its own counter file:
``greenserve_requests_total{endpoint="unknown", status="502", finish_reason="error",
end_reason="worker_lost", model="", variant=""}`` (502: what a proxy answers for an upstream that
died; no model: which one the requests asked for died with the worker), with one log line.

Source: prometheus/client_python multiprocess mode (``gauge_livesum_<pid>.db`` files,
``MultiProcessCollector``).
"""

from __future__ import annotations

import logging
import os

_GAUGES = ("greenserve_requests_running", "greenserve_requests_queued")
_log = logging.getLogger("greenserve.worker")
_counter = None  # the master's requests counter, made on first use (per process)


def requests_in_flight(metrics_dir: str, pid: int) -> int:
    """Return how many requests worker ``pid`` last said it was running or queueing.

    Args:
        metrics_dir: the ``PROMETHEUS_MULTIPROC_DIR`` the worker wrote to.
        pid: the worker's process id.

    Returns:
        Running plus queued requests, 0 when the worker wrote no gauge file. Never raises.
    """
    from prometheus_client.multiprocess import MultiProcessCollector

    path = os.path.join(metrics_dir, f"gauge_livesum_{pid}.db")
    if not os.path.exists(path):
        return 0
    try:
        metrics = MultiProcessCollector._read_metrics([path])
    except Exception:  # noqa: BLE001 - a torn file must not fail the master's hook
        return 0
    total = 0.0
    for name in _GAUGES:
        metric = metrics.get(name)
        if metric is not None:
            total += sum(s.value for s in metric.samples)
    return max(0, round(total))


def count_lost(metrics_dir: str, pid: int, end_reason: str) -> int:
    """Log and count the requests a dead worker held (call before it is marked dead).

    Args:
        metrics_dir: the ``PROMETHEUS_MULTIPROC_DIR`` of this master.
        pid: the dead worker's process id.
        end_reason: the ``end_reason`` label the lost requests are counted under.

    Returns:
        How many requests were lost (0: nothing logged or counted). Never raises.
    """
    global _counter
    lost = requests_in_flight(metrics_dir, pid)
    if not lost:
        return 0
    try:
        if _counter is None:
            from prometheus_client import CollectorRegistry, Counter

            from telemetry.metrics import NO_MODEL, REQUEST_LABELS, REQUESTS_HELP

            _counter = Counter(
                "greenserve_requests", REQUESTS_HELP, REQUEST_LABELS, registry=CollectorRegistry()
            )
        _counter.labels("unknown", "502", "error", end_reason, NO_MODEL, NO_MODEL).inc(lost)
    except Exception:  # noqa: BLE001 - counting must never fail the master
        _log.exception("could not count the requests lost with worker %s", pid)
    _log.error(
        "worker %s died with %d requests in flight; their streams ended without [DONE]",
        pid,
        lost,
        extra={"worker_pid": pid, "lost_requests": lost, "end_reason": end_reason},
    )
    return lost
