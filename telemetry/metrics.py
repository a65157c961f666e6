"""Prometheus metrics of one worker, summed over all workers when scraped.

``Metrics.create(registry)`` makes the metric objects (never at import: module-level metrics break
multiprocess mode and tests). Under gunicorn, ``PROMETHEUS_MULTIPROC_DIR`` is set before any worker
imports ``prometheus_client``, so every value lives in a per-process memory-mapped file;
``telemetry.exposition.render()`` merges the files of all workers (counters and histograms summed,
gauges ``livesum``: only live workers count, because the master's ``child_exit`` hook calls
``mark_process_dead``).

Source: prometheus/client_python, "Multiprocess Mode (E.g. Gunicorn)"; Prometheus naming
conventions (base units, ``_total`` and ``_seconds`` suffixes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from telemetry.quantiles import LATENCY_BUCKETS

__all__ = [
    "E2E_BUCKETS",
    "MODEL_LABELS",
    "NO_MODEL",
    "REQUEST_LABELS",
    "ITL_BUCKETS",
    "QUEUE_BUCKETS",
    "TTFT_BUCKETS",
    "Metrics",
    "add_bucket_counts",
]

# Upper bounds in seconds. The bigram makes a token in ~10 us, a Llama step takes tens of ms: the
# inter-token buckets span both, finer steps below the latency buckets' first (1 ms), those up to
# 250 ms, then 1 s.
TTFT_BUCKETS = LATENCY_BUCKETS
ITL_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    *(b for b in LATENCY_BUCKETS if b <= 0.25),
    1.0,
)
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Structured outputs: a grammar's wait (cache hit ~µs, typical compile ~1 ms, hostile ~1 s) and a
# request's mask time summed over its tokens and choices.
COMPILE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MASK_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
QUEUE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
SPAN_RESULTS = ("sent", "dropped", "failed")
REQUESTS_HELP = (
    "Generation requests answered, by endpoint, HTTP status, finish reason, why generation ended, "
    "and the model and variant that answered."
)
# The served model (the models file's name, a bounded set: never the client's ``model`` string) and
# its variant (``primary`` or a canary's name).
MODEL_LABELS = ("model", "variant")
REQUEST_LABELS = ("endpoint", "status", "finish_reason", "end_reason", *MODEL_LABELS)
# ``model`` and ``variant`` of a request that never picked a model (refused before its body was read:
# a missing API key, the rate limit, an unreadable body; a pinned variant the model lacks; or lost
# with a worker that died). Prometheus
# treats an empty label as an absent one, so these series group under no model, and no models file
# name (never empty) can collide with it.
NO_MODEL = ""
# A shadow variant's mirrored requests: how each ended, and why a dropped one was dropped.
SHADOW_OUTCOMES = ("exact", "diverged", "dropped")
SHADOW_DROP_REASONS = ("queue_full", "preempted", "failed", "shutdown")
# Token positions of a shadow's first divergence within a choice: 0, 1, 2, 4, ..., 4096.
DIVERGENCE_BUCKETS = (0.0, *(float(2**k) for k in range(13)))


@dataclass(frozen=True)
class Metrics:
    """The worker's metric objects (names as exposed).

    Attributes:
        requests: ``greenserve_requests_total{endpoint,status,finish_reason,end_reason,model,
            variant}``, generation requests answered (``endpoint``: ``/v1/completions``,
            ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/messages``; ``end_reason``: why
            generation ended, ``none`` when it never started; ``model``, ``variant``: the model
            and variant that answered, :data:`NO_MODEL` when none was picked).
        prompt_tokens: ``greenserve_prompt_tokens_total``, prompt tokens of requests that got a slot.
        generation_tokens: ``greenserve_generation_tokens_total{model,variant}``, tokens generated.
        ttft: ``greenserve_time_to_first_token_seconds{model,variant}``, arrival to first generated
            token.
        itl: ``greenserve_inter_token_latency_seconds``, gap between consecutive tokens of a request.
        e2e: ``greenserve_e2e_request_latency_seconds``, arrival to last byte, admitted requests.
        queue_wait: ``greenserve_queue_wait_seconds``, arrival to slot (or to giving up waiting).
        running: ``greenserve_requests_running{model,variant}``, the variant's generation slots in
            use (livesum over workers).
        queued: ``greenserve_requests_queued{model,variant}``, requests waiting for one of the
            variant's slots (livesum over workers).
        spans: ``greenserve_exported_spans_total{result}``, spans ``sent``/``dropped``/``failed``.
        workers: ``greenserve_workers``, live worker processes (1 per worker, livesum).
        workers_ready: ``greenserve_workers_ready``, workers whose ``/ready`` answers 200 (livesum;
            refreshed with each history heartbeat, ``STATS_FLUSH_S``).
        rate_limit_storage_errors: ``greenserve_rate_limit_storage_errors_total``, rate-limit
            storage failures (each one starts a cool-down served without limits).
        structured_requests: ``greenserve_structured_requests_total{kind}``, requests with an output
            constraint (structured outputs), refused ones included.
        structured_compile: ``greenserve_structured_compile_seconds``, a constrained request's wait
            for its grammar.
        structured_mask: ``greenserve_structured_mask_seconds``, a constrained request's mask time.
        tool_calls: ``greenserve_tool_calls_total``, tool calls made (every call of every choice).
        spec_draft_tokens: ``greenserve_spec_decode_draft_tokens_total``, tokens drafted by
            speculative decoding and verified.
        spec_accepted_tokens: ``greenserve_spec_decode_accepted_tokens_total``, drafted tokens
            accepted (each one a token generated without a pass of its own).
        prefix_cache_hit_tokens, prefix_cache_miss_tokens, prefix_cache_evictions:
            ``greenserve_prefix_cache_{hit_tokens,miss_tokens,evicted_blocks}_total``: prompt
            tokens served by the prefix cache, computed, and cached blocks evicted (Llama).
        shadow_requests: ``greenserve_shadow_requests_total{model,variant,outcome}``, requests
            mirrored to a shadow variant, by ``outcome``: ``exact`` (every choice's tokens the
            primary's), ``diverged``, ``dropped`` (never compared).
        shadow_dropped: ``greenserve_shadow_dropped_total{model,variant,reason}``, the dropped
            ones by ``reason``: ``queue_full``, ``preempted`` (a client's request came),
            ``failed``, ``shutdown``.
        shadow_first_divergence: ``greenserve_shadow_first_divergence_tokens{model,variant}``,
            the token position (within its choice) where a diverged choice first differed.
    """

    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_wait: Histogram
    running: Gauge
    queued: Gauge
    spans: Counter
    workers: Gauge
    workers_ready: Gauge
    rate_limit_storage_errors: Counter
    structured_requests: Counter
    structured_compile: Histogram
    structured_mask: Histogram
    tool_calls: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    prefix_cache_hit_tokens: Counter
    prefix_cache_miss_tokens: Counter
    prefix_cache_evictions: Counter
    shadow_requests: Counter
    shadow_dropped: Counter
    shadow_first_divergence: Histogram
    # The prefix cache's totals (hit, miss, evicted) last added: see set_prefix_cache_totals.
    _prefix_seen: list[int] = field(default_factory=lambda: [0, 0, 0], repr=False)
    # Every (model, variant) declared (declare_models): the load series clear_load zeroes.
    _served: list[tuple[str, str]] = field(default_factory=list, repr=False)

    @classmethod
    def create(cls, registry: CollectorRegistry | None) -> Metrics:
        """Make every metric, registered in ``registry`` (None: registered nowhere).

        In multiprocess mode the values go to the worker's files whatever the registry; scrape with
        :func:`render`, which reads the files, never ``registry``.

        Raises:
            ValueError: a metric of the same name is already in ``registry``.
        """
        r = registry
        m = cls(
            requests=Counter(
                "greenserve_requests",
                REQUESTS_HELP,
                REQUEST_LABELS,
                registry=r,
            ),
            prompt_tokens=Counter(
                "greenserve_prompt_tokens", "Prompt tokens of requests that got a slot.", registry=r
            ),
            generation_tokens=Counter(
                "greenserve_generation_tokens",
                "Tokens generated, over all choices, by model and variant.",
                MODEL_LABELS,
                registry=r,
            ),
            ttft=Histogram(
                "greenserve_time_to_first_token_seconds",
                "Seconds from arrival to the first generated token, by model and variant.",
                MODEL_LABELS,
                buckets=TTFT_BUCKETS,
                registry=r,
            ),
            itl=Histogram(
                "greenserve_inter_token_latency_seconds",
                "Seconds between consecutive generated tokens of one request.",
                buckets=ITL_BUCKETS,
                registry=r,
            ),
            e2e=Histogram(
                "greenserve_e2e_request_latency_seconds",
                "Seconds from arrival to the end of the answer, for admitted requests.",
                buckets=E2E_BUCKETS,
                registry=r,
            ),
            queue_wait=Histogram(
                "greenserve_queue_wait_seconds",
                "Seconds from arrival to a generation slot (or to leaving the queue without one).",
                buckets=QUEUE_BUCKETS,
                registry=r,
            ),
            running=Gauge(
                "greenserve_requests_running",
                "Generation slots in use, by model and variant.",
                MODEL_LABELS,
                multiprocess_mode="livesum",
                registry=r,
            ),
            queued=Gauge(
                "greenserve_requests_queued",
                "Requests waiting for a generation slot, by model and variant.",
                MODEL_LABELS,
                multiprocess_mode="livesum",
                registry=r,
            ),
            spans=Counter(
                "greenserve_exported_spans",
                "Spans handed to the OTLP exporter, by result: sent, dropped, failed.",
                ["result"],
                registry=r,
            ),
            workers=Gauge(
                "greenserve_workers",
                "Live worker processes.",
                multiprocess_mode="livesum",
                registry=r,
            ),
            workers_ready=Gauge(
                "greenserve_workers_ready",
                "Workers ready for traffic: not draining, engine's last step good (as /ready).",
                multiprocess_mode="livesum",
                registry=r,
            ),
            rate_limit_storage_errors=Counter(
                "greenserve_rate_limit_storage_errors",
                "Rate-limit storage failures; each starts a cool-down served without limits.",
                registry=r,
            ),
            structured_requests=Counter(
                "greenserve_structured_requests",
                "Generation requests with an output constraint, by kind (json_schema, json_object, "
                "regex, choice, grammar, tool_calls), refused ones included.",
                ["kind"],
                registry=r,
            ),
            structured_compile=Histogram(
                "greenserve_structured_compile_seconds",
                "Seconds a constrained request waited for its grammar (about 0 from the cache).",
                buckets=COMPILE_BUCKETS,
                registry=r,
            ),
            structured_mask=Histogram(
                "greenserve_structured_mask_seconds",
                "Seconds spent computing one constrained request's token masks, over its tokens "
                "and choices.",
                buckets=MASK_BUCKETS,
                registry=r,
            ),
            tool_calls=Counter(
                "greenserve_tool_calls",
                "Tool calls made in chat answers, every call of every choice counted.",
                registry=r,
            ),
            spec_draft_tokens=Counter(
                "greenserve_spec_decode_draft_tokens",
                "Tokens drafted by speculative decoding and verified.",
                registry=r,
            ),
            spec_accepted_tokens=Counter(
                "greenserve_spec_decode_accepted_tokens",
                "Drafted tokens accepted by speculative decoding.",
                registry=r,
            ),
            prefix_cache_hit_tokens=Counter(
                "greenserve_prefix_cache_hit_tokens",
                "Prompt tokens served by the prefix cache.",
                registry=r,
            ),
            prefix_cache_miss_tokens=Counter(
                "greenserve_prefix_cache_miss_tokens",
                "Prompt tokens computed (cache on).",
                registry=r,
            ),
            prefix_cache_evictions=Counter(
                "greenserve_prefix_cache_evicted_blocks",
                "Cached prompt blocks evicted (LRU).",
                registry=r,
            ),
            shadow_requests=Counter(
                "greenserve_shadow_requests",
                "Requests mirrored to a shadow variant, by outcome: exact (its tokens the "
                "primary's), diverged, dropped.",
                ["model", "variant", "outcome"],
                registry=r,
            ),
            shadow_dropped=Counter(
                "greenserve_shadow_dropped",
                "Mirrored requests a shadow variant dropped, by reason: queue_full, preempted, "
                "failed, shutdown.",
                ["model", "variant", "reason"],
                registry=r,
            ),
            shadow_first_divergence=Histogram(
                "greenserve_shadow_first_divergence_tokens",
                "Token position within a choice where a shadow variant's tokens first differed "
                "from the primary's.",
                ["model", "variant"],
                buckets=DIVERGENCE_BUCKETS,
                registry=r,
            ),
        )
        for result in SPAN_RESULTS:  # present from the start, at 0
            m.spans.labels(result=result)
        m.workers.set(1)
        m.set_ready(True)  # a new worker is ready: not draining, engine untouched
        return m

    def declare_models(self, served: Sequence[tuple[str, str]]) -> None:
        """Make the per-model series of every ``(model, variant)`` served, at 0, so that they are
        exported (and ``rate()`` sees their first increase) before the variant's first request.

        Only the series without other labels: the tokens counter, the TTFT histogram and the
        running and queued gauges.

        Source: Prometheus instrumentation practices, "Avoid missing metrics".
        """
        for model, variant in served:
            self.generation_tokens.labels(model=model, variant=variant)
            self.ttft.labels(model=model, variant=variant)
            self.running.labels(model=model, variant=variant).set(0)
            self.queued.labels(model=model, variant=variant).set(0)
            self._served.append((model, variant))

    def observe_request(
        self,
        *,
        status: int,
        finish_reason: str,
        end_reason: str,
        endpoint: str = "/v1/completions",
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        e2e_s: float | None,
        queue_wait_s: float | None,
        itl_counts: Sequence[int] = (),
        itl_sum_s: float = 0.0,
        constraint: str | None = None,
        compile_s: float | None = None,
        mask_s: float | None = None,
        tool_calls: int = 0,
        model: str = NO_MODEL,
        variant: str = NO_MODEL,
    ) -> None:
        """Record one finished generation request.

        Args:
            endpoint: the route answered (``/v1/completions``, ``/v1/chat/completions``,
                ``/v1/responses``, ``/v1/messages``).
            status: the HTTP status sent.
            finish_reason: the request's finish reason label (``length``, ``stop``, ``error``, …).
            end_reason: why generation ended (``finished``, ``stop``, ``client_left``,
                ``send_timeout``, ``deadline``, ``shutdown``, ``engine_error``), ``none`` when it
                never started.
            prompt_tokens: prompt tokens counted (0 when the request never got a slot).
            completion_tokens: tokens generated over all choices.
            ttft_s: seconds to the first token, or None when no token was generated.
            e2e_s: seconds from arrival to the end, or None when not admitted.
            queue_wait_s: seconds spent waiting for a slot, or None when not admitted.
            itl_counts: inter-token gaps per bucket of ``ITL_BUCKETS`` (+Inf last), or empty.
            itl_sum_s: the sum of those gaps, seconds.
            constraint: the output constraint's kind (structured outputs), or None.
            compile_s: seconds the request waited for its grammar, or None.
            mask_s: seconds spent on its token masks, or None.
            tool_calls: tool calls its answer made.
            model, variant: the model and variant that answered, :data:`NO_MODEL` when the request
                picked none.
        """
        self.requests.labels(
            endpoint=endpoint,
            status=str(status),
            finish_reason=finish_reason,
            end_reason=end_reason,
            model=model,
            variant=variant,
        ).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.labels(model=model, variant=variant).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(model=model, variant=variant).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s)
        if itl_counts:
            add_bucket_counts(self.itl, itl_counts, itl_sum_s)
        if constraint is not None:
            self.structured_requests.labels(kind=constraint).inc()
        if compile_s is not None:
            self.structured_compile.observe(compile_s)
        if mask_s is not None:
            self.structured_mask.observe(mask_s)
        if tool_calls:
            self.tool_calls.inc(tool_calls)

    def set_load(self, load: Mapping[tuple[str, str], tuple[int, int]]) -> None:
        """Set this worker's running and queued request gauges of each ``(model, variant)`` in
        ``load`` to its ``(running, queued)`` request counts."""
        for (model, variant), (running, queued) in load.items():
            self.running.labels(model=model, variant=variant).set(running)
            self.queued.labels(model=model, variant=variant).set(queued)

    def clear_load(self) -> None:
        """Set the running and queued gauges of every declared model and variant to 0 (a worker
        that exits leaves no request counted)."""
        self.set_load(dict.fromkeys(self._served, (0, 0)))

    def set_ready(self, ready: bool) -> None:
        """Set whether this worker is ready for traffic (what its ``/ready`` answers)."""
        self.workers_ready.set(1 if ready else 0)

    def set_prefix_cache_totals(
        self, hit_tokens: int, miss_tokens: int, evicted_blocks: int
    ) -> None:
        """Bring the prefix cache's counters up to the running totals its owner keeps (prompt
        tokens served from the cache and computed, blocks evicted, since the worker started): each
        counter is added what its total grew by since the last call.

        The engine thread counts in plain integers; the heartbeat brings them here, so a step never
        touches a metric.
        """
        counters = (
            self.prefix_cache_hit_tokens,
            self.prefix_cache_miss_tokens,
            self.prefix_cache_evictions,
        )
        seen = self._prefix_seen
        for i, total in enumerate((hit_tokens, miss_tokens, evicted_blocks)):
            if total > seen[i]:
                counters[i].inc(total - seen[i])
                seen[i] = total

    def count_speculative(self, drafted: int, accepted: int) -> None:
        """Count ``drafted`` tokens verified by speculative decoding, ``accepted`` of them kept.

        Called on the engine's thread (``prometheus_client`` counters are thread-safe).
        """
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)

    def add_shadow(self, model: str, variant: str) -> None:
        """Make a shadow variant's series, at 0 (so that a scrape shows them before any mirror)."""
        for outcome in SHADOW_OUTCOMES:
            self.shadow_requests.labels(model=model, variant=variant, outcome=outcome)
        for reason in SHADOW_DROP_REASONS:
            self.shadow_dropped.labels(model=model, variant=variant, reason=reason)
        self.shadow_first_divergence.labels(model=model, variant=variant)

    def count_shadow(
        self,
        model: str,
        variant: str,
        outcome: str,
        reason: str | None = None,
        positions: Sequence[int] = (),
    ) -> None:
        """Count one request mirrored to the shadow ``variant`` of ``model``.

        Args:
            outcome: one of :data:`SHADOW_OUTCOMES`.
            reason: why a dropped one was dropped (:data:`SHADOW_DROP_REASONS`), else None.
            positions: each diverged choice's first differing token position.
        """
        self.shadow_requests.labels(model=model, variant=variant, outcome=outcome).inc()
        if reason is not None:
            self.shadow_dropped.labels(model=model, variant=variant, reason=reason).inc()
        if positions:
            histogram = self.shadow_first_divergence.labels(model=model, variant=variant)
            for position in positions:
                histogram.observe(position)

    def on_span_result(self, kind: str, n: int) -> None:
        """Count ``n`` spans with result ``kind`` (the ``SpanExporter.on_result`` hook)."""
        self.spans.labels(result=kind).inc(n)


def add_bucket_counts(histogram: Histogram, counts: Sequence[int], total: float) -> None:
    """Add many observations at once, given per-bucket counts and their sum.

    Equivalent to calling ``observe()`` once per observation, at one write per bucket instead of two
    per observation: a 4096-token stream adds its gaps for the cost of a few ``observe()`` calls.
    Relies on ``Histogram._buckets`` (per-bucket, non-cumulative values) and ``_sum``, which
    ``observe()`` itself updates; ``tests/test_metrics.py`` checks the equivalence.

    Args:
        histogram: an unlabelled histogram (or one labelled child).
        counts: observations per bucket, one entry per bucket including ``+Inf``.
        total: the sum of the observations.

    Raises:
        ValueError: ``counts`` has the wrong length.
    """
    buckets = histogram._buckets
    if len(counts) != len(buckets):
        raise ValueError(f"counts: expected {len(buckets)} entries, got {len(counts)}")
    for value, n in zip(buckets, counts, strict=True):
        if n:
            value.inc(n)
    histogram._sum.inc(total)
