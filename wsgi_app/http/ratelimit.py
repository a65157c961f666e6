"""Per-client rate limits on the API routes, with flask-limiter (``RATE_LIMIT``, ``RATE_LIMIT_STORAGE_URI``).

One moving-window bucket per client (``wsgi_app.http.client_identity``) shared by every ``/v1/`` route;
health, readiness, metrics, pages and ``/debug`` are never counted. ``memory://`` storage counts per
worker process, so with ``W`` workers a client can get up to ``W`` times the limit; ``redis://`` storage is
exact across workers and hosts. A request over the limit is a 429 ``rate_limit_exceeded`` with
``Retry-After``; every limited response carries ``X-RateLimit-Limit``, ``-Remaining`` and ``-Reset``.

The limiter fails open: when the storage cannot be reached the request is served unchecked, the failure
is logged and counted (``Runtime.rate_limit_storage_errors``), and the storage is left alone for
``COOLDOWN_S`` so that a black-holed Redis costs one timeout per cool-down, not one per request.

The headers are written here rather than by flask-limiter's ``headers_enabled``, which puts
``Retry-After`` on every successful answer and raises the ``Retry-After`` of a ``server_busy`` 429 to the
end of the client's rate-limit window.

Source: OpenAI API reference, "Error codes" (429); RFC 9110 §10.2.3 (Retry-After); docs/ARCHITECTURE.md §9.
"""

from __future__ import annotations

import logging
import math
import time
from urllib.parse import urlsplit

from flask import Flask, Response, g, request
from flask_limiter import Limit, Limiter, RateLimitExceeded
from limits.errors import ConfigurationError

from wsgi_app.api.errors import ApiError
from wsgi_app.http.client_identity import client_identity
from wsgi_app.http.error_handlers import error_response
from wsgi_app.http.runtime import Runtime
from wsgi_app.setting_checks import parse_rate_limit  # there so the master checks it without Flask

log = logging.getLogger("greenserve.ratelimit")


class _DropSwallowedTracebacks(logging.Filter):
    """flask-limiter logs a full traceback for every storage error it swallows; ours is one counted
    warning line per outage (``_storage_failed``), so drop the repeats, keep everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Swallowing error" not in record.getMessage()


_SWALLOWED = _DropSwallowedTracebacks()

API_PREFIX = "/v1/"
# A Redis round trip on a LAN takes well under a millisecond; past this the storage counts as down.
STORAGE_TIMEOUT_S = 0.25
# After a storage failure, serve unchecked for this long before trying the storage again.
COOLDOWN_S = 1.0
STRATEGY = "moving-window"  # exact: no burst of 2x the limit across a window boundary


def storage_options(uri: str) -> dict[str, float]:
    """Return the client options for the storage at ``uri``: short socket timeouts for Redis."""
    if urlsplit(uri).scheme.startswith(("redis", "rediss", "valkey")):
        return {"socket_connect_timeout": STORAGE_TIMEOUT_S, "socket_timeout": STORAGE_TIMEOUT_S}
    return {}


def redacted(uri: str) -> str:
    """Return ``uri`` without its credentials (for log lines)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def retry_after_s(reset_at: float, now: float) -> int:
    """Return whole seconds until ``reset_at`` (Unix seconds), at least 1 (0 would invite a retry
    that fails again)."""
    return max(1, math.ceil(reset_at - now))


