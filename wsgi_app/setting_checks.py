"""Checks of setting values that name things outside the process: the stats database path, the OTLP
URL, the rate-limit string and its storage URI. Pure functions of a value (no environment read), so
the master can run them at start without Flask and ``settings.py`` stays the one reader of the
environment.

Source: RFC 3986 (URLs); the ``limits`` library's rate-limit string and storage URI formats.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from limits import RateLimitItem


def check_stats_db(path: str, name: str = "STATS_DB") -> None:
    """Check that the workers can create or write the SQLite database at ``path`` (``STATS_DB``, or
    the setting ``name``: ``RESPONSES_DB``; and SQLite's ``-wal`` file beside it), without creating
    it: the master may run as another user.

    Raises:
        ValueError: the directory is missing or not writable, or ``path`` is a directory or a file
            that is not writable (the message names the setting).
    """
    directory = os.path.dirname(os.path.abspath(path))
    usable = os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    if os.path.lexists(path):
        usable = usable and os.path.isfile(path) and os.access(path, os.R_OK | os.W_OK)
    if not usable:
        raise ValueError(f"{name} must be a file in a writable directory, got {path!r}")


def check_redis_url(name: str, url: str) -> None:
    """Check that the setting ``name`` is a Redis URL redis-py takes (``redis://``, ``rediss://``,
    ``unix://``) with a valid port if any, without connecting to it.

    Raises:
        ValueError: another scheme or a malformed port; the message shows the scheme only (the
            URL may hold a password).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"{name} must be a redis://host:port/db URL, got a {parts.scheme + '://'!r} URL"
        )
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _http_url(name: str, raw: str) -> str:
    """Return ``raw`` when it is an http:// or https:// URL with a host (and a valid port, if any)."""
    parts = urlsplit(raw)
    try:
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number or out of range
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an http:// or https:// URL with a host, got {raw!r}")
    return raw


def parse_rate_limit(text: str, name: str = "RATE_LIMIT") -> list[RateLimitItem]:
    """Parse a rate-limit setting (``"600/minute"``, ``"10/second;600/hour"``) with ``limits``.

    Args:
        text: the setting's value.
        name: the setting, for the message (``RATE_LIMIT``, ``AUTH_FAILURE_LIMIT``).

    Raises:
        ValueError: the text is not a rate-limit string (the message names ``name``).
    """
    from limits import parse_many  # imported only when a limit is set (limits pulls in asyncio)

    message = f"{name} must look like '600/minute', got {text!r}"
    try:
        items = parse_many(text)
    except ValueError as exc:
        raise ValueError(message) from exc
    if not items:
        raise ValueError(message)
    return items


def check_rate_limit_storage(uri: str) -> None:
    """Check that ``RATE_LIMIT_STORAGE_URI`` names a ``limits`` storage that can count a moving window
    (``wsgi_app.http.ratelimit.STRATEGY``) and whose client library is installed, without connecting to it.

    The message shows the scheme only: the URI may hold a Redis password.

    Raises:
        ValueError: an unknown scheme, a storage without moving windows (memcached), a missing client
            library or a malformed port (the message names ``RATE_LIMIT_STORAGE_URI``).
    """
    import importlib.util

    # SCHEMES is the registry ``limits.storage.storage_from_string`` instantiates from; instantiating
    # here would connect (Redis Cluster, MongoDB) or start a timer thread (memory) in the master.
    from limits.storage import SCHEMES, MovingWindowSupport

    parts = urlsplit(uri)
    storage = SCHEMES.get(parts.scheme)
    if storage is None or not issubclass(storage, MovingWindowSupport):
        raise ValueError(
            "RATE_LIMIT_STORAGE_URI must be memory:// or redis://host:port/db, "
            f"got a {parts.scheme + '://'!r} URI"
        )
    other = "redis" if parts.scheme.startswith("valkey") else "valkey"  # one client library is used
    for module in {name.split(".")[0] for name in storage.DEPENDENCIES} - {other}:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"RATE_LIMIT_STORAGE_URI: {parts.scheme}:// needs {module} installed")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ValueError(f"RATE_LIMIT_STORAGE_URI: {exc}") from None
