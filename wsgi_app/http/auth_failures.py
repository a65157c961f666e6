"""Wrong API keys are rate-limited per client address (``AUTH_FAILURE_LIMIT``).

Every request whose key is not one of ``API_KEYS`` is counted against its client address (the TCP peer,
or the trusted ``X-Forwarded-For`` entry: ``wsgi_app.http.client_identity``) in a moving window, in the
rate limiter's storage (``RATE_LIMIT_STORAGE_URI``: ``memory://`` counts per worker, ``redis://`` across
workers and hosts). Once an address has spent its budget, every request from it that carries a key, a
right one included, is a 429 ``too_many_auth_failures`` with ``Retry-After`` until its oldest failure
leaves the window; each such refusal is logged (with the address's salted hash). Requests without a key
are neither counted nor refused here (they get their 401). Like the rate limiter, the count fails open:
a storage that cannot be reached lets requests through to the key check, with a warning.

Source: OWASP Authentication Cheat Sheet ("Protect against automated attacks"); RFC 6585 §4 (429);
RFC 9110 §10.2.3 (Retry-After).
"""

from __future__ import annotations

import logging
import time

from limits import parse_many
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from telemetry.logs import client_hash
from wsgi_app.api.errors import ApiError
from wsgi_app.http.ratelimit import COOLDOWN_S, redacted, retry_after_s, storage_options

log = logging.getLogger("greenserve.auth")
_NAMESPACE = "greenserve-auth-failures"


class AuthFailures:
    """Count wrong keys per address and refuse keyed requests of an address over its budget.

    Args:
        limit: ``AUTH_FAILURE_LIMIT`` (``"20/minute"``; several, separated by ``;``, all apply).
        storage_uri: ``RATE_LIMIT_STORAGE_URI``.
        salt: ``CLIENT_HASH_SALT``, for the address's hash in log lines.

    Raises:
        ValueError: ``limit`` is not a rate-limit string.
    """

    def __init__(self, limit: str, storage_uri: str, salt: str) -> None:
        self._items = parse_many(limit)
        if not self._items:
            raise ValueError(f"AUTH_FAILURE_LIMIT must look like '20/minute', got {limit!r}")
        self._storage_name = redacted(storage_uri)
        self._limiter = MovingWindowRateLimiter(
            storage_from_string(storage_uri, **storage_options(storage_uri))
        )
        self._salt = salt
        self._down_until = 0.0

    def check(self, address: str) -> None:
        """Refuse a keyed request from ``address`` when its failures have spent the budget.

        Raises:
            ApiError: 429 ``too_many_auth_failures`` with ``Retry-After`` (whole seconds, >= 1).
        """
        if time.monotonic() < self._down_until:
            return
        try:
            spent = [i for i in self._items if not self._limiter.test(i, _NAMESPACE, address)]
            if not spent:
                return
            reset_at = max(self._limiter.get_window_stats(i, _NAMESPACE, address)[0] for i in spent)
        except Exception as exc:  # noqa: BLE001 - any storage failure: fail open
            self._storage_failed(exc)
            return
        now = time.time()
        retry_s = retry_after_s(reset_at, now)
        log.warning(
            "refused a request with an API key from client %s: too many wrong API keys (%s); "
            "retry after %d s",
            client_hash(self._salt, address),
            "; ".join(str(i) for i in spent),
            retry_s,
            extra={"client_hash": client_hash(self._salt, address), "retry_after_s": retry_s},
        )
        raise ApiError(
            429,
            "Too many requests with a wrong API key from this address: "
            f"{'; '.join(str(i) for i in spent)}. "
            "Retry after the number of seconds in the Retry-After header.",
            type="rate_limit_error",
            code="too_many_auth_failures",
            headers={"Retry-After": str(retry_s)},
        )

    def failed(self, address: str) -> None:
        """Count one wrong key from ``address`` (never raises)."""
        if time.monotonic() < self._down_until:
            return
        try:
            for item in self._items:
                self._limiter.hit(item, _NAMESPACE, address)
        except Exception as exc:  # noqa: BLE001 - any storage failure: fail open
            self._storage_failed(exc)

    def _storage_failed(self, exc: BaseException) -> None:
        self._down_until = time.monotonic() + COOLDOWN_S
        log.warning(
            "auth-failure storage %s unreachable (%s): wrong keys uncounted for %g s",
            self._storage_name,
            type(exc).__name__,
            COOLDOWN_S,
        )
