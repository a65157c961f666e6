"""Give the gevent hub a turn from a generating greenlet: pending I/O first, but never starve.

``gevent.sleep(0)`` queues the greenlet behind every other runnable greenlet, so a new connection (a
``/healthz`` probe, the next request's first token) waits for a full round of all running streams, and
the hub polls for I/O only every few milliseconds. ``gevent.idle()`` instead resumes the greenlet when
the loop has nothing else pending, so I/O and new requests go first; but libev runs every pending idle
watcher in one go, so the hub still polls for I/O only once per round of all the streams (20 ms at
128 streams, more with a thousand), and while new work keeps arriving (a closed loop of short
requests) an idle watcher can wait for seconds.

:class:`HubTurn` puts the greenlet in one FIFO queue per hub, which a single idle watcher serves a few
at a time: when the hub is idle it resumes waiting streams, in order, for at most ``poll_s`` (each
runs its slice and queues again), then lets the loop poll for I/O before the next ones. So a new
connection or a probe waits at most about ``poll_s`` for the hub, however many streams run, while the
streams still share the core round-robin. No stream waits much longer than ``max_wait_s``: once the
oldest has waited that long (the hub was too busy to go idle often enough), a timer resumes every
waiting stream.

Source: libev documentation, "ev_idle" (invoked when no other events of the same or higher priority
are pending) and "ev_timer"; gevent's ``gevent.idle``, ``Hub.wait`` and
``Waiter`` (switched from the hub).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

from gevent.hub import Waiter, get_hub

# The longest the hub resumes waiting streams before it polls for I/O again, seconds: what a new
# connection or a /healthz probe waits for at most (plus its own work), however many streams run.
POLL_S = 0.002


class _Turns:
    """The greenlets of one hub waiting for a turn, resumed in FIFO order, ``poll_s`` at a time."""

    def __init__(self, hub: Any, max_wait_s: float, poll_s: float) -> None:
        self.hub = hub
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self.waiting: deque[tuple[Waiter, float]] = deque()  # (waiter, perf_counter when queued)
        self.idle = hub.loop.idle()
        self.timer: Any = None

    def wait(self) -> None:
        """Queue the current greenlet; return when the hub resumes it."""
        entry = (Waiter(self.hub), time.perf_counter())
        self.waiting.append(entry)
        if not self.idle.active:  # the first to wait arms the watchers
            self.idle.start(self._on_idle)
            self._arm(self.max_wait_s)
        try:
            entry[0].get()
        except BaseException:  # killed or timed out while waiting: leave the queue
            try:
                self.waiting.remove(entry)
            except ValueError:
                pass
            if not self.waiting:
                self._stop()
            raise

    def _arm(self, after_s: float) -> None:
        """(Re)start the timer to fire in ``after_s`` seconds."""
        if self.timer is not None:
            self.timer.stop()
        self.timer = self.hub.loop.timer(max(after_s, 0.0))
        self.timer.start(self._on_timer)

    def _on_idle(self) -> None:
        self._resume(time.perf_counter() + self.poll_s)

    def _on_timer(self) -> None:
        # The oldest has waited max_wait_s (the hub never went idle meanwhile): a full round.
        self._resume(None)

    def _resume(self, until: float | None) -> None:
        """Resume waiting greenlets (in the hub) until ``until`` (``perf_counter``) or, with None,
        every one that waits now; then time the next forced round by the oldest still waiting."""
        waiting = self.waiting
        n = len(waiting) if until is None else -1
        while waiting and n != 0:
            n -= 1
            waiting.popleft()[0].switch(None)  # returns when that greenlet gives the hub back
            if until is not None and time.perf_counter() >= until:
                break
        if waiting:
            self._arm(waiting[0][1] + self.max_wait_s - time.perf_counter())
        else:
            self._stop()

    def _stop(self) -> None:
        self.idle.stop()
        if self.timer is not None:
            self.timer.stop()


_TURNS: weakref.WeakKeyDictionary[Any, dict[tuple[float, float], _Turns]] = (
    weakref.WeakKeyDictionary()
)


class HubTurn:
    """Yield the current greenlet until the hub has served pending I/O, or at most ``max_wait_s``.

    Turns of all the greenlets of a hub that use the same ``max_wait_s`` and ``poll_s`` are served
    from one FIFO queue (see the module docstring).

    Args:
        max_wait_s: the longest a turn may wait while other work keeps the hub busy, seconds.
        poll_s: the longest the hub resumes waiting greenlets before it polls for I/O, seconds.
    """

    __slots__ = ("max_wait_s", "poll_s", "_turns")

    def __init__(self, max_wait_s: float, poll_s: float = POLL_S) -> None:
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self._turns: _Turns | None = None

    def __call__(self) -> None:
        """Switch to the hub; return when this greenlet's turn comes."""
        turns = self._turns
        if turns is None:
            hub = get_hub()
            per_hub = _TURNS.setdefault(hub, {})
            key = (self.max_wait_s, self.poll_s)
            turns = per_hub.get(key)
            if turns is None:
                turns = per_hub[key] = _Turns(hub, self.max_wait_s, self.poll_s)
            self._turns = turns
        turns.wait()
