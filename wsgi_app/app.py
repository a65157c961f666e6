"""The app factory: wires the settings, the models and their engines, telemetry and the blueprints.

Use ``create_app()`` as gunicorn's app (``wsgi_app:create_app()``); it builds the per-worker state
(:func:`make_runtime`), installs the hooks (:func:`install_hooks`) and registers the routes
(:func:`register_blueprints`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, request

from model import __version__
from model.engine import Engine
from model.loader import LoadedModel
from telemetry.metrics import Metrics
from telemetry.observer import build_observer
from telemetry.otlp import NullExporter, SpanExporter
from wsgi_app.generation.admission import Admission
from wsgi_app.generation.context import GenerationContext
from wsgi_app.generation.faults import Faults, FaultyEngine
from wsgi_app.generation.registry import ModelRegistry, ServedModel
from wsgi_app.generation.shadow import ShadowRunner
from wsgi_app.http import auth, cors, lifecycle, origin_guard, ratelimit
from wsgi_app.http.auth_failures import AuthFailures
from wsgi_app.http.chat import serving_template
from wsgi_app.http.error_handlers import register_error_handlers
from wsgi_app.http.routes import (
    chat,
    completions,
    completions_get,
    messages,
    models,
    openapi,
    ops,
    pages,
    responses,
    stats,
)
from wsgi_app.http.runtime import EXTENSION, Runtime
from wsgi_app.model_set import check_budget, load_models, models_of
from wsgi_app.models_file import ModelEntry
from wsgi_app.server.heap import AfterAnswers
from wsgi_app.settings import Settings

SYNC_KEPT = 256  # functions whose ensure_sync answer GreenserveFlask keeps


def make_engine(
    model: LoadedModel,
    settings: Settings,
    on_speculated: Callable[[int, int], None] | None = None,
    max_slots: int | None = None,
) -> Engine:
    """Return the engine for ``model``: an inline family (the bigram) runs in each request's
    greenlet; a batched one (a Llama) runs on one native thread per worker with continuous batching
    (up to ``max_slots``, else ``MAX_SLOTS``, requests of ``MAX_N`` choices each), drafting up to
    ``SPECULATIVE_TOKENS`` (its drafted and accepted token counts go to ``on_speculated``), with a
    prefix cache unless ``PREFIX_CACHE=0``."""
    if not model.family.inline:
        from wsgi_app.generation.engine_thread import ThreadedEngine

        slots, _ = model.family.limits(max_slots or settings.max_slots, settings.max_queue)
        batch = slots * settings.max_n
        cache_bytes = settings.kv_cache_budget_mb << 20 if settings.prefix_cache else None
        scheduler = model.make_scheduler(
            batch,
            batch_invariant=settings.batch_invariant,
            speculative_tokens=settings.speculative_tokens,
            prefix_cache_bytes=cache_bytes,
        )
        return ThreadedEngine(scheduler, on_speculated=on_speculated)
    return model.make_engine()


class GreenserveFlask(Flask):
    """Flask, deciding once per function whether a hook, view or error handler is a coroutine.

    Flask's ``ensure_sync`` asks ``inspect.iscoroutinefunction`` at every call of every hook and
    view (five a request here, ~1 % of a short request); the answer never changes for a function,
    so it is kept. Every function this app calls is one it registered at start, so the cache stays
    small; past :data:`SYNC_KEPT` functions the others are asked each time, as Flask does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``func`` as Flask's ``ensure_sync`` does (a coroutine function made synchronous)."""
        try:
            return self._sync[func]
        except KeyError:
            sync = super().ensure_sync(func)
            if len(self._sync) < SYNC_KEPT:
                self._sync[func] = sync
            return sync
        except TypeError:  # not hashable: nothing to keep
            return super().ensure_sync(func)


