"""The pacer of one generating request: what runs between its tokens.

One :class:`Pacer` per request, called after every generated token (and told about engine ticks and
long slices of work): it stamps the token times, enforces the request's and the worker's deadlines,
notices a non-streamed request's vanished client, and gives the gevent hub a turn
(:class:`~wsgi_app.server.hubturn.HubTurn`) once the request has run for its slice.
"""

from __future__ import annotations

import logging
import math
import time
import typing
from typing import NoReturn

import gevent

from wsgi_app.api.errors import ApiError, timeout_error, unavailable
from wsgi_app.generation.record import RequestRecord
from wsgi_app.server.connection import peer_closed
from wsgi_app.server.end_reason import DEADLINE, SHUTDOWN
from wsgi_app.server.hubturn import HubTurn

if typing.TYPE_CHECKING:
    import socket

    from wsgi_app.generation.admission import Admission
    from wsgi_app.generation.context import StopClock

# The bigram engine runs inline in the request's greenlet: give the hub a turn at least this often, so
# one fast stream never holds the other connections (and /healthz) for more than about a millisecond.
HUB_SLICE_S = 0.0005
# Streams yield with a HubTurn (wsgi_app/server/hubturn.py), which queues them in order and resumes them
# between the hub's I/O polls, a millisecond's worth at a time (hubturn.POLL_S): new connections,
# /healthz probes and other I/O wait at most about that long per step, however many streams run. So
# that a round of all the streams (each one's inter-token gap) stays near HUB_ROUND_S, the slice shrinks
# to HUB_ROUND_S divided by the busy slots (down to one token). Chosen with bench/ (README,
# Performance): at 128 streams a 20 ms round gives ~12 % more tokens/s than 10 ms.
HUB_ROUND_S = 0.02
PEER_CHECK_S = (
    0.1  # how often a generating non-streamed request looks for a vanished client, seconds
)


def hub_slice(busy: int) -> float:
    """Return how long (seconds) one stream may run before yielding the hub, with ``busy`` slots in use."""
    return min(HUB_SLICE_S, HUB_ROUND_S / busy) if busy > 0 else HUB_SLICE_S


step_log = logging.getLogger("greenserve.step")


class ClientGone(Exception):
    """The client closed its connection while a non-streamed answer was being generated."""


