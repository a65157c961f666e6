"""Shadow variants: a sampled copy of a model's answered requests, generated again on another
variant's engine while the worker's clients leave it idle, and its tokens compared with the
primary's (no Flask).

A request that the model's primary variant answered in full (every choice ended on its own) and
that :meth:`~wsgi_app.generation.registry.ModelRegistry.mirrored` sampled for a shadow becomes a
:class:`ShadowJob`: the same choices (``completion.choice_request``: the prompt's ids, sampling,
the effective seed on stream ``54 + i``, ``ignore_eos``, the cache salt, the primary's compiled
grammar; no logprobs, as only ids are compared), each to be compared with the ids the primary
generated (``choice.TokenTrace``) up to their count. Only the generation is repeated: a shadow
sends nothing, stores nothing, takes no slot, counts in no client's usage, rate limit, request
metrics or access log.

Priority: the lowest. One :class:`ShadowRunner` per worker runs one job at a time on one greenlet,
and starts one only once no admission of the worker (every model and variant) has had a request
running or queued for :data:`QUIET_S`. A client's request admitted meanwhile preempts it: the runner
hears of every admission (:meth:`ShadowRunner.on_load`) and drops the job at its next token or
engine tick (a bigram token is microseconds; a SmolLM2 decode step, ~12 ms; a tick,
``ThreadedEngine``'s 0.25 s during a long prefill). At most :data:`QUEUE_BOUND` jobs wait; past
it a job is dropped. A job whose engine fails is dropped too, and that engine's failure is its
own: ``/ready`` does not read a shadow's engine (``ModelRegistry.failed``).

Each job's outcome goes to the metrics (``greenserve_shadow_requests_total``,
``greenserve_shadow_dropped_total``, ``greenserve_shadow_first_divergence_tokens``), and each
diverged one to a log line.

Source: docs/ARCHITECTURE.md §12 (several models: shadow variants).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gevent
from gevent.event import Event

from model.engine import GenerationRequest, Step
from model.grammar.compile import RequestGrammar
from model.loader import can_ever_fit
from telemetry.metrics import Metrics
from wsgi_app.generation.choice import TokenTrace
from wsgi_app.generation.completion import choice_request
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.registry import ServedModel
from wsgi_app.generation.shadow_check import ChoiceCheck

log = logging.getLogger("greenserve.shadow")

QUEUE_BOUND = 8  # jobs waiting per worker; a job past it is dropped (queue_full)
# How long every admission must have been idle before a job starts, seconds: a closed loop's
# clients send their next request within milliseconds of an answer, and a job started in that gap
# would be preempted at once, having cost their first step the shadow's step then in flight.
QUIET_S = 0.05
EXACT, DIVERGED, DROPPED = "exact", "diverged", "dropped"
_END = object()  # what next() gives for a stream that has ended


class Dropped(Exception):
    """A shadow job ends without a comparison; ``reason``: ``queue_full``, ``preempted``,
    ``failed`` or ``shutdown``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ShadowJob:
    """One mirrored request, for one shadow variant.

    Attributes:
        request_id: the client request's id (the log line names it).
        target: the shadow variant that generates it.
        requests: one engine request per choice, in the answer's order.
        traces: the primary's ids per choice, in the same order.
        kv_bytes: the KV-cache bytes its choices may hold on the target's engine.
    """

    request_id: str
    target: ServedModel
    requests: tuple[GenerationRequest, ...]
    traces: tuple[TokenTrace, ...]
    kv_bytes: int


