"""Server settings read from the environment: the only module of the app that reads it.

Names, defaults and readers: docs/ARCHITECTURE.md §11. Values are validated here so that a typo in a
deployment fails the worker at start with a message naming the variable, not at the first request.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from wsgi_app.setting_checks import (
    _http_url,
)
from wsgi_app.setting_values import (
    env_api_keys,
    env_auth_failure_limit,
    env_choice,
    env_cors_origins,
    env_float,
    env_forwarded_allow_ips,
    env_host,
    env_int,
    env_metrics_dir,
    env_rate_limit,
    env_readable_file,
    env_redis_url,
    env_str,
    field_defaults,
)


def default_stats_db(env: Mapping[str, str] | None = None, name: str = "stats") -> str:
    """Return the default ``STATS_DB``: one server start's own history (with ``name``
    ``"responses"``, the default ``RESPONSES_DB``: its own stored responses).

    Under gunicorn, ``greenserve-<name>.sqlite3`` in the master's own metrics directory
    (``GREENSERVE_OWN_METRICS_DIR``, made per master by ``wsgi_app.gunicorn_config`` and removed when
    it exits): the workers of one master share it, and no later server on the same port inherits
    it. Outside gunicorn (``create_app`` in a script), ``greenserve-<name>-<PORT>.db`` in the system
    temp directory. A configured ``STATS_DB`` is kept across restarts instead.
    """
    env = os.environ if env is None else env
    own = env.get("GREENSERVE_OWN_METRICS_DIR", "").strip()
    if own and own == env.get("PROMETHEUS_MULTIPROC_DIR", "").strip():
        # not "*.db": prometheus_client reads every *.db file of this directory as metrics
        return os.path.join(own, f"greenserve-{name}.sqlite3")
    port = env.get("PORT", "").strip() or "8000"
    return os.path.join(tempfile.gettempdir(), f"greenserve-{name}-{port}.db")


def env_model_dir(env: Mapping[str, str]) -> str | None:
    """Return ``MODEL_DIR``, or None when it is unset (the packaged default model).

    Raises:
        ValueError: ``MODEL_DIR`` is set but empty or blank, as ``MODEL_DIR=$(python -m model.fetch
            smollm2)`` leaves it when the fetch fails: a refusal naming it, never the default model.
    """
    if "MODEL_DIR" not in env:
        return None
    value = env["MODEL_DIR"].strip()
    if not value:
        raise ValueError(
            "MODEL_DIR is set but empty (did the command that was to print the model's path fail?); "
            "unset it to serve the packaged default model"
        )
    return value


def otlp_traces_endpoint(env: Mapping[str, str]) -> str | None:
    """Return the OTLP/HTTP traces URL configured in ``env``, or None when tracing is off.

    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as-is; otherwise ``/v1/traces`` is appended to
    ``OTEL_EXPORTER_OTLP_ENDPOINT``.

    Source: OpenTelemetry Protocol Exporter specification, "Endpoint URLs for OTLP/HTTP".
    """
    signal = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if signal:
        return _http_url("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", signal)
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base:
        return None
    return _http_url("OTEL_EXPORTER_OTLP_ENDPOINT", base).rstrip("/") + "/v1/traces"


# model.tool_formats.FORMATS, named here so that reading the settings imports no model code (the
# gunicorn master reads them first); tests/test_tool_calls.py checks that both agree.
TOOL_CALL_FORMATS = ("smollm2", "hermes")


@dataclass(frozen=True)
class Settings:
    """Immutable server settings (docs/ARCHITECTURE.md §11).

    Attributes:
        model_dir: model directory, or None for the packaged default model.
        models_file: the models file naming several models (``MODELS_FILE``,
            ``wsgi_app.models_file``), or None: ``model_dir`` is the one model.
        variant_salt: the salt clients' keys are hashed with to pick a model's canary variant
            (``VARIANT_SALT``; every host of a server must share it: ``""`` by default).
        models_snapshot: the last good models file, checked and written by the gunicorn master
            (``GREENSERVE_MODELS_SNAPSHOT``, set by ``gunicorn_config.py``), which workers serve
            from instead of ``models_file``; None outside gunicorn.
        memory_budget_mb: MiB a worker's models may cost together (``MEMORY_BUDGET_MB``: every
            model's weights plus a Llama's ``kv_cache_budget_mb``), checked at start; None: unchecked.
        max_slots: concurrent generations per worker; None: sized to the model
            (the model family's, ``model.engine.Family.limits``: 1024 for the bigram, 64 for a Llama).
        max_queue: requests allowed to wait for a slot, per worker; None: sized to the model
            (1024 for the bigram, 256 for a Llama).
        kv_cache_budget_mb: KV-cache MiB the running requests of a worker may reserve together (a
            request reserves n x (prompt + max_tokens) tokens of its model's cache).
        batch_invariant: decode every sequence to the same bits whatever the batch (``1``), or let
            batches of 16+ sequences run one GEMM per product (``0``: faster, last bits load-dependent).
        speculative_tokens: most tokens a Llama sequence drafts per step by prompt lookup
            (``SPECULATIVE_TOKENS``, ``model.llama.serving.speculative``); 0 turns speculation off. The
            answers are the same bits either way (with ``batch_invariant``).
        prefix_cache: keep the KV of whole blocks of a Llama model's prompts and answers for reuse
            by later prompts that start with them (``1``), within ``kv_cache_budget_mb``; ``0``: none.
        max_body_bytes: largest request body accepted, in bytes (413 beyond).
        max_prompt_tokens: largest prompt, in tokens (bytes for the bigram).
        max_n: largest ``n`` (choices per request).
        max_logprob_entries: a request's budget of ``logprobs`` entries: choices × (``max_tokens`` +
            echoed prompt tokens) × (``logprobs`` + 1), checked before admission (400 beyond).
        request_timeout_s: per-request deadline, in seconds.
        max_mask_token_s: most CPU seconds one token mask of an output constraint may take
            (``MAX_MASK_TOKEN_S``): a constraint whose first masks take longer is refused, one
            whose mask takes longer while generating ends its request (400 naming it).
        grammar_cache_mb: MiB the compiled output constraints of a worker may keep, as estimated
            (``GRAMMAR_CACHE_MB``, ``model.grammar.compile.entry_bytes``); one estimated over a
            32nd of it is not kept.
        max_mask_request_s: most CPU seconds all token masks of one request may take together,
            over its choices (``MAX_MASK_REQUEST_S``); past it the request ends so too.
        decode_tokens_per_s: the decode pace one sequence is assumed to reach at best, tokens per
            second (``DECODE_TOKENS_PER_S``); None: measured by each worker at start. A request
            whose ``max_tokens`` could not finish within ``request_timeout_s`` at this pace is
            refused up front (``Runtime.feasible_max_tokens``).
        heartbeat_s: SSE ``: ping`` interval while nothing else is written, in seconds (after the
            first token; before it ``completion.WAITING_HEARTBEAT_S``, 0.5 s, when shorter).
        send_timeout_s: how long a blocked write may wait on a stalled reader, in seconds.
        log_level: Python logging level name.
        log_prompts: log prompt and completion texts (off by default).
        otlp_endpoint: full OTLP/HTTP traces URL, or None when tracing is off.
        service_name: ``service.name`` resource attribute of exported spans.
        faults: test-only fault injection spec (``GREENSERVE_FAULTS``), empty when off.
        rate_limit: per-client limit on the API routes, e.g. ``600/minute``; empty when off.
        rate_limit_storage_uri: where the limiter counts: ``memory://`` (per worker) or ``redis://…``.
        trusted_proxies: how many ``X-Forwarded-For`` hops (from the right) to trust; 0 ignores it.
        forwarded_allow_ips: the peers whose ``X-Forwarded-For`` is believed (``FORWARDED_ALLOW_IPS``,
            gunicorn's setting and default): addresses and CIDR networks, or ``("*",)`` for any.
        api_keys: accepted API keys; empty when authentication is off.
        auth_failure_limit: how many wrong API keys a client address may send (a flask-limiter string,
            ``AUTH_FAILURE_LIMIT``), counted in ``rate_limit_storage_uri``; past it, every request of
            that address carrying a key is a 429 until the window passes.
        cors_origins: origins allowed cross-origin access (``scheme://host[:port]`` or ``*``); empty
            when CORS is off.
        slow_request_s: requests taking longer than this log their timeline, in seconds.
        stats_db: the SQLite history file shared by the host's workers (``/stats/history``).
        stats_flush_s: seconds between a worker's writes to ``stats_db``.
        slo_ttft_s: time-to-first-token objective, in seconds; slower requests spend error budget.
        slo_target: fraction of requests promised good (no 5xx, TTFT within ``slo_ttft_s``).
        client_hash_salt: salt of the client hashes in logs; the same in every worker (gunicorn.conf.py
            generates one per server start when ``CLIENT_HASH_SALT`` is unset).
        prometheus_multiproc_dir: ``prometheus_client``'s multiprocess directory, or None for
            single-process metrics (set by gunicorn.conf.py).
        pages: serve the demo page ``/`` and the status page ``/status`` (``PAGES``, 1 or 0).
        chat_template: a Jinja2 chat template file that overrides the model's (``CHAT_TEMPLATE``),
            or None.
        tool_template: a Jinja2 tool template file that replaces ``model/templates/tools.jinja``
            (``TOOL_TEMPLATE``, used by chat templates that do not render tools), or None.
        chat_max_tokens: the cap on a chat answer's default ``max_tokens`` (``CHAT_MAX_TOKENS``):
            without ``max_tokens`` an answer may use the rest of the context up to this, in tokens.
        max_chat_messages: the most messages one chat request may hold (``MAX_CHAT_MESSAGES``);
            checked before the template renders them (400 ``messages`` beyond).
        tool_call_format: the tool-call format of a chat template that does not render tools
            (``TOOL_CALL_FORMAT``: ``smollm2``, one ``<tool_call>`` block holding a JSON array of
            calls, or ``hermes``, one JSON object per block; ``model.tool_formats``): the tool
            template writes tools and calls in it, and calls are constrained to it and read in it.
            A template that renders tools itself names its own (``ChatTemplate.tool_format``).
        server_started_at: when the gunicorn master started, Unix seconds (``GREENSERVE_STARTED_AT``,
            set by gunicorn.conf.py), or None outside gunicorn.
        responses_db: the SQLite file of stored responses (``/v1/responses`` with ``store``),
            shared by the host's workers (``RESPONSES_DB``; unused with ``responses_redis_url``).
        responses_redis_url: a Redis URL holding the stored responses instead, shared by every
            host (``RESPONSES_REDIS_URL``); empty: ``responses_db``.
        responses_redis_prefix: the prefix of every Redis key of the store
            (``RESPONSES_REDIS_PREFIX``).
        responses_max_count: the most stored responses kept (``RESPONSES_MAX_COUNT``); the oldest
            go first.
        responses_max_mb: the most MiB of stored responses kept (``RESPONSES_MAX_MB``).
        responses_ttl_s: seconds a stored response is kept (``RESPONSES_TTL_S``).
    """

    model_dir: str | None = None
    models_file: str | None = None
    memory_budget_mb: int | None = None
    models_snapshot: str | None = None
    variant_salt: str = field(default="", repr=False)
    max_slots: int | None = None
    max_queue: int | None = None
    kv_cache_budget_mb: int = 1024
    batch_invariant: bool = True
    speculative_tokens: int = 7
    prefix_cache: bool = True
    max_body_bytes: int = 1_048_576
    max_prompt_tokens: int = 32_768
    max_n: int = 8
    max_logprob_entries: int = 262_144
    request_timeout_s: float = 60.0
    max_mask_token_s: float = 0.005
    max_mask_request_s: float = 2.0
    grammar_cache_mb: int = 64
    decode_tokens_per_s: float | None = None
    heartbeat_s: float = 15.0
    send_timeout_s: float = 30.0
    log_level: str = "info"
    log_prompts: bool = False
    otlp_endpoint: str | None = None
    service_name: str = "greenserve"
    faults: str = ""
    rate_limit: str = ""
    # Secrets (a Redis password in the URI, the keys) stay out of reprs and so out of logs.
    rate_limit_storage_uri: str = field(default="memory://", repr=False)
    trusted_proxies: int = 0
    forwarded_allow_ips: tuple[str, ...] = ("127.0.0.1", "::1")
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    auth_failure_limit: str = "20/minute"
    cors_origins: tuple[str, ...] = ()
    slow_request_s: float = 10.0
    stats_db: str = field(default_factory=lambda: default_stats_db())
    stats_flush_s: float = 1.0
    slo_ttft_s: float = 1.0
    slo_target: float = 0.99
    client_hash_salt: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    prometheus_multiproc_dir: str | None = None
    pages: bool = True
    chat_template: str | None = None
    tool_template: str | None = None
    chat_max_tokens: int = 512
    max_chat_messages: int = 1024
    tool_call_format: str = "smollm2"
    server_started_at: float | None = None
    responses_db: str = field(default_factory=lambda: default_stats_db(name="responses"))
    responses_redis_url: str = field(default="", repr=False)  # may hold a password
    responses_redis_prefix: str = "greenserve:responses:"
    responses_max_count: int = 10_000
    responses_max_mb: int = 256
    responses_ttl_s: float = 86_400.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``env`` (default ``os.environ``).

        Raises:
            ValueError: a variable is malformed or out of range; the message names it.
        """
        env = os.environ if env is None else env
        d = field_defaults(cls)
        storage_uri = env_str(env, "RATE_LIMIT_STORAGE_URI", d["rate_limit_storage_uri"])
        models_file = env_readable_file(env, "MODELS_FILE")
        if models_file is not None and "MODEL_DIR" in env:
            raise ValueError(
                f"MODELS_FILE ({models_file}): set MODEL_DIR or MODELS_FILE, not both "
                "(name MODEL_DIR's model in the models file)"
            )
        return cls(
            model_dir=env_model_dir(env),
            models_file=models_file,
            variant_salt=env.get("VARIANT_SALT", d["variant_salt"]),
            models_snapshot=(env.get("GREENSERVE_MODELS_SNAPSHOT") or None)
            if models_file
            else None,
            memory_budget_mb=env_int(env, "MEMORY_BUDGET_MB", d["memory_budget_mb"], 1, 1 << 24),
            max_slots=env_int(env, "MAX_SLOTS", d["max_slots"], 1, 100_000),
            max_queue=env_int(env, "MAX_QUEUE", d["max_queue"], 0, 1_000_000),
            kv_cache_budget_mb=env_int(
                env, "KV_CACHE_BUDGET_MB", d["kv_cache_budget_mb"], 1, 1 << 24
            ),
            batch_invariant=env_int(env, "BATCH_INVARIANT", int(d["batch_invariant"]), 0, 1) == 1,
            speculative_tokens=env_int(env, "SPECULATIVE_TOKENS", d["speculative_tokens"], 0, 64),
            prefix_cache=env_int(env, "PREFIX_CACHE", int(d["prefix_cache"]), 0, 1) == 1,
            max_body_bytes=env_int(env, "MAX_BODY_BYTES", d["max_body_bytes"], 1024, 1 << 30),
            max_prompt_tokens=env_int(env, "MAX_PROMPT_TOKENS", d["max_prompt_tokens"], 1, 1 << 24),
            max_n=env_int(env, "MAX_N", d["max_n"], 1, 128),
            max_logprob_entries=env_int(
                env, "MAX_LOGPROB_ENTRIES", d["max_logprob_entries"], 1, 1 << 30
            ),
            request_timeout_s=env_float(
                env, "REQUEST_TIMEOUT_S", d["request_timeout_s"], 0.001, 86_400.0
            ),
            max_mask_token_s=env_float(
                env, "MAX_MASK_TOKEN_S", d["max_mask_token_s"], 0.0001, 3_600.0
            ),
            max_mask_request_s=env_float(
                env, "MAX_MASK_REQUEST_S", d["max_mask_request_s"], 0.001, 86_400.0
            ),
            grammar_cache_mb=env_int(env, "GRAMMAR_CACHE_MB", d["grammar_cache_mb"], 1, 1 << 20),
            decode_tokens_per_s=env_float(
                env, "DECODE_TOKENS_PER_S", d["decode_tokens_per_s"], 0.001, 1e9
            ),
            heartbeat_s=env_float(env, "HEARTBEAT_S", d["heartbeat_s"], 0.01, 3_600.0),
            send_timeout_s=env_float(env, "SEND_TIMEOUT_S", d["send_timeout_s"], 0.01, 3_600.0),
            log_level=env_str(env, "LOG_LEVEL", d["log_level"]).lower(),
            log_prompts=env_int(env, "LOG_PROMPTS", int(d["log_prompts"]), 0, 1) == 1,
            otlp_endpoint=otlp_traces_endpoint(env),
            service_name=env_str(env, "OTEL_SERVICE_NAME", d["service_name"]),
            faults=env_str(env, "GREENSERVE_FAULTS", d["faults"]),
            rate_limit=env_rate_limit(env, storage_uri),
            rate_limit_storage_uri=storage_uri,
            trusted_proxies=env_int(env, "TRUSTED_PROXIES", d["trusted_proxies"], 0, 32),
            forwarded_allow_ips=env_forwarded_allow_ips(env, d["forwarded_allow_ips"]),
            api_keys=env_api_keys(env),
            auth_failure_limit=env_auth_failure_limit(
                env, storage_uri, env_api_keys(env), d["auth_failure_limit"]
            ),
            cors_origins=env_cors_origins(env),
            slow_request_s=env_float(env, "SLOW_REQUEST_S", d["slow_request_s"], 0.0, 86_400.0),
            stats_db=env_str(env, "STATS_DB", default_stats_db(env)),
            stats_flush_s=env_float(env, "STATS_FLUSH_S", d["stats_flush_s"], 0.01, 3_600.0),
            slo_ttft_s=env_float(env, "SLO_TTFT_S", d["slo_ttft_s"], 0.001, 3_600.0),
            slo_target=env_float(env, "SLO_TARGET", d["slo_target"], 0.5, 0.999999),
            client_hash_salt=env_str(env, "CLIENT_HASH_SALT", "") or secrets.token_hex(16),
            prometheus_multiproc_dir=env_metrics_dir(env),
            pages=env_int(env, "PAGES", int(d["pages"]), 0, 1) == 1,
            chat_template=env_readable_file(env, "CHAT_TEMPLATE"),
            tool_template=env_readable_file(env, "TOOL_TEMPLATE"),
            chat_max_tokens=env_int(env, "CHAT_MAX_TOKENS", d["chat_max_tokens"], 1, 4096),
            max_chat_messages=env_int(env, "MAX_CHAT_MESSAGES", d["max_chat_messages"], 1, 1 << 20),
            tool_call_format=env_choice(
                env, "TOOL_CALL_FORMAT", d["tool_call_format"], TOOL_CALL_FORMATS
            ),
            server_started_at=(
                env_float(env, "GREENSERVE_STARTED_AT", 0.0, 0.0, 1e12)
                if env.get("GREENSERVE_STARTED_AT")
                else None
            ),
            responses_db=env_str(env, "RESPONSES_DB", default_stats_db(env, "responses")),
            responses_redis_url=env_redis_url(env, "RESPONSES_REDIS_URL"),
            responses_redis_prefix=env_str(
                env, "RESPONSES_REDIS_PREFIX", d["responses_redis_prefix"]
            ),
            responses_max_count=env_int(
                env, "RESPONSES_MAX_COUNT", d["responses_max_count"], 1, 100_000_000
            ),
            responses_max_mb=env_int(env, "RESPONSES_MAX_MB", d["responses_max_mb"], 1, 1 << 20),
            responses_ttl_s=env_float(
                env, "RESPONSES_TTL_S", d["responses_ttl_s"], 1.0, 365 * 86_400.0
            ),
        )

    def chat_template_source(self) -> str | None:
        """Return the text of the ``CHAT_TEMPLATE`` file, or None when the setting is unset.

        Raises:
            ValueError: the file cannot be read or is not UTF-8 (the message names ``CHAT_TEMPLATE``).
        """
        return _read_text("CHAT_TEMPLATE", self.chat_template)

    def tool_template_source(self) -> str | None:
        """Return the text of the ``TOOL_TEMPLATE`` file, or None when the setting is unset.

        Raises:
            ValueError: the file cannot be read or is not UTF-8 (the message names ``TOOL_TEMPLATE``).
        """
        return _read_text("TOOL_TEMPLATE", self.tool_template)


def _read_text(name: str, path: str | None) -> str | None:
    """Return the UTF-8 text of the file at ``path`` (the setting ``name``), None for no path."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name} ({path}): cannot read: {exc}") from None


def usable_cpus() -> int:
    """Return the CPUs this container may really use: the cgroup CPU quota first, then the affinity
    mask (``WEB_CONCURRENCY`` 0 or unset starts one worker per CPU)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]  # cgroup v2
        if quota != "max":
            return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())  # cgroup v1
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return max(1, -(-quota // period))
    except (OSError, ValueError):
        pass
    return len(os.sched_getaffinity(0)) or 1


@dataclass(frozen=True)
class ServerSettings:
    """gunicorn's own settings, read by ``gunicorn.conf.py`` in the master (docs/ARCHITECTURE.md §11).

    Attributes:
        host: the address both ports bind to (an IP address or a host name).
        port: the API port (``PORT``); 0 lets the system pick one.
        health_port: the health port (``HEALTH_PORT``); 0 disables it.
        workers: worker processes (``WEB_CONCURRENCY``); 0 means one per usable CPU.
        worker_connections: simultaneous connections per worker.
        timeout_s: gunicorn's worker timeout (``GUNICORN_TIMEOUT_S``), in seconds.
        graceful_timeout_s: seconds in-flight streams get after SIGTERM.
        keepalive_s: seconds an idle keep-alive connection is held open.
        header_timeout_s: seconds a request's head (request line and fields) may take to arrive
            (408 beyond).
        max_header_bytes: the largest request head, in bytes (431 beyond).
        log_level: logging level name, lower case (checked by ``telemetry.logs.logging_config``).
        generation: the worker's generation, 0 from the start and one more per reload
            (``GREENSERVE_GENERATION``, set by ``gunicorn_config.on_reload``, not by operators).
        handoff_dir: the master's own directory, where a reload's workers hand off
            (``GREENSERVE_OWN_METRICS_DIR``, made by ``gunicorn_config``); None outside gunicorn.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    health_port: int = 9464
    workers: int = 0
    worker_connections: int = 1000
    timeout_s: int = 30
    graceful_timeout_s: int = 30
    keepalive_s: int = 5
    header_timeout_s: float = 10.0
    max_header_bytes: int = 32_768
    log_level: str = "info"
    generation: int = 0
    handoff_dir: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerSettings:
        """Build gunicorn's settings from ``env`` (default ``os.environ``).

        Raises:
            ValueError: a variable is malformed or out of range, or ``PORT`` equals a non-zero
                ``HEALTH_PORT``; the message names it.
        """
        env = os.environ if env is None else env
        d = field_defaults(cls)
        settings = cls(
            host=env_host(env, d["host"]),
            port=env_int(env, "PORT", d["port"], 0, 65_535),
            health_port=env_int(env, "HEALTH_PORT", d["health_port"], 0, 65_535),
            workers=env_int(env, "WEB_CONCURRENCY", d["workers"], 0, 1024),
            worker_connections=env_int(
                env, "WORKER_CONNECTIONS", d["worker_connections"], 1, 1_000_000
            ),
            timeout_s=env_int(env, "GUNICORN_TIMEOUT_S", d["timeout_s"], 0, 86_400),
            graceful_timeout_s=env_int(
                env, "GRACEFUL_TIMEOUT_S", d["graceful_timeout_s"], 0, 86_400
            ),
            keepalive_s=env_int(env, "KEEPALIVE_S", d["keepalive_s"], 0, 3_600),
            header_timeout_s=env_float(
                env, "HEADER_TIMEOUT_S", d["header_timeout_s"], 0.1, 3_600.0
            ),
            max_header_bytes=env_int(env, "MAX_HEADER_BYTES", d["max_header_bytes"], 1024, 1 << 20),
            log_level=env_str(env, "LOG_LEVEL", d["log_level"]).lower(),
            generation=env_int(env, "GREENSERVE_GENERATION", 0, 0, 1 << 62),
            handoff_dir=env.get("GREENSERVE_OWN_METRICS_DIR", "").strip() or None,
        )
        if settings.port and settings.port == settings.health_port:
            raise ValueError(f"PORT and HEALTH_PORT must differ, both are {settings.port}")
        return settings

    @property
    def bind(self) -> list[str]:
        """Return gunicorn's ``bind``: the API address, then the health address unless disabled."""
        host = self.host
        if ":" in host and not host.startswith("["):  # an IPv6 address: gunicorn wants [::1]:8000
            host = f"[{host}]"
        ports = [self.port] + ([self.health_port] if self.health_port else [])
        return [f"{host}:{port}" for port in ports]