class ClientRateLimits:
    """flask-limiter configured for greenserve, and what it needs around it (see module docstring).

    Args:
        rt: the worker's runtime (its ``settings`` and the storage-error counter).

    Raises:
        ValueError: ``RATE_LIMIT`` or ``RATE_LIMIT_STORAGE_URI`` is malformed (the message names it).
    """

    def __init__(self, rt: Runtime) -> None:
        settings = rt.settings
        parse_rate_limit(settings.rate_limit)
        self._rt = rt
        self._storage = redacted(settings.rate_limit_storage_uri)
        self._down_until = 0.0
        self.limiter = Limiter(
            client_identity,
            default_limits=[Limit(settings.rate_limit, scope="api", shared=True)],
            storage_uri=settings.rate_limit_storage_uri,
            storage_options=storage_options(settings.rate_limit_storage_uri),
            strategy=STRATEGY,
            swallow_errors=True,  # fail open; a swallowed failure leaves no current limit
            headers_enabled=False,
            key_prefix="greenserve",
        )
        self.limiter.request_filter(self._exempt)

    def install(self, app: Flask) -> None:
        """Register the limiter's hooks, the failure check, the headers and the 429 handler.

        Call it after ``auth.install`` so that a key is checked before it is counted.

        Raises:
            ValueError: the storage URI names an unknown storage.
        """
        try:
            self.limiter.init_app(app)
        except ConfigurationError as exc:
            raise ValueError(f"RATE_LIMIT_STORAGE_URI: {exc}") from exc
        app.before_request(self._check_counted)  # after the limiter's own hook
        app.after_request(self._add_headers)
        app.register_error_handler(RateLimitExceeded, self._too_many)

    def _exempt(self) -> bool:
        counted = request.path.startswith(API_PREFIX) and request.method != "OPTIONS"
        if counted and time.monotonic() < self._down_until:
            counted = False  # the storage failed moments ago: serve unchecked
        record = g.get("record")  # made by wsgi_app.http.lifecycle, whose hook runs first
        if record is not None:
            record.rate_limit_counted = counted
        return not counted

    def _check_counted(self) -> None:
        # A counted request that passed without a current limit had its storage error swallowed.
        if _counted() and self.limiter.current_limit is None:
            self._storage_failed()

    def _storage_failed(self) -> None:
        self._rt.rate_limit_storage_errors += 1
        if self._rt.observer is not None:
            self._rt.observer.metrics.rate_limit_storage_errors.inc()
        self._down_until = time.monotonic() + COOLDOWN_S
        log.warning(
            "rate-limit storage %s unreachable: serving without limits for %g s (failures: %d)",
            self._storage,
            COOLDOWN_S,
            self._rt.rate_limit_storage_errors,
        )

    def _window(self) -> tuple[int, int, float] | None:
        """(limit, remaining, reset at in Unix seconds) of this request's bucket, or None."""
        current = self.limiter.current_limit if _counted() else None
        if current is None:
            return None
        try:
            reset_at, remaining = current.window  # one storage call, cached on ``current``
        except Exception:  # noqa: BLE001 - any storage failure: no headers, still an answer
            g.record.rate_limit_counted = False
            self._storage_failed()
            return None
        return current.limit.amount, remaining, reset_at

    def _add_headers(self, response: Response) -> Response:
        window = self._window()
        if window is not None:
            amount, remaining, reset_at = window
            response.headers["X-RateLimit-Limit"] = str(amount)
            response.headers["X-RateLimit-Remaining"] = str(remaining)
            response.headers["X-RateLimit-Reset"] = str(math.ceil(reset_at))
        return response

    def _too_many(self, exc: RateLimitExceeded) -> Response:
        item = exc.limit.limit
        window = self._window()
        now = time.time()
        reset_at = window[2] if window is not None else now + item.get_expiry()
        return error_response(
            ApiError(
                429,
                f"Rate limit exceeded for this client: {item}. "
                "Retry after the number of seconds in the Retry-After header.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after_s(reset_at, now))},
            )
        )


def _counted() -> bool:
    """True when the current request counts against its client's limit (``RequestRecord``)."""
    record = g.get("record")
    return record is not None and record.rate_limit_counted


def install(app: Flask, rt: Runtime) -> ClientRateLimits | None:
    """Rate-limit the API routes of ``app`` when ``RATE_LIMIT`` is set; return the limiter or None.

    Raises:
        ValueError: ``RATE_LIMIT`` or ``RATE_LIMIT_STORAGE_URI`` is malformed.
    """
    if not rt.settings.rate_limit:
        return None
    logging.getLogger("flask-limiter").addFilter(_SWALLOWED)  # a set: adding twice is harmless
    limits = ClientRateLimits(rt)
    limits.install(app)
    return limits
