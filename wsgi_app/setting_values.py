"""Environment values read into typed setting values: one reader per kind of value, each failing with
a message that names the variable and what it got. Readers take the environment as a mapping and
never read ``os.environ`` themselves (``wsgi_app.settings`` is the only module that does).

Source: docs/ARCHITECTURE.md §11 (names, defaults and ranges).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from wsgi_app.setting_checks import (
    check_rate_limit_storage,
    check_redis_url,
    parse_rate_limit,
)

# A host name: dot-separated labels of letters, digits and inner hyphens (RFC 1123 §2.1).
HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def env_number(
    env: Mapping[str, str], name: str, default: float, lo: float, hi: float, kind: type
) -> Any:
    """Return ``env[name]`` converted by ``kind`` (int or float) and checked to be in ``lo..hi``, or
    ``default`` when it is unset or blank.

    Raises:
        ValueError: the value does not convert or is out of range (the message names ``name``).
    """
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {noun}, got {raw!r}") from None
    if not lo <= value <= hi:  # also rejects NaN
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value if kind is int else raw}")
    return value


def env_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    return env_number(env, name, default, lo, hi, int)


def env_float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    return env_number(env, name, default, lo, hi, float)


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip()
    return raw or default


def env_choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """Return ``env[name]`` (lower-cased) when it is one of ``choices``, or ``default`` when it is
    unset or blank.

    Raises:
        ValueError: another value (the message names ``name`` and the choices).
    """
    value = env_str(env, name, default).lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def field_defaults(cls: type) -> dict[str, Any]:
    """Return the plain defaults of the dataclass ``cls``'s fields by name (the one place each
    default is written is the field itself; fields with a factory are left out)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def env_api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("API_KEYS", "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if raw.strip() and not keys:
        raise ValueError("API_KEYS must list at least one non-empty key")
    return keys


def env_cors_origins(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("CORS_ORIGINS", "")
    origins = tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())
    for origin in origins:
        scheme, _, host = origin.partition("://")
        if origin != "*" and (scheme not in ("http", "https") or not host or "/" in host):
            raise ValueError(f"CORS_ORIGINS entries are * or scheme://host[:port], got {origin!r}")
    return origins


def env_rate_limit(env: Mapping[str, str], storage_uri: str) -> str:
    text = env_str(env, "RATE_LIMIT", "")
    if text:  # the storage is only used, and so only checked, when a limit is set
        parse_rate_limit(text)
        check_rate_limit_storage(storage_uri)
    return text


def env_redis_url(env: Mapping[str, str], name: str) -> str:
    """Return ``env[name]``, a Redis URL (``redis://``, ``rediss://`` or ``unix://``) with a valid
    port if any, or "" when unset or blank.

    Raises:
        ValueError: another scheme or a malformed port (the message names ``name`` and the scheme
            only: the URL may hold a password).
    """
    url = env_str(env, name, "")
    if url:
        check_redis_url(name, url)
    return url


def env_forwarded_allow_ips(env: Mapping[str, str], default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get("FORWARDED_ALLOW_IPS", "")
    entries = tuple(e.strip() for e in raw.split(",") if e.strip()) or default
    if "*" in entries:
        return ("*",)
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(
                "FORWARDED_ALLOW_IPS must list IP addresses or CIDR networks (or be '*'), "
                f"got {entry!r}"
            ) from None
    return entries


def env_auth_failure_limit(
    env: Mapping[str, str], storage_uri: str, keys: tuple[str, ...], default: str
) -> str:
    text = env_str(env, "AUTH_FAILURE_LIMIT", default)
    if keys:  # counted only when API keys are on
        parse_rate_limit(text, "AUTH_FAILURE_LIMIT")
        check_rate_limit_storage(storage_uri)
    return text


def env_readable_file(env: Mapping[str, str], name: str) -> str | None:
    path = env_str(env, name, "") or None
    if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise ValueError(f"{name} must be a readable file, got {path!r}")
    return path


def env_metrics_dir(env: Mapping[str, str]) -> str | None:
    path = env_str(env, "PROMETHEUS_MULTIPROC_DIR", "") or None
    if path is not None and not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        raise ValueError(
            f"PROMETHEUS_MULTIPROC_DIR must be an existing writable directory, got {path!r}"
        )
    return path


def env_host(env: Mapping[str, str], default: str) -> str:
    host = env_str(env, "HOST", default)
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"HOST must be an IP address or a host name, got {host!r}")
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        if len(host) > 253 or not HOST_NAME.fullmatch(host):
            raise ValueError(f"HOST must be an IP address or a host name, got {host!r}") from None
    return host
