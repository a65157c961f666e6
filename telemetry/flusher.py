"""The per-worker greenlet that moves the in-memory history into SQLite every few seconds.

SQLite calls run on the gevent hub's thread pool (``run_in_thread``), so a slow disk or another
worker's lock never freezes this worker's connections. A batch that cannot be written goes back to the
recorder and is retried at the next flush. gunicorn's ``post_worker_init`` starts the greenlet;
``close()`` (from ``worker_exit``) writes what is left and removes the worker's heartbeat row.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import gevent
import gevent.lock

from telemetry.history import HistoryStore
from telemetry.recorder import HistoryRecorder

__all__ = ["Flusher", "run_in_thread"]

log = logging.getLogger("greenserve.history")
T = TypeVar("T")
PRUNE_EVERY_S = 600.0


def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on the hub's native thread pool and wait cooperatively for its result.

    Raises:
        Exception: whatever ``fn`` raises.
    """
    return gevent.get_hub().threadpool.apply(fn, args)


class Flusher:
    """Write a worker's history batches and heartbeat to the store every ``interval_s`` seconds.

    Args:
        recorder: the worker's in-memory aggregates.
        store: the shared SQLite store.
        interval_s: seconds between flushes (``STATS_FLUSH_S``).
        worker_state: returns the worker's state for ``/stats`` (a JSON-able dict), or None.
    """

    def __init__(
        self,
        recorder: HistoryRecorder,
        store: HistoryStore,
        interval_s: float,
        worker_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.recorder = recorder
        self.store = store
        self.interval_s = interval_s
        self.worker_state = worker_state
        self.started_at = recorder.clock()
        self._greenlet: gevent.Greenlet | None = None
        self._closed = False
        self._pruned_at = 0.0
        # One flush at a time: a reader that flushes first then sees every batch drained before it.
        self._lock = gevent.lock.BoundedSemaphore(1)

    def start(self) -> None:
        """Spawn the flush greenlet unless it runs already or the flusher is closed."""
        if self._greenlet is None and not self._closed:
            self._greenlet = gevent.spawn(self._run)

    def heartbeat(self) -> dict[str, Any]:
        """Return this worker's heartbeat row (see ``HistoryStore.write``)."""
        state = self.worker_state() if self.worker_state is not None else {}
        return {
            "pid": os.getpid(),
            "master_pid": os.getppid(),
            "started_at": self.started_at,
            "updated_at": self.recorder.clock(),
            "state": state,
        }

    def flush(self, in_thread: bool = False) -> bool:
        """Write what was recorded since the last flush, and the heartbeat; True when written.

        Args:
            in_thread: run the SQLite work on the hub's thread pool (from a greenlet of a worker).
        """
        with self._lock:
            return self._flush(in_thread)

    def _flush(self, in_thread: bool) -> bool:
        batch = self.recorder.drain()
        try:
            beat = self.heartbeat()
            if in_thread:
                run_in_thread(self.store.write, batch, beat)
            else:
                self.store.write(batch, beat)
            now = self.recorder.clock()
            if now - self._pruned_at >= PRUNE_EVERY_S:
                self._pruned_at = now
                (run_in_thread if in_thread else _call)(self.store.prune, now)
        except Exception:  # telemetry never breaks the worker; the batch is retried
            self.recorder.restore(batch)
            log.warning("history flush to %s failed", self.store.path, exc_info=True)
            return False
        return True

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            self.flush(in_thread=True)
            gevent.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def close(self) -> None:
        """Stop the greenlet, write what is left and remove the heartbeat row; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._greenlet is not None:
            self._greenlet.kill(block=True, timeout=2.0)
        self.flush()
        try:
            self.store.remove_worker(os.getpid())
        except Exception:
            log.warning("could not remove the heartbeat of worker %d", os.getpid(), exc_info=True)


def _call(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)
