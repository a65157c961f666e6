"""Give the gevent hub a turn from a generating greenlet: pending I/O first, and no starvation.

``gevent.sleep(0)`` queues the greenlet behind every other runnable greenlet, so a new connection (a
``/healthz`` probe, the next request's first token) waits for a full round of all running streams.
``gevent.idle()`` instead resumes the greenlet when the loop has nothing else pending; but libev runs
every pending idle watcher in one go (the hub then polls for I/O once per round of all the streams), and
an idle watcher never runs while every loop iteration has some event pending: under a closed loop of
short requests the streams starved, then a catch-up timer ran a whole round at once, and new
connections waited 50-100 ms (measured with ``bench.run``).

A new connection's set-up (its head parse, the app until the first write: ~0.5-1 ms) would otherwise
run in the hub's callback phase, where gevent starts every spawned greenlet and checks the time only
every 50 callbacks: under churn a few dozen set-ups ran back to back between two polls, and a probe
accepted meanwhile waited for all of them. :func:`setup_turn` queues such a greenlet in the same
watcher's queue of arrivals, served first in each pass for up to ``SETUP_SHARE_S``: a new request's set-up
still goes ahead of the streams' tokens (its TTFT), the hub polls between passes, and the streams still
get at least ``poll_s`` of every pass however many connections arrive (and only that while arrivals
still wait: a burst of 128 new connections otherwise waited for up to ``MAX_SHARE_S`` of tokens a pass).

:class:`HubTurn` puts the greenlet in one FIFO queue per hub, served by a *check* watcher, which libev
runs once in every loop iteration right after the I/O poll and its callbacks, whether or not events
were pending: each iteration resumes waiting streams, in order (each runs its slice and queues again),
for ``poll_s`` or for as long as the rest of that iteration took, whichever is longer (up to
``MAX_SHARE_S``), then the loop polls again. An active no-op idle watcher keeps that poll from blocking
while streams wait. So a new connection or a probe waits about ``poll_s`` per step of its own work
(accept, read, write), however many streams run; and under a flood of other work the streams still
get half of the core, never starved.

Source: libev documentation, "ev_check" (invoked after the loop has gathered new events, every
iteration) and "ev_idle" (while active, the loop polls without blocking); gevent's ``loop.check``,
``loop.idle`` and ``Waiter`` (switched from the hub).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

from gevent.hub import Waiter, get_hub

# The longest the hub resumes waiting streams before it polls for I/O again, seconds: what each step of
# a new connection or a /healthz probe waits for at most (plus its own work), however many streams run.
POLL_S = 0.001
# The most the streams are given in one pass when the rest of an iteration took long, seconds.
MAX_SHARE_S = 0.01
# The most the arrivals' set-ups are given in one pass, seconds: with the streams' POLL_S after them,
# the longest a probe's accept waits for the hub while connections keep arriving (~6 ms; 10 ms
# measured /healthz p99 at 27 ms beside 50 JSON clients, 5 ms at 11 ms: bench/churn_sseload.py).
SETUP_SHARE_S = 0.005


def _nothing() -> None:
    """The idle watcher's callback: its being active is what matters (a non-blocking poll)."""


class _Turns:
    """The greenlets of one hub waiting for a turn, resumed in FIFO order, ``poll_s`` at a time:
    arrivals (connections about to be set up) before the rest."""

    def __init__(self, hub: Any, poll_s: float) -> None:
        self.poll_s = poll_s
        self.arriving: deque[Waiter] = deque()
        self.waiting: deque[Waiter] = deque()
        self.hub = hub
        self.check = hub.loop.check()
        self.idle = hub.loop.idle()
        self.last_end = 0.0  # perf_counter when the last pass ended

    def wait(self, arriving: bool = False) -> None:
        """Queue the current greenlet (with the arrivals when ``arriving``); return when the hub
        resumes it."""
        waiter = Waiter(self.hub)
        queue = self.arriving if arriving else self.waiting
        queue.append(waiter)
        if not self.check.active:  # the first to wait starts the watchers
            self.check.start(self._resume)
            self.idle.start(_nothing)
            self.last_end = time.perf_counter()
        try:
            waiter.get()
        except BaseException:  # killed or timed out while waiting: leave the queue
            try:
                queue.remove(waiter)
            except ValueError:
                pass
            if not self.arriving and not self.waiting:
                self._stop()
            raise

    def _resume(self) -> None:
        """Resume waiting greenlets (in the hub): the arrivals for up to ``SETUP_SHARE_S``, then the
        streams for their share of the iteration (see the module docstring); stop the watchers when
        none is left waiting."""
        start = time.perf_counter()
        rest = start - self.last_end  # the poll and its callbacks since the last pass
        # Only those waiting now: a greenlet that queues again during this pass waits for the next.
        _serve(self.arriving, start + SETUP_SHARE_S)
        now = time.perf_counter()
        # The streams get at least poll_s whatever the set-ups took: never starved by arrivals; while
        # arrivals still wait, only that, so a burst's last first token is not held by the streams.
        share = self.poll_s if self.arriving else min(max(self.poll_s, rest), MAX_SHARE_S)
        _serve(self.waiting, now + share)
        self.last_end = time.perf_counter()
        if not self.arriving and not self.waiting:
            self._stop()

    def _stop(self) -> None:
        self.check.stop()
        self.idle.stop()


def _serve(queue: deque[Waiter], until: float) -> None:
    """Resume the greenlets queued now, in order, until ``until`` (``perf_counter`` seconds) has
    passed (at least one)."""
    for _ in range(len(queue)):
        queue.popleft().switch(None)  # returns when that greenlet gives the hub back
        if time.perf_counter() >= until:
            return


_TURNS: weakref.WeakKeyDictionary[Any, dict[float, _Turns]] = weakref.WeakKeyDictionary()


class HubTurn:
    """Yield the current greenlet until the hub has polled for I/O and served what was pending.

    Turns of all the greenlets of a hub that use the same ``poll_s`` are served from one FIFO queue
    (see the module docstring): a turn comes back after one round of the other waiting greenlets, and
    the hub polls for I/O at least every ``poll_s`` meanwhile.

    Args:
        poll_s: the longest the hub resumes waiting greenlets before it polls for I/O, seconds.
    """

    __slots__ = ("poll_s", "_turns")

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self._turns: _Turns | None = None

    def __call__(self) -> None:
        """Switch to the hub; return when this greenlet's turn comes."""
        turns = self._turns
        if turns is None:
            turns = self._turns = _turns_of(get_hub(), self.poll_s)
        turns.wait()


def _turns_of(hub: Any, poll_s: float) -> _Turns:
    """Return the hub's queues of turns for ``poll_s`` (made on first use)."""
    per_hub = _TURNS.setdefault(hub, {})
    turns = per_hub.get(poll_s)
    if turns is None:
        turns = per_hub[poll_s] = _Turns(hub, poll_s)
    return turns


def setup_turn(poll_s: float = POLL_S) -> None:
    r"""Wait for the hub's next pass over the waiting greenlets, ahead of those that generate.

    Called by a new connection's greenlet before it is set up (see the module docstring): returns
    after the hub has polled for I/O once more, at the front of that pass.

    Args:
        poll_s: the queues' ``poll_s`` (the streams' :class:`HubTurn`\ s use :data:`POLL_S`).
    """
    _turns_of(get_hub(), poll_s).wait(arriving=True)