class Pacer:
    """The pacer of one request. Called after every generated token: stamps its time, enforces the
    request's deadline and the shutdown deadline, and yields the gevent hub a turn
    (:class:`~wsgi_app.server.hubturn.HubTurn`: pending I/O and new requests first) once this greenlet has
    run for its slice (:func:`hub_slice`: ``HUB_SLICE_S``, less when many streams run). Every
    token's ``perf_counter`` is appended to ``record.token_times`` (8 bytes a token); TTFT and the
    inter-token statistics are computed from it once, when the request ends.

    The common path costs one ``perf_counter`` read, one array append and three comparisons.
    :meth:`tick` is for an engine tick (no token yet), :meth:`pause` for a break between slices of a
    long piece of work that is not a token (scoring or encoding a huge prompt).

    Args:
        record: the request's record (its token times; its ``end_reason`` when a deadline ends it).
        deadline: ``perf_counter`` time at which the request times out, seconds.
        stop: the worker's stop clock.
        admission: the worker's slots (their number in use sizes the slice).
        timeout_s: ``REQUEST_TIMEOUT_S``, for the 504's message.

    Raises:
        ApiError: 504 ``timeout`` past the deadline; 503 ``unavailable`` when the worker is stopping.
    """

    __slots__ = (
        "_stop",
        "_admission",
        "_timeout_s",
        "_record",
        "_times",
        "deadline",
        "_since",
        "_slice",
        "_turn",
        "peer",
        "_peer_seen",
        "stream_peer",
    )

    def __init__(
        self,
        record: RequestRecord,
        deadline: float,
        stop: StopClock,
        admission: Admission,
        timeout_s: float,
    ) -> None:
        self._stop = stop
        self._admission = admission
        self._timeout_s = timeout_s
        self._record = record
        self._times = record.token_times
        self.deadline = deadline
        self._since = time.perf_counter()
        self._slice = hub_slice(admission.busy)
        self._turn = HubTurn()
        # A non-streamed answer writes nothing until its end: its view sets ``peer`` so that a client
        # that left is noticed (every PEER_CHECK_S) rather than generated for in vain.
        self.peer: socket.socket | None = None
        self._peer_seen = self._since
        # A stream's connection, looked at on every tick: once its client's end closed, the stream
        # writes at once. A client that left answers that write with a reset and the next write
        # fails, ending the stream; one that only half-closed reads it (docs/ARCHITECTURE.md §9).
        self.stream_peer: socket.socket | None = None

    @staticmethod
    def make(
        record: RequestRecord,
        deadline: float,
        stop: StopClock,
        admission: Admission,
        timeout_s: float,
    ) -> Pacer:
        """Return a :class:`Pacer`, or a :class:`DebugPacer` when ``LOG_LEVEL=debug`` (the
        arguments are the :class:`Pacer`'s)."""
        cls = DebugPacer if step_log.isEnabledFor(logging.DEBUG) else Pacer
        return cls(record, deadline, stop, admission, timeout_s)

    def __call__(self) -> None:
        now = time.perf_counter()
        self._times.append(now)
        if now >= self.deadline or self._stop.stop_at is not None:
            self.check(now)
        if now - self._since >= self._slice:
            self._turn()
            self._since = time.perf_counter()
            self._slice = hub_slice(self._admission.busy)
            if self.peer is not None:
                self._check_peer(self._since)

    def start_stream(self, sock: socket.socket | None) -> None:
        """Mark this request a stream on ``sock`` (looked at on every tick, see ``stream_peer``),
        and make it give the hub a turn right after its first token. Each stream's set-up (head parse,
        validation, admission, the first write) runs in one go; a burst of new connections therefore
        queues behind every earlier one's set-up, and without this turn also behind its first slice
        of tokens: the burst's last first token came ~(set-up + slice) x burst late instead of
        ~set-up x burst (docs/ARCHITECTURE.md §4)."""
        self.stream_peer = sock
        self._since = -math.inf

    def tick(self) -> bool:
        """Called while the engine has no token yet (a tick): enforce the deadlines, and notice a
        vanished client of a non-streamed answer.

        Returns:
            True when the client of the stream's connection (``stream_peer``) closed its end or
            reset it: the caller writes now (a FIN alone never ends a stream; a failed write does).

        Raises:
            ClientGone: a non-streamed answer's client closed its end (``peer``).
            ApiError: as :meth:`check`.
        """
        now = time.perf_counter()
        self.check(now)
        if self.peer is not None:
            self._check_peer(now)
        return peer_closed(self.stream_peer)

    @staticmethod
    def pause() -> None:
        """Let other greenlets (and ``/healthz``) run between slices of a long piece of work."""
        gevent.sleep(0)

    def _check_peer(self, now: float) -> None:
        if now - self._peer_seen >= PEER_CHECK_S:
            self._peer_seen = now
            if peer_closed(self.peer):
                raise ClientGone("client disconnected while generating")

    def check(self, now: float) -> None:
        """Raise if the request's deadline or the worker's stop time has passed at ``now``, and
        record that as the request's ``end_reason`` (``deadline``, ``shutdown``)."""
        if now >= self.deadline:
            self._record.end(DEADLINE)
            raise timeout_error(self._timeout_s)
        if self._stop.passed(now):
            self._record.end(SHUTDOWN)
            raise unavailable("Server is shutting down; generation was ended early.")

    def unreachable(self) -> NoReturn:
        """End a queued request whose deadline can no longer be met (``end_reason`` ``deadline``).

        Raises:
            ApiError: always, the 504 ``timeout`` saying why it ends before its deadline.
        """
        self._record.end(DEADLINE)
        raise ApiError(
            504,
            f"Request cannot finish within {self._timeout_s:g} s (REQUEST_TIMEOUT_S): it waited "
            "for a slot until its 'max_tokens' no longer fit before its deadline at this server's "
            "decode pace (DECODE_TOKENS_PER_S); retry later or with a lower 'max_tokens'.",
            type="server_error",
            code="timeout",
        )

    def time_left_s(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`check` raises (the deadline or the worker's stop time)."""
        stop_at = self._stop.stop_at
        return (self.deadline if stop_at is None else min(self.deadline, stop_at)) - now


class DebugPacer(Pacer):
    """A :class:`Pacer` that also logs one debug line per generated token (``LOG_LEVEL=debug``):
    the request id, the token's index over all choices, its time since arrival and the gap before it.
    No text: token texts are for ``LOG_PROMPTS=1`` and the request line only."""

    __slots__ = ()

    def __call__(self) -> None:
        super().__call__()
        times, record = self._times, self._record
        n = len(times)
        step_log.debug(
            "step",
            extra={
                "request_id": record.request_id,
                "step": n,
                "t_s": round(times[-1] - record.started, 6),
                "gap_s": round(times[-1] - times[-2], 6) if n > 1 else None,
            },
        )


class Unpaced:
    """A pacer that stamps nothing and never stops a request: for driving a
    :class:`~wsgi_app.generation.completion.Completion` by hand (benchmarks, tests)."""

    __slots__ = ()

    def __call__(self) -> None:
        """Do nothing after a token."""

    def tick(self) -> bool:
        """Do nothing on an engine tick (and never ask for a write)."""
        return False

    pause = staticmethod(Pacer.pause)
