"""The native threads output constraints are compiled on: shared fairly, waited for within deadlines.

A compile can take from ~1 ms to ~0.1 s of CPU (llguidance's caps, ``model.grammar.compile``) and
cannot be interrupted once started (a native thread). So that a client sending many costly
constraints cannot starve everyone else's, the pool of :data:`COMPILE_THREADS` threads is shared so:

- **one client at a time**: each client (``wsgi_app.http.client_identity``: the API key, else the
  address) has at most :data:`CLIENT_COMPILES` compile on the pool; its others wait their turn in
  its own line, never in front of another client's;
- **one compile per constraint**: requests that need the same grammar (same tenant and canonical
  JSON) while it is compiled wait for that one compile;
- **within the deadline**: a request waits for its grammar at most until its deadline
  (``REQUEST_TIMEOUT_S`` from arrival), then is answered 504; the compile goes on and its outcome
  is cached for the next request, unless nobody waits for it any more by the time its turn comes
  (then it is dropped).

Everything here but the compile itself runs on the gevent hub (greenlets); the waiting greenlets
yield to it.

Source: docs/ARCHITECTURE.md §6 (constraints), §15 (heavy work off the hub).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import gevent
from gevent.event import AsyncResult
from gevent.lock import Semaphore
from gevent.threadpool import ThreadPool

COMPILE_THREADS = 2  # a slow grammar does not hold up the next one; the hub competes with two
CLIENT_COMPILES = 1  # compiles one client may have on the pool at once: never all the threads


class _Job:
    """One compile: its outcome, and how many requests wait for it."""

    __slots__ = ("outcome", "waiters")

    def __init__(self) -> None:
        self.outcome = AsyncResult()
        self.waiters = 0


class _Line:
    """One client's turn on the pool, and how many of its compiles use or wait for it."""

    __slots__ = ("turn", "users")

    def __init__(self) -> None:
        self.turn = Semaphore(CLIENT_COMPILES)
        self.users = 0


class CompilePool:
    """Run compiles on native threads: one line per client, one compile per key, deadline-bound.

    Args:
        threads: the pool's native threads.
    """

    def __init__(self, threads: int = COMPILE_THREADS) -> None:
        self._threads = threads
        self._pool: ThreadPool | None = None  # made on first use (a worker may never compile)
        self._jobs: dict[Hashable, _Job] = {}
        self._lines: dict[str, _Line] = {}
        self._running = 0

    def run(self, key: Hashable, client: str, deadline: float, compile_: Callable[[], Any]) -> Any:
        """Return what ``compile_()`` returns, run on the pool in ``client``'s line, or by a
        compile of the same ``key`` already under way.

        Args:
            key: what makes two compiles the same (the tenant and the constraint's canonical JSON).
            client: the asking client's identity.
            deadline: ``perf_counter`` time by which to give up waiting.
            compile_: the compile; it must not raise (a refusal is a value).

        Raises:
            TimeoutError: ``deadline`` passed first (the compile goes on).
        """
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job()
            gevent.spawn(self._run, key, job, client, compile_)
        job.waiters += 1
        try:
            return job.outcome.get(timeout=max(0.0, deadline - time.perf_counter()))
        except gevent.Timeout:
            raise TimeoutError("the deadline passed while the constraint compiled") from None
        finally:
            job.waiters -= 1

    def _run(self, key: Hashable, job: _Job, client: str, compile_: Callable[[], Any]) -> None:
        """Wait for ``client``'s turn, run the compile on the pool (unless nobody waits for it
        any more), hand its outcome to the waiters."""
        line = self._lines.get(client)
        if line is None:
            line = self._lines[client] = _Line()
        line.users += 1
        try:
            with line.turn:
                outcome = None  # nobody waits: dropped
                if job.waiters:
                    if self._pool is None:
                        self._pool = ThreadPool(self._threads)
                    self._running += 1
                    try:
                        outcome = self._pool.apply(compile_)
                    finally:
                        self._running -= 1
            job.outcome.set(outcome)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            job.outcome.set_exception(exc)
        finally:
            del self._jobs[key]
            line.users -= 1
            if not line.users:
                del self._lines[client]

    def state(self) -> dict[str, int]:
        """Return the compiles under way (``compiles_running`` on the pool, ``compiles_queued``
        in their clients' lines) and the requests waiting for them (``compile_waiters``)."""
        return {
            "compiles_running": self._running,
            "compiles_queued": len(self._jobs) - self._running,
            "compile_waiters": sum(job.waiters for job in self._jobs.values()),
        }
