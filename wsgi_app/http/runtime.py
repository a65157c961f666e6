"""Per-worker state: what generations run with (the settings, the models with their engines and
admission), the span exporter and the request observer, readiness.

This is the only state the app keeps beyond a request; it lives on ``app.extensions["greenserve"]``, made
by the app factory in the worker (after gevent's patching), never in the gunicorn master.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from flask import current_app, request
from gevent.threadpool import ThreadPool

from model.chat_template import ChatTemplate
from model.engine import Engine
from model.grammar.compile import RequestGrammar
from model.loader import LoadedModel
from model.tokenizer import ByteTokenizer
from telemetry.observer import Observer
from telemetry.otlp import NullExporter, SpanExporter
from wsgi_app.generation.admission import Admission
from wsgi_app.generation.context import GenerationContext
from wsgi_app.generation.inputs import GenerationInput
from wsgi_app.generation.record import RequestRecord
from wsgi_app.generation.registry import PIN_HEADER, ModelRegistry, ServedModel
from wsgi_app.generation.shadow import Mirror, ShadowRunner
from wsgi_app.server.heap import AfterAnswers
from wsgi_app.server.worker import END_STREAMS_S
from wsgi_app.settings import Settings

EXTENSION = "greenserve"
RENDER_THREADS = 2
# Prompts longer than this (characters) are tokenized on the render pool, not on the hub.
INLINE_ENCODE_CHARS = 4096
T = TypeVar("T")
DRAIN_FILE = "greenserve-drained"  # in PROMETHEUS_MULTIPROC_DIR: see Runtime.drain_path
SESSION_HEADER = "X-Session-Id"  # a client's session: its variant key without an API key or user
NotReady = Literal["draining", "engine_failed"]  # why /ready answers 503


@dataclass
class Runtime:
    """What one worker serves with.

    Attributes:
        models: the served models (``wsgi_app.generation.registry``), each with what its
            generations run with (the model, its engine, admission, the model version, the stop
            clock, the engine's health): the Flask-free part, which the answer path hands to
            ``wsgi_app.generation`` for the model a request picks (:meth:`pick`). :attr:`generation`,
            :attr:`model`, :attr:`engine`, :attr:`admission`, :attr:`model_version` and
            :attr:`chat_template` are the default model's.
        exporter: the span exporter.
        started_at: Unix time the worker became ready, in seconds.
        stopping: SIGTERM happened: ``/ready`` answers 503.
        drained_here: the server was drained with no shared directory to say so (single process).
        rate_limit_storage_errors: times the rate-limit storage (Redis) could not be reached; the
            limiter fails open, so requests are served unchecked meanwhile.
        observer: the request observer (logs, metrics, history), or None.
        render_pool: native threads that render chat templates and tokenize their prompts (see
            :meth:`offload`), made on first use.
        after_answers: told when a generation request's answer is written, to give the freed heap
            back once the worker is idle, or None.
        health_port: the port of the health socket (gunicorn's second bind), or None; set by
            ``gunicorn_config.post_worker_init``.
        shadows: the worker's shadow jobs (``wsgi_app.generation.shadow``), or None.
    """

    models: ModelRegistry
    exporter: SpanExporter | NullExporter
    started_at: float = field(default_factory=time.time)
    stopping: bool = False
    drained_here: bool = False
    rate_limit_storage_errors: int = 0
    observer: Observer | None = None
    render_pool: ThreadPool | None = field(default=None, repr=False)
    after_answers: AfterAnswers | None = field(default=None, repr=False)
    health_port: int | None = None
    shadows: ShadowRunner | None = field(default=None, repr=False)

    @property
    def generation(self) -> GenerationContext:
        """The default model's generation context."""
        return self.models.default.generation

    @property
    def chat_template(self) -> ChatTemplate:
        """The default model's chat template: ``CHAT_TEMPLATE``, else the model's, else the
        default."""
        return self.models.default.chat_template

    def pick(self, body: Any, record: RequestRecord) -> ServedModel:
        """Return the model variant that answers a request (call inside it), and note on
        ``record`` its version (the answer's ``X-Model-Version``), its model's name and the
        variant's (the log line's, the metrics' labels and the span's attributes).

        The body's ``model`` picks the model (by name or alias), else the default
        (``ModelRegistry.pick``; a body that is not a JSON object gets the default model); the
        ``X-Model-Variant`` header pins a variant, else the client's key picks it: the API key's
        digest, else the body's ``user`` (a Messages body's ``metadata.user_id``), else the
        ``X-Session-Id`` header.

        Raises:
            ApiError: 400 naming ``X-Model-Variant`` when the model has no such variant.
        """
        body = body if isinstance(body, dict) else {}
        user = body.get("user")
        metadata = body.get("metadata")
        if user is None and isinstance(metadata, dict):  # Anthropic's Messages API
            user = metadata.get("user_id")
        key = None
        if record.api_key_digest is not None:
            key = "key:" + record.api_key_digest
        elif isinstance(user, str) and user:
            key = "user:" + user
        elif request.headers.get(SESSION_HEADER):
            key = "session:" + request.headers[SESSION_HEADER]
        pinned = request.headers.get(PIN_HEADER)
        served = self.models.pick(body.get("model"), key, pinned)
        record.model_version = served.model_version
        record.served_model = served.name
        record.variant = served.variant
        return served

    def mirror(
        self,
        served: ServedModel,
        record: RequestRecord,
        req: GenerationInput,
        seed: int,
        cache_salt: str = "",
        grammar: RequestGrammar | None = None,
    ) -> Mirror | None:
        """Return the shadow variants that mirror a request ``served`` answers (call inside it),
        or None: only a model's primary variant's requests, never one pinned with
        ``X-Model-Variant``, each shadow sampling by the request's id
        (``ModelRegistry.mirrored``)."""
        if self.shadows is None:
            return None
        pinned = request.headers.get(PIN_HEADER) is not None
        targets = self.models.mirrored(served, record.request_id, pinned)
        return self.shadows.mirror(targets, record.request_id, req, seed, cache_salt, grammar)

    @property
    def settings(self) -> Settings:
        """The frozen settings."""
        return self.generation.settings

    @property
    def model(self) -> LoadedModel:
        """The loaded model and its tokenizer."""
        return self.generation.model

    @property
    def engine(self) -> Engine:
        """The token-stream engine over the model: the bigram's inline engine, or the Llama
        batching engine on its native thread (``wsgi_app.generation.engine_thread``)."""
        return self.generation.engine

    @property
    def admission(self) -> Admission:
        """The worker's slots and queue."""
        return self.generation.admission

    @property
    def model_version(self) -> str:
        """The ``X-Model-Version`` value: checkpoint hash + code version."""
        return self.generation.model_version

    @property
    def stop_at(self) -> float | None:
        """``perf_counter`` time by which in-flight streams must end (set on SIGTERM), or None."""
        return self.generation.stop.stop_at

    def parse_limits(self, served: ServedModel) -> dict[str, Any]:
        """Keyword arguments for ``parse_completion_request`` of a request for ``served``: the
        limits, its tokenizer and its context length."""
        return {
            "max_prompt_tokens": self.settings.max_prompt_tokens,
            "max_n": self.settings.max_n,
            "max_logprob_entries": self.settings.max_logprob_entries,
            "tokenizer": self.prompt_tokenizer(served.model),
            "context_length": served.model.context_length,
        }

    def prompt_tokenizer(self, model: LoadedModel) -> Any:
        """``model``'s tokenizer for request prompts: long texts are encoded on :attr:`render_pool`.

        The byte tokenizer is returned as is (a prompt's byte length is its token count).
        """
        tokenizer = model.tokenizer
        if isinstance(tokenizer, ByteTokenizer):
            return tokenizer
        return OffloadedTokenizer(tokenizer, self.offload)

    def offload(self, func: Callable[..., T], args: Sequence[Any]) -> T:
        """Run ``func(*args)`` on a native thread of :attr:`render_pool`; return its result.

        The calling greenlet waits; the hub serves every other connection meanwhile, taking the GIL
        at least every ``sys.getswitchinterval()`` (5 ms) from the thread. Chat template renders
        (pure Python, up to ``MAX_RENDER_S``) and prompt tokenization (the ``tokenizers`` library
        releases the GIL) run here, so a heavy conversation never freezes the worker.

        Raises:
            BaseException: whatever ``func`` raised.
        """
        if self.render_pool is None:
            # Two threads: a second render need not queue behind a slow one, and the hub competes
            # for the GIL with at most two others.
            self.render_pool = ThreadPool(RENDER_THREADS)
        return self.render_pool.apply(func, args)

    @property
    def drain_path(self) -> str | None:
        """The file whose presence drains the whole server: in the server's metrics directory, which
        the master makes (or the operator gives) and every worker shares, and which outlives a
        SIGHUP reload; None without one."""
        directory = self.settings.prometheus_multiproc_dir
        return os.path.join(directory, DRAIN_FILE) if directory else None

    @property
    def draining(self) -> bool:
        """True while stopping or while the server is drained (``POST /debug/drain``)."""
        if self.stopping or self.drained_here:
            return True
        path = self.drain_path
        return path is not None and os.path.exists(path)

    def set_drained(self, drained: bool) -> None:
        """Drain the whole server (every worker's ``/ready`` answers 503), or undo it.

        Raises:
            OSError: the shared directory cannot be written.
        """
        path = self.drain_path
        if path is None:
            self.drained_here = drained
        elif drained:
            with open(path, "w") as f:
                f.write(f"{os.getpid()}\n")
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    @property
    def not_ready_reason(self) -> NotReady | None:
        """Why the worker should get no traffic now: ``"draining"`` (stopping, or the server
        drained), else ``"engine_failed"`` (the last shared step of any of its models' engines
        failed: ``ModelRegistry.failed``); None when ready."""
        if self.draining:
            return "draining"
        return "engine_failed" if self.models.failed() else None

    @property
    def ready(self) -> bool:
        """True while the worker should get traffic: not draining, every engine's last step good."""
        return self.not_ready_reason is None

    def begin_shutdown(self, grace_s: float) -> None:
        """Start a graceful stop: readiness turns false and in-flight streams end by ``grace_s``.

        Streams still running or queued ``END_STREAMS_S`` before the grace period ends get a final
        error event and ``[DONE]`` (gunicorn kills the worker at the end of ``graceful_timeout``,
        and the worker cuts and ends what is left before that: ``wsgi_app.server.worker``). Queued
        requests are woken then, not at their next heartbeat.

        A second SIGTERM changes nothing: the worker's own deadlines count from the first.

        Args:
            grace_s: gunicorn's ``graceful_timeout``, seconds from now.
        """
        if self.stop_at is not None:
            return
        self.stopping = True
        if self.shadows is not None:
            self.shadows.stop()
        for served in self.models.served:
            served.generation.stop_in(max(0.0, grace_s - END_STREAMS_S))

    def worker_state(self) -> dict[str, Any]:
        """Return this worker's state for ``/stats`` (written with every history heartbeat): its
        slots, queue and served requests summed over its models."""
        admissions = [served.generation.admission for served in self.models.served]
        return {
            "ready": self.ready,
            "draining": self.draining,
            "engine_ok": not self.models.failed(),
            "slots_busy": sum(adm.busy for adm in admissions),
            "slots_total": sum(adm.max_slots for adm in admissions),
            "queued": sum(adm.queued for adm in admissions),
            "served": sum(adm.served for adm in admissions),
        }

    def idle(self) -> bool:
        """True when no model of the worker has a generation running or queued."""
        return all(served.generation.admission.idle() for served in self.models.served)

    def heartbeat(self) -> dict[str, Any]:
        """Return :meth:`worker_state` for the history's heartbeat (``telemetry.flusher``, every
        ``STATS_FLUSH_S``), first bringing up to date the metrics that follow state kept elsewhere:
        ``greenserve_workers_ready`` follows ``/ready``, and the prefix cache's counters what the
        engine threads counted (summed over the models)."""
        state = self.worker_state()
        if self.observer is not None:
            metrics = self.observer.metrics
            metrics.set_ready(state["ready"])
            caches = [s.generation.engine.prefix_cache for s in self.models.served]
            caches = [cache for cache in caches if cache is not None]
            if caches:
                metrics.set_prefix_cache_totals(
                    sum(cache.hit_tokens for cache in caches),
                    sum(cache.miss_tokens for cache in caches),
                    sum(cache.evicted_blocks for cache in caches),
                )
        return state


def runtime() -> Runtime:
    """Return the current app's :class:`Runtime`."""
    return current_app.extensions[EXTENSION]


class OffloadedTokenizer:
    """A tokenizer whose ``encode`` of a long text runs on the worker's render pool, off the hub.

    A 1 MB prompt takes the ``tokenizers`` library 0.6–1.2 s; on the hub it would stall every other
    connection of the worker for that long. Texts of up to :data:`INLINE_ENCODE_CHARS` characters
    (microseconds of work) are encoded in place. Everything else is the wrapped tokenizer's.

    Args:
        tokenizer: the model's tokenizer (``model.tokenizer.HFTokenizer``).
        offload: :meth:`Runtime.offload`.
    """

    def __init__(self, tokenizer: Any, offload: Callable[..., Any]) -> None:
        self._tokenizer = tokenizer
        self._offload = offload

    def encode(self, text: str, special: bool = False, *, bos: bool = True) -> list[int]:
        """Return the wrapped tokenizer's ``encode(text, special, bos=bos)``, long texts off the hub.

        Raises:
            UnicodeEncodeError: as the wrapped tokenizer.
        """
        if len(text) <= INLINE_ENCODE_CHARS:
            return self._tokenizer.encode(text, special, bos=bos)
        return self._offload(lambda: self._tokenizer.encode(text, special, bos=bos), ())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