def _options_no_content(response: Response) -> Response:
    """Answer a plain ``OPTIONS`` (Flask's automatic one: 200, empty, ``text/html``) as ``204`` with
    its ``Allow`` header and no body type. CORS preflights are answered by ``cors.py`` before this."""
    if request.method == "OPTIONS" and response.status_code == 200 and not response.get_data():
        response.status_code = 204
        del response.headers["Content-Type"]
        response.headers["Allow"] = ", ".join(sorted(response.allow))  # a stable order
    return response


def make_exporter(settings: Settings, metrics: Metrics) -> SpanExporter | NullExporter:
    """Return the span exporter: OTLP/HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (its results counted
    in ``metrics``), or one that drops every span when that is unset."""
    if not settings.otlp_endpoint:
        return NullExporter()
    return SpanExporter(
        settings.otlp_endpoint,
        service_name=settings.service_name,
        on_result=metrics.on_span_result,
        scope_version=__version__,
    )


def make_served(
    entry: ModelEntry,
    model: LoadedModel,
    settings: Settings,
    on_speculated: Callable[[int, int], None],
    on_load: Callable[[int, int], None],
) -> ServedModel:
    """Build what one model variant's generations run with: its chat template, its engine (wrapped with
    the test-only ``GREENSERVE_FAULTS`` when set: a shadow variant's with ``Faults.for_shadow``), its
    own admission (the entry's slots and queue,
    else ``MAX_SLOTS`` and ``MAX_QUEUE``, else its family's; a ``KV_CACHE_BUDGET_MB`` of its own).

    Args:
        entry: the model's entry (name, aliases, slots and queue).
        model: the loaded model.
        settings: the server settings.
        on_speculated: told a Llama engine's drafted and accepted token counts.
        on_load: told the model's running and queued requests when they change.

    Raises:
        ValueError: its chat template (or ``CHAT_TEMPLATE``, ``TOOL_TEMPLATE``) is invalid.
    """
    chat_template = serving_template(model, settings)
    slots = entry.max_slots or settings.max_slots
    queue = settings.max_queue if entry.max_queue is None else entry.max_queue
    engine = make_engine(model, settings, on_speculated, slots)
    prefix_cache = engine.prefix_cache
    if settings.faults:
        faults = Faults.parse(settings.faults)
        engine = FaultyEngine(engine, faults if entry.shadow is None else faults.for_shadow())
    admission = Admission(
        *model.family.limits(slots, queue),
        on_load,
        kv_budget_bytes=settings.kv_cache_budget_mb << 20,
        on_room=None if prefix_cache is None else prefix_cache.set_room,
    )
    generation = GenerationContext(
        settings, model, engine, admission, f"{model.checksum[:16]}+greenserve-{__version__}"
    )
    # Only the operator's pace refuses a request (GenerationContext.feasible_max_tokens) or ends a
    # queued one early: a pace measured here would depend on the load at this worker's start, and
    # two workers would decide the same request differently (docs/ARCHITECTURE.md §9).
    if settings.decode_tokens_per_s is not None:
        generation.decode_tokens_per_s = settings.decode_tokens_per_s
    return ServedModel(
        entry.name,
        entry.aliases,
        generation,
        chat_template,
        entry.variant,
        entry.weight,
        entry.shadow,
    )