class Mirror:
    """The shadow variants a request is mirrored to, and what their jobs need of it; made before
    the request is admitted, submitted by its first settle once answered in full
    (``lifetime.Generation.settle``).

    Args:
        runner: the worker's :class:`ShadowRunner`.
        request_id: the request's id.
        targets: the shadow variants that mirror it (``ModelRegistry.mirrored``).
        req: its generation input.
        seed: its effective seed (an unseeded request's drawn one).
        cache_salt: its prefix-cache salt.
        grammar: its use of the compiled output constraint (a shadow's vocabulary is the
            primary's, ``wsgi_app.model_set.same_vocabulary``; each job gets its own use,
            ``RequestGrammar.again``, charged apart), or None.
    """

    __slots__ = ("runner", "request_id", "targets", "req", "seed", "cache_salt", "grammar")

    def __init__(
        self,
        runner: ShadowRunner,
        request_id: str,
        targets: Sequence[ServedModel],
        req: GenerationInput,
        seed: int,
        cache_salt: str = "",
        grammar: RequestGrammar | None = None,
    ) -> None:
        self.runner = runner
        self.request_id = request_id
        self.targets = tuple(targets)
        self.req = req
        self.seed = seed
        self.cache_salt = cache_salt
        self.grammar = grammar

    def submit(self, traces: Sequence[TokenTrace]) -> None:
        """Queue one job per shadow variant, ``traces`` being the primary's ids per choice; none
        when the primary generated no token (``max_tokens`` 0: nothing to compare)."""
        if not any(trace.token_ids for trace in traces):
            return
        req = self.req
        for target in self.targets:
            # Each job its own use of the grammar: its masks charged to a budget of its own.
            grammar = None if self.grammar is None else self.grammar.again()
            requests = tuple(
                dataclasses.replace(
                    choice_request(req, prompt, i, self.seed, grammar, self.cache_salt),
                    logprobs=None,
                )
                for prompt in req.prompts
                for i in range(req.n)
            )
            kv_bytes = sum(
                target.model.kv_reservation_bytes(len(p.ids), req.max_tokens, req.n)
                for p in req.prompts
            )
            job = ShadowJob(self.request_id, target, requests, tuple(traces), kv_bytes)
            self.runner.submit(job)


