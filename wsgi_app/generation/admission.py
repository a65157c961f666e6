"""Admission control: a bounded number of generation slots per worker and a bounded wait queue.

A request either gets a slot at once, waits in the queue, or is refused with ``429 server_busy`` and a
``Retry-After`` computed from the observed service time. What a release frees is handed straight to the
waiters, so nobody races for it. Every ticket is released exactly once, whatever path the request takes
(finished, disconnected, timed out, failed, shut down).

A request also reserves the KV-cache bytes its sequences may hold (``KV_CACHE_BUDGET_MB``, see
:meth:`model.loader.LoadedModel.kv_reservation_bytes`): it runs only when a slot and its bytes are both
free, and one that could not fit even in an idle worker is a 400. **Order: first fit in arrival order.**
Freed room goes to the oldest waiter it fits; a waiter whose bytes are not free yet (a long prompt) is
passed by later ones that fit beside the running requests (a short chat), so short requests are never
held behind long ones. A passed waiter keeps its place: it runs as soon as its bytes are free, before
any later request that needs them; its deadline bounds its wait (with ``DECODE_TOKENS_PER_S`` set it
leaves the queue once its deadline is unreachable: ``lifetime.queue_heartbeats``). The default slots
and queue are the model family's (:meth:`model.engine.Family.limits`).

Source: docs/ARCHITECTURE.md §9 (admission and stream lifetime).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gevent.event import Event

from model.loader import can_ever_fit
from wsgi_app.api.errors import ApiError, invalid

QUEUED, RUNNING, RELEASED = "queued", "running", "released"
_EWMA_ALPHA = 0.2  # weight of the newest slot-hold time in the service-time estimate


class Ticket:
    """One request's claim on a slot.

    Attributes:
        request_id: the request's id (for ``/debug/state``).
        state: ``queued``, ``running`` or ``released``.
        arrived: ``perf_counter`` at admission, in seconds.
        deadline: ``perf_counter`` value after which the request times out, in seconds.
        started: ``perf_counter`` when the slot was granted, or None.
        progress: an object with ``completion_tokens`` (the live completion), or None.
        kv_bytes: the KV-cache bytes reserved while running.
        latest_start: ``perf_counter`` value after which the request can no longer finish before
            its deadline even at the operator's decode pace (``DECODE_TOKENS_PER_S``), in seconds;
            None when no pace is set (it then waits until its deadline).
    """

    __slots__ = (
        "_admission",
        "request_id",
        "kv_bytes",
        "state",
        "arrived",
        "deadline",
        "started",
        "progress",
        "latest_start",
        "_granted",
    )

    def __init__(
        self, admission: Admission, request_id: str, deadline: float, kv_bytes: int = 0
    ) -> None:
        self._admission = admission
        self.request_id = request_id
        self.kv_bytes = kv_bytes
        self.state = QUEUED
        self.arrived = time.perf_counter()
        self.deadline = deadline
        self.started: float | None = None
        self.progress: Any = None
        self.latest_start: float | None = None
        self._granted = Event()

    @property
    def running(self) -> bool:
        """True once the ticket holds a slot."""
        return self.state == RUNNING

    def _grant(self) -> None:
        self.state = RUNNING
        self.started = time.perf_counter()
        self._granted.set()

    def wait(self, timeout_s: float) -> bool:
        """Block this greenlet until the slot is granted or ``timeout_s`` passes; True when granted."""
        if self.state == RUNNING:
            return True
        woken = self._granted.wait(max(0.0, timeout_s))
        if self.state == RUNNING:
            return True
        if woken:  # woken by Admission.wake_queued, not granted: the next wait waits again
            self._granted.clear()
        return False

    def release(self) -> None:
        """Give the slot (or the queue place) back; idempotent."""
        self._admission._release(self)


class Admission:
    """Slots and queue of one worker.

    Args:
        max_slots: concurrent generations (``MAX_SLOTS``).
        max_queue: requests allowed to wait (``MAX_QUEUE``).
        on_change: called with ``(busy slots, queued requests)`` after every admission and release
            (e.g. to set gauges); must not raise.
        kv_budget_bytes: KV-cache bytes the running requests may reserve together.
        on_room: called with the budget's bytes left unreserved after every change of the
            reservations (the engine's prefix cache fits itself into them, evicting, so a cached
            block never makes a request wait); must not raise.
    """

    def __init__(
        self,
        max_slots: int,
        max_queue: int,
        on_change: Callable[[int, int], None] | None = None,
        kv_budget_bytes: int = 1 << 62,
        on_room: Callable[[int], None] | None = None,
    ) -> None:
        self.on_room = on_room
        self.max_slots = max_slots
        self.max_queue = max_queue
        self.on_change = on_change
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_reserved = 0  # bytes reserved by running tickets
        self.busy = 0
        self._waiters: deque[Ticket] = deque()
        self.tickets: dict[int, Ticket] = {}  # id(ticket) -> ticket, everything not yet released
        self.service_s = 0.05  # EWMA of slot-hold time, seconds; a neutral start
        self.served = 0

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    def idle(self) -> bool:
        """True when no request is running or queued (every ticket released)."""
        return not self.tickets

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free for a new request: the queue ahead, drained at the
        observed throughput (``max_slots / service_s``), rounded up, at least 1."""
        wait = (len(self._waiters) + 1) * self.service_s / self.max_slots
        return max(1, math.ceil(wait))

    def admit(self, request_id: str, deadline: float, kv_bytes: int = 0) -> Ticket:
        """Return a ticket that is running (a free slot and ``kv_bytes`` of budget) or queued.

        Raises:
            ApiError: 400 (``param`` ``max_tokens``) when ``kv_bytes`` exceeds the whole budget; 429
                ``server_busy`` with ``Retry-After`` when the slots and the queue are full.
        """
        if not can_ever_fit(kv_bytes, self.kv_budget_bytes):
            raise invalid(
                f"This request may hold {_mib(kv_bytes)} MiB of KV cache (n x (prompt tokens + "
                "max_tokens), summed over its prompts), more than this server's budget of "
                f"{_mib(self.kv_budget_bytes)} MiB per worker. Reduce 'max_tokens', the prompts "
                "or 'n'.",
                "max_tokens",
            )
        ticket = Ticket(self, request_id, deadline, kv_bytes)
        if self._fits(ticket):  # every waiter already failed to fit: first fit runs it at once
            self._run(ticket)
        elif len(self._waiters) < self.max_queue:
            self._waiters.append(ticket)
        else:
            retry = self.retry_after_s()
            raise ApiError(
                429,
                f"Server busy: all {self.max_slots} generation slots are in use and "
                f"{len(self._waiters)} requests are queued; retry after {retry} s.",
                type="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(retry)},
            )
        self.tickets[id(ticket)] = ticket
        if self.on_change is not None:
            self.on_change(self.busy, len(self._waiters))
        return ticket

    def wake_queued(self) -> None:
        """End every queued request's current wait early, without a slot, so that its caller looks
        at the clock now (the worker's stop time has come: it answers 503 rather than waiting out a
        heartbeat)."""
        for ticket in self._waiters:
            ticket._granted.set()

    def _release(self, ticket: Ticket) -> None:
        if ticket.state == RELEASED:
            return
        if ticket.state == QUEUED:
            self._waiters.remove(ticket)
        else:
            held = time.perf_counter() - (ticket.started or ticket.arrived)
            self.service_s += _EWMA_ALPHA * (held - self.service_s)
            self.served += 1
            self.busy -= 1
            self.kv_reserved -= ticket.kv_bytes
            if self.on_room is not None:
                self.on_room(self.kv_budget_bytes - self.kv_reserved)
        # Hand what is free to the waiters in arrival order, each that fits (first fit).
        for waiter in list(self._waiters):
            if self.busy >= self.max_slots:
                break
            if self._fits(waiter):  # each run takes room: the next waiter is judged after it
                self._waiters.remove(waiter)
                self._run(waiter)
        ticket.state = RELEASED
        self.tickets.pop(id(ticket), None)
        if self.on_change is not None:
            self.on_change(self.busy, len(self._waiters))

    def _fits(self, ticket: Ticket) -> bool:
        return (
            self.busy < self.max_slots
            and self.kv_reserved + ticket.kv_bytes <= self.kv_budget_bytes
        )

    def _run(self, ticket: Ticket) -> None:
        self.busy += 1
        self.kv_reserved += ticket.kv_bytes
        if self.on_room is not None:  # before the grant: the engine sees the room first
            self.on_room(self.kv_budget_bytes - self.kv_reserved)
        ticket._grant()

    def state(self) -> dict[str, Any]:
        """Return slots, queue and every in-flight request (age, tokens, time to deadline, seconds)."""
        now = time.perf_counter()
        requests = []
        for t in self.tickets.values():
            requests.append(
                {
                    "request_id": t.request_id,
                    "state": t.state,
                    "age_s": round(now - t.arrived, 3),
                    "tokens": 0 if t.progress is None else t.progress.completion_tokens,
                    "deadline_in_s": round(t.deadline - now, 3),
                }
            )
        return {
            "slots": {"busy": self.busy, "total": self.max_slots},
            "queue": {"waiting": len(self._waiters), "max": self.max_queue},
            "kv_cache_bytes": {"reserved": self.kv_reserved, "budget": self.kv_budget_bytes},
            "service_time_s": round(self.service_s, 6),
            "requests": requests,
        }


def _mib(nbytes: int) -> str:
    """Return ``nbytes`` in MiB with one decimal."""
    return f"{nbytes / (1 << 20):.1f}"
