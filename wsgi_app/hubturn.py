"""Give the gevent hub a turn from a generating greenlet: pending I/O first, but never starve.

``gevent.sleep(0)`` queues the greenlet behind every other runnable greenlet, so a new connection (a
``/healthz`` probe, the next request's first token) waits for a full round of all running streams, and
the hub polls for I/O only every few milliseconds. ``gevent.idle()`` instead resumes the greenlet when
the loop has nothing else pending, so I/O and new requests go first, and the hub polls once per round;
but while new work keeps arriving (a closed loop of short requests) an idle watcher can wait for
seconds. :class:`HubTurn` waits for whichever comes first: the idle watcher, or a timer of
``max_wait_s``.

Source: libev documentation, "ev_idle" (invoked when no other events of the same or higher priority
are pending) and "ev_timer" (``ev_timer_again``); gevent's ``gevent.idle`` and ``Hub.wait``.
"""

from __future__ import annotations

from gevent.hub import Waiter, get_hub


class HubTurn:
    """Yield the current greenlet until the hub is idle, or at most ``max_wait_s`` seconds.

    One instance per greenlet (its watchers are reused for every turn, made on the first one).

    Args:
        max_wait_s: the longest a turn may wait while other work keeps the hub busy, seconds.
    """

    __slots__ = ("max_wait_s", "_hub", "_idle", "_timer")

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._hub = None
        self._idle = None
        self._timer = None

    def __call__(self) -> None:
        """Switch to the hub; return when this greenlet's turn comes."""
        if self._hub is None:
            self._hub = get_hub()
            self._idle = self._hub.loop.idle()
            # A repeating timer restarted with again(): libev's ev_timer_stop keeps only the time that
            # was left, so a plain start() of a reused timer would fire sooner after every early stop.
            self._timer = self._hub.loop.timer(self.max_wait_s, self.max_wait_s)
        waiter = Waiter(self._hub)
        self._idle.start(waiter.switch, None)
        self._timer.again(waiter.switch, None)
        try:
            waiter.get()
        finally:
            self._idle.stop()
            self._timer.stop()