class ShadowRunner:
    """A worker's shadow jobs: a bounded queue and one greenlet that runs them, one at a time, only
    while the worker's clients leave it idle (for :data:`QUIET_S` before a job starts).

    Args:
        idle: True when no admission of the worker has a request running or queued
            (``Runtime.idle``).
        metrics: the worker's metrics (``Metrics.count_shadow``), or None.
        targets: every shadow variant of the worker (their series start at 0).
        bound: the most jobs that wait (:data:`QUEUE_BOUND`).
        quiet_s: how long the worker must have been idle before a job starts, seconds.

    Attributes:
        running: the job being generated, or None.
        stopping: set by :meth:`stop`: nothing more runs.
    """

    def __init__(
        self,
        idle: Callable[[], bool],
        metrics: Metrics | None = None,
        targets: Sequence[ServedModel] = (),
        bound: int = QUEUE_BOUND,
        quiet_s: float = QUIET_S,
    ) -> None:
        self._idle = idle
        self._metrics = metrics
        self.bound = bound
        self.quiet_s = quiet_s
        self._changed_at = 0.0  # perf_counter of the last admission or release
        self._pending: deque[ShadowJob] = deque()
        self._wake = Event()
        self._greenlet: gevent.Greenlet | None = None
        self._preempted = False
        self.running: ShadowJob | None = None
        self.stopping = False
        if metrics is not None:
            for target in targets:
                metrics.add_shadow(target.name, target.variant)

    def mirror(
        self,
        targets: Sequence[ServedModel],
        request_id: str,
        req: GenerationInput,
        seed: int,
        cache_salt: str = "",
        grammar: RequestGrammar | None = None,
    ) -> Mirror | None:
        """Return the :class:`Mirror` of a request for ``targets``, or None for no target (or a
        stopping worker)."""
        if not targets or self.stopping:
            return None
        return Mirror(self, request_id, targets, req, seed, cache_salt, grammar)

    def submit(self, job: ShadowJob) -> None:
        """Queue ``job``; past :attr:`bound` waiting jobs (or once stopping) it is dropped and
        counted."""
        if self.stopping:
            self._count(job, DROPPED, "shutdown")
            return
        if len(self._pending) >= self.bound:
            self._count(job, DROPPED, "queue_full")
            return
        self._pending.append(job)
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._loop)
        self._wake.set()

    def on_load(self) -> None:
        """An admission of the worker changed (a request came, got a slot or left): a client's
        request preempts the running job; an idle worker starts the next one. Called on every
        admission and release of every model (the worker's load hook), so it does little."""
        self._changed_at = time.perf_counter()
        if self.running is not None:
            if not self._idle():
                self._preempted = True
        elif self._pending and self._idle():
            self._wake.set()

    def stop(self) -> None:
        """The worker is stopping: drop the waiting jobs (counted, ``shutdown``) and the running
        one at its next token."""
        self.stopping = True
        while self._pending:
            self._count(self._pending.popleft(), DROPPED, "shutdown")
        self._wake.set()

    def state(self) -> dict[str, Any]:
        """Return the queue and the running job (for ``/debug/state``)."""
        running = self.running
        return {
            "pending": len(self._pending),
            "bound": self.bound,
            "running": None
            if running is None
            else {
                "request_id": running.request_id,
                "model": running.target.name,
                "variant": running.target.variant,
            },
        }

    # -- the runner's greenlet ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping:
            self._wake.clear()
            if self._pending and self._idle():
                wait_s = self._changed_at + self.quiet_s - time.perf_counter()
                if wait_s <= 0:
                    self._execute(self._pending.popleft())
                else:  # idle, but only just: look again once it has been for quiet_s
                    self._wake.wait(wait_s)
                continue
            self._wake.wait()

    def _execute(self, job: ShadowJob) -> None:
        """Run ``job`` and count how it ended (never raises: a shadow harms no client)."""
        self.running, self._preempted = job, False
        try:
            checks = self._generate(job)
        except Dropped as exc:
            self._count(job, DROPPED, exc.reason)
            return
        except Exception as exc:  # noqa: BLE001 - the shadow's failure is its own
            log.warning(
                "shadow %s/%s of request %s failed: %s: %s",
                job.target.name,
                job.target.variant,
                job.request_id,
                type(exc).__name__,
                exc,
            )
            self._count(job, DROPPED, "failed")
            return
        finally:
            self.running = None
        diverged = [c.divergence for c in checks if c.divergence is not None]
        if not diverged:
            self._count(job, EXACT)
            return
        first = diverged[0]
        log.info(
            "shadow diverged",
            extra={
                "request_id": job.request_id,
                "model": job.target.name,
                "variant": job.target.variant,
                "choice": first.choice,
                "position": first.position,
                "primary_token": first.primary_token,
                "shadow_token": first.shadow_token,
                "choices_diverged": len(diverged),
            },
        )
        self._count(job, DIVERGED, positions=[d.position for d in diverged])

    def _check(self) -> None:
        """Raise :class:`Dropped` once the job must give way: a client's request was admitted
        since it started (or one runs now), or the worker is stopping."""
        if self.stopping:
            raise Dropped("shutdown")
        if self._preempted or not self._idle():
            raise Dropped("preempted")

    def _generate(self, job: ShadowJob) -> list[ChoiceCheck]:
        """Generate ``job``'s choices round-robin (a batching engine has them all in flight) up to
        the primary's counts, comparing as they come; return the checks.

        The target's prefix cache is given the room the job's KV reservation leaves (the job takes
        no admission ticket: it counts as no client's request), and its room back afterwards.

        Raises:
            Dropped: preempted, or the worker stopping.
            ValueError: the job's KV reservation is more than the target's whole budget (its
                model's cache per token may be larger than the primary's), or the target's engine
                refuses a request (its context is shorter than the primary's).
            Exception: whatever else the target's engine raises.
        """
        ctx = job.target.generation
        admission, engine = ctx.admission, ctx.engine
        if not can_ever_fit(job.kv_bytes, admission.kv_budget_bytes):
            raise ValueError(
                f"its KV reservation of {job.kv_bytes} bytes is over the shadow's budget of "
                f"{admission.kv_budget_bytes} bytes (KV_CACHE_BUDGET_MB)"
            )
        checks = [
            ChoiceCheck(i, trace, req.max_tokens)
            for i, (trace, req) in enumerate(zip(job.traces, job.requests, strict=True))
        ]
        cache = engine.prefix_cache
        if cache is not None:
            cache.set_room(admission.kv_budget_bytes - admission.kv_reserved - job.kv_bytes)
        streams: list[Iterator[Step | None]] = []
        try:
            streams += [engine.stream(req) for req in job.requests]
            live = [c for c in checks if not c.done]
            while live:
                for check in live:
                    self._check()
                    step = next(streams[check.index], _END)
                    if step is _END:
                        check.end()
                    elif step is not None:  # None: an engine tick, no token yet
                        check.feed(step)
                    if check.done:  # decided: the engine stops its work now
                        streams[check.index].close()
                    gevent.sleep(0)  # an inline engine computed a token on this greenlet
                live = [c for c in live if not c.done]
            return checks
        finally:
            for stream in streams:
                stream.close()
            if cache is not None:
                cache.set_room(admission.kv_budget_bytes - admission.kv_reserved)

    def _count(
        self,
        job: ShadowJob,
        outcome: str,
        reason: str | None = None,
        positions: Sequence[int] = (),
    ) -> None:
        if self._metrics is not None:
            self._metrics.count_shadow(
                job.target.name, job.target.variant, outcome, reason, positions
            )