def make_runtime(settings: Settings, clock: Callable[[], float]) -> Runtime:
    """Load the models (``MODELS_FILE``, else ``MODEL_DIR``'s one) and build what the worker serves
    with: each model's engine and admission (:func:`make_served`), the shadow variants' runner, the
    observer and its heartbeat, the span exporter.

    Args:
        settings: the server settings.
        clock: Unix time in seconds for the request history.

    Raises:
        ValueError: the models file, a model config, a checkpoint or a chat template is invalid, or
            the models cost more than ``MEMORY_BUDGET_MB`` (the message names it).
    """
    models = models_of(settings)
    loaded = load_models(models)
    check_budget(loaded, settings)
    observer = build_observer(
        clock,
        stats_db=settings.stats_db,
        slo_ttft_s=settings.slo_ttft_s,
        stats_flush_s=settings.stats_flush_s,
        slow_request_s=settings.slow_request_s,
    )
    exporter = make_exporter(settings, observer.metrics)
    served: list[ServedModel] = []
    shadows: ShadowRunner | None = None

    def on_load(_running: int, _queued: int) -> None:
        # One pair of load gauges per model variant: an operator sees which one is saturated.
        admissions = {(s.name, s.variant): s.generation.admission for s in served}
        observer.set_load({k: (a.busy, a.queued) for k, a in admissions.items()})
        if shadows is not None:  # a client's request preempts a shadow; an idle worker runs one
            shadows.on_load()

    count_speculative = observer.metrics.count_speculative
    for entry, model in loaded:
        try:
            served.append(make_served(entry, model, settings, count_speculative, on_load))
        except ValueError as exc:
            if models.path is None:  # MODEL_DIR: the message names it already
                raise
            raise ValueError(f"{models.where(entry)}: {exc}") from exc
    default = models.default or served[0].name
    registry = ModelRegistry(served, default, settings.variant_salt)
    observer.metrics.declare_models([(s.name, s.variant) for s in registry.served])
    rt = Runtime(registry, exporter, observer=observer)
    rt.after_answers = AfterAnswers(rt.idle)
    rt.shadows = shadows = ShadowRunner(rt.idle, observer.metrics, registry.shadows())
    observer.flusher.worker_state = rt.heartbeat
    return rt


def install_hooks(app: Flask, rt: Runtime) -> None:
    """Register the per-request hooks and error handlers on ``app``, in the order they must run."""
    settings = rt.settings
    register_error_handlers(app)
    lifecycle.install(app)
    # After-request hooks run in reverse order: this one runs before lifecycle's, which records the
    # status for the log line, the span and the metrics (a plain OPTIONS is a 204 there too).
    app.after_request(_options_no_content)
    # CORS preflights are answered before keys and limits: browsers send them without credentials.
    cors.install(app, settings.cors_origins)
    # Before keys and limits too: a web page of another origin makes the server do nothing.
    origin_guard.install(app, settings.cors_origins)
    # Keys before limits: a request is authenticated (or refused) before it counts against a bucket.
    failures = None
    if settings.api_keys:
        failures = AuthFailures(
            settings.auth_failure_limit, settings.rate_limit_storage_uri, settings.client_hash_salt
        )
    auth.install(app, settings.api_keys, failures)
    ratelimit.install(app, rt)


def register_blueprints(app: Flask, settings: Settings) -> None:
    """Register the routes: the API, the operational endpoints, and the pages unless ``PAGES=0``."""
    for bp in (
        completions.bp,
        completions_get.bp,
        chat.bp,
        messages.bp,
        responses.bp,
        models.bp,
        openapi.bp,
        ops.bp,
        stats.bp,
    ):
        app.register_blueprint(bp)
    if settings.pages:  # PAGES=0: no demo, no status page, no assets (all 404)
        app.register_blueprint(pages.bp)


def create_app(settings: Settings | None = None, clock: Callable[[], float] | None = None) -> Flask:
    """Create the app and load the model (once per worker).

    Args:
        settings: server settings; ``Settings.from_env()`` when None.
        clock: Unix time in seconds for the request history; ``time.time`` when None (tests step it).

    Raises:
        ValueError: a setting, the model config or the checkpoint is invalid (the message names it).
    """
    settings = settings or Settings.from_env()
    logging.getLogger("greenserve").setLevel(settings.log_level.upper())
    rt = make_runtime(settings, clock or time.time)
    app = GreenserveFlask(__name__)
    # "/v1//completions" is a 404 in the JSON shape, not an HTML redirect built from the Host header.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions[EXTENSION] = rt
    install_hooks(app, rt)
    register_blueprints(app, settings)
    return app
