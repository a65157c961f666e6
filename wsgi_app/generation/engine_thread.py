"""The batching engine's native thread, and the gevent-safe channel between it and the request greenlets.

Transformer steps cost milliseconds of CPU; on the hub they would freeze every connection of the worker.
So one thread per worker runs the model's :class:`model.engine.Scheduler` (numpy releases the GIL in its
matrix products), and greenlets talk to it through plain deques: a submission and a cancellation flag one
way; Steps the other way, announced by a libev/libuv *async watcher*, the one gevent object that another
native thread may signal. Greenlets never block the hub: they wait on a per-stream gevent Event that the
watcher's callback (on the hub) sets.

The stream has the bigram engine's interface, plus heartbeat ticks: while its next token is not ready
after ``tick_s`` it yields ``None``, so the HTTP layer can check deadlines and write keep-alives (for
example during a long prefill, which runs in chunks and notices a cancellation within one chunk).

A step that raises fails every live sequence (each stream raises the step's exception: a ``500
engine_error``) and the thread goes on serving. :attr:`ThreadedEngine.failed` holds that exception,
and readiness is off, until a later step succeeds: a request's, or the engine's own check. While it
is failed and has nothing to do, the thread generates one greedy token of a one-token prompt
(:data:`SELF_CHECK`, its output dropped) every ``idle_s``, so an engine that works again says so
even when no request reaches it (a balancer sends none to a worker whose ``/ready`` answers 503).
No other hysteresis: one failed step turns readiness off, one good step turns it back on; a
balancer's own thresholds (Kubernetes' ``failureThreshold``) smooth what a single bad prompt does.

Source: docs/ARCHITECTURE.md §5, §15 (heavy numpy work off the hub); gevent docs, "Threads and
the hub" (async watchers are the safe cross-thread wakeup).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import gevent
from gevent.event import Event
from gevent.monkey import get_original
from gevent.threadpool import ThreadPool

from model.engine import (
    END,
    GenerationRequest,
    PrefixCacheView,
    ScheduledSequence,
    Scheduler,
    Step,
)
from model.sampling import SamplingParams
from wsgi_app.server.heap import HeapTrimmer

log = logging.getLogger("greenserve.engine")

# The real ones: under gevent's monkey-patching, threading would give us a greenlet.
_start_new_thread = get_original("_thread", "start_new_thread")
_allocate_lock = get_original("_thread", "allocate_lock")
# What a failed engine generates to find out whether it works again: one greedy token after id 0 (a
# valid prompt for every vocabulary), seed 0. Its handle is _CHECK, its output dropped.
SELF_CHECK = GenerationRequest((0,), 1, SamplingParams(temperature=0.0), 0)
_CHECK = object()


class _Stream:
    """Hub-side state of one sequence: delivered items and the Event its greenlet waits on."""

    __slots__ = ("items", "ready", "seq")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.ready = Event()
        self.seq: ScheduledSequence | None = None


class ThreadedEngine:
    """Continuous batching on one native thread per worker.

    Args:
        scheduler: the model's batch scheduler (``LoadedModel.make_scheduler``; owned by the engine
            thread from now on).
        tick_s: longest a stream waits for its next token before yielding a ``None`` tick, seconds.
        idle_s: how long the idle thread sleeps between looks at its inbox when nobody rings, seconds.
        on_idle: called on the engine thread each time the last sequence leaves; by default it
            returns the freed C heap to the system (rate-limited, see :mod:`wsgi_app.server.heap`), so
            an idle worker does not keep a burst's memory.
        on_speculated: called on the engine thread after a step that verified drafted tokens, with
            how many were drafted and how many accepted (the metrics' counters).
    """

    # What the engine's last step raised, None once a later one succeeded (model.engine.Engine):
    # written by the engine thread only, read from any (one attribute: the GIL keeps it whole).
    failed: BaseException | None = None

    def __init__(
        self,
        scheduler: Scheduler,
        tick_s: float = 0.25,
        idle_s: float = 1.0,
        on_idle: Callable[[], Any] | None = None,
        on_speculated: Callable[[int, int], None] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._on_speculated = on_speculated
        self._speculated = (0, 0)  # the speculator's counts last reported
        self._on_idle = HeapTrimmer() if on_idle is None else on_idle
        self._pending_trim = False
        self.tick_s = tick_s
        self._idle_s = idle_s
        self._inbox: deque[tuple[GenerationRequest, _Stream]] = deque()
        self._outbox: deque[tuple[_Stream, Any]] = deque()
        self._doorbell = _allocate_lock()
        self._doorbell.acquire()
        self._stopping = False
        self._watcher = gevent.get_hub().loop.async_()
        self._watcher.start(self._deliver)
        # Scoring (echo) is one prefill: run it on a dedicated native pool, not on the hub.
        self._score_pool = ThreadPool(1)
        self.failed = None
        self._checks_failed = 0  # since the last step that succeeded (the first one is logged)
        scheduler.validate(SELF_CHECK)
        _start_new_thread(self._run, ())

    # -- greenlet side --------------------------------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """The scheduler's prefix cache (``model.llama.serving.prefix_cache.PrefixCache``), or None."""
        return self._scheduler.prefix_cache

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one sequence may hold."""
        return self._scheduler.context_length

    def stream(self, req: GenerationRequest) -> Iterator[Step | None]:
        """Validate ``req`` now, then return a generator of its Steps (``None`` = still working).

        Closing the generator cancels the sequence; the engine thread drops it at its next step.

        Raises:
            ValueError: as ``LlamaEngine.stream`` (bad prompt, seed, ``max_tokens``, ``logprobs``).
        """
        self._scheduler.validate(req)
        return self._steps(req)

    def _steps(self, req: GenerationRequest) -> Iterator[Step | None]:
        stream = _Stream()
        self._inbox.append((req, stream))
        self._ring()
        try:
            while True:
                if not stream.items:
                    stream.ready.clear()
                    if not stream.ready.wait(self.tick_s):
                        yield None
                        continue
                item = stream.items.popleft()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if stream.seq is not None:
                stream.seq.cancelled = True  # one attribute write: safe across threads
            else:
                stream.items.append(END)  # not admitted yet: the thread skips it
            self._ring()

    def score(
        self, prompt_ids: Sequence[int], top_n: int, pause: Callable[[], None] | None = None
    ) -> list[Step]:
        """Score the prompt's tokens (for ``echo`` with ``logprobs``) on a native thread, a chunk
        at a time (``BatchScheduler.score_chunks``): the hub runs meanwhile, ``pause`` is called
        between chunks on the caller's greenlet (it raises to end the scoring: a deadline, a client
        that left), and other requests' chunks take their turns on the scoring thread."""
        chunks = self._scheduler.score_chunks(prompt_ids, top_n)
        steps: list[Step] = []
        while True:
            chunk = self._score_pool.apply(next, (chunks, None))
            if chunk is None:
                return steps
            steps += chunk
            if pause is not None:
                pause()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step."""
        self._stopping = True
        self._ring()

    def _ring(self) -> None:
        try:
            self._doorbell.release()
        except RuntimeError:  # already rung
            pass

    def _deliver(self) -> None:
        """On the hub: hand the engine thread's output to the waiting streams."""
        while self._outbox:
            stream, item = self._outbox.popleft()
            stream.items.append(item)
            stream.ready.set()

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self._scheduler
        while not self._stopping:
            scheduler.prune()  # a client that left frees its place before a newcomer asks for one
            while self._inbox:
                req, stream = self._inbox.popleft()
                if stream.items and stream.items[-1] is END:  # cancelled before it started
                    continue
                try:
                    stream.seq = scheduler.add(req, stream)
                except Exception as exc:  # noqa: BLE001 - reported to that stream
                    self._post(stream, exc)
            if scheduler.idle:
                if self._pending_trim:  # the last sequence just left (False: retry when idle)
                    self._pending_trim = self._on_idle() is False
                rung = self._doorbell.acquire(timeout=self._idle_s)
                if not rung and self.failed is not None and not self._inbox:
                    self._check()
                continue
            self._pending_trim = True
            try:
                touched = scheduler.step()
            except BaseException as exc:  # noqa: BLE001 - fail the live sequences, keep serving
                streams = [seq.handle for seq in scheduler.abort() if seq.handle is not _CHECK]
                if streams or self.failed is None:
                    log.exception("engine step failed: not ready until a step succeeds")
                elif not self._checks_failed:  # the first of the engine's own checks to fail
                    log.warning(
                        "engine self-check failed: still not ready (checked every %g s): %s: %s",
                        self._idle_s,
                        type(exc).__name__,
                        exc,
                    )
                self._checks_failed += not streams
                self.failed = exc
                for stream in streams:
                    self._post(stream, exc)
                continue
            if self.failed is not None:
                log.warning("engine recovered: a step succeeded after a failed one; ready again")
                self.failed = None
                self._checks_failed = 0
            for seq in touched:
                if seq.handle is _CHECK:
                    seq.steps.clear()
                    continue
                for item in seq.steps:
                    self._outbox.append((seq.handle, item))
                seq.steps.clear()
            self._watcher.send()
            self._report_speculation()

    def _check(self) -> None:
        """Start the engine's own check (:data:`SELF_CHECK`): its step is the next one."""
        try:
            self._scheduler.add(SELF_CHECK, _CHECK)
        except Exception:  # noqa: BLE001 - no room for it now: the next idle turn tries again
            log.debug("engine self-check not started", exc_info=True)

    def _report_speculation(self) -> None:
        now = self._scheduler.speculated
        if self._on_speculated is None or now == self._speculated:
            return
        (drafted, accepted), self._speculated = self._speculated, now
        self._on_speculated(now[0] - drafted, now[1] - accepted)

    def _post(self, stream: _Stream, item: Any) -> None:
        self._outbox.append((stream, item))
        self._watcher.send()
