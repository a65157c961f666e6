"""Who is asking: the client identity that rate limits count against and that logs hash.

The identity is the API key (as a digest, never the key itself) when API keys are on, else the client's
address: the TCP peer, or, behind ``TRUSTED_PROXIES=n`` proxies and only from a peer listed in
``FORWARDED_ALLOW_IPS``, the ``X-Forwarded-For`` entry the outermost trusted proxy wrote (the n-th from
the right). The health port never takes the header. Entries further left were written by the client or
by proxies we do not trust, so they are never used: that is what makes the address unspoofable.

Source: werkzeug ``ProxyFix`` (``x_for`` semantics); RFC 7239 §5.2 (why only trusted hops count).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from collections.abc import Sequence

from flask import g, request

from wsgi_app.http.runtime import Runtime, runtime

# gunicorn's own default for FORWARDED_ALLOW_IPS: only a proxy on this host is believed.
DEFAULT_ALLOWED = ("127.0.0.1", "::1")


def forwarded_client(
    remote_addr: str | None,
    forwarded_for: str | None,
    trusted: int,
    allowed: Sequence[str] = DEFAULT_ALLOWED,
) -> str:
    """Return the client address implied by ``trusted`` proxies in front of the server.

    The header is taken only from a peer in ``allowed`` (a proxy of ours); anyone else could
    invent it. Each proxy appends the address it received the request from to
    ``X-Forwarded-For``, so with ``n`` trusted proxies the n-th entry from the right is the one the
    outermost trusted proxy saw. Walking there, an entry that is not itself in ``allowed`` is not
    one of our proxies: it is the client, and nothing left of it is believed. With fewer entries
    than ``trusted`` (the request bypassed a proxy), or an entry that is not an IP address, the
    peer address is used, as werkzeug's ``ProxyFix`` does.

    Args:
        remote_addr: the TCP peer address (``REMOTE_ADDR``), or None.
        forwarded_for: the ``X-Forwarded-For`` header (repeated headers joined by commas), or None.
        trusted: how many proxies to trust (``TRUSTED_PROXIES``); 0 ignores the header.
        allowed: the proxies' addresses and networks (``FORWARDED_ALLOW_IPS``: ``"10.0.0.0/8"``,
            ``"::1"``, or ``"*"`` for any peer).

    Returns:
        The client address as text (normalised when it is an IP address), or ``"unknown"``.

    Source: gunicorn ``forwarded_allow_ips``; RFC 7239 §5.2; werkzeug ``ProxyFix``.
    """
    peer = _normalised_ip(remote_addr or "")
    if trusted > 0 and forwarded_for and peer is not None and _is_allowed(peer, allowed):
        hops = [h.strip() for h in forwarded_for.split(",")]
        if len(hops) >= trusted:
            client = peer
            for i in range(1, trusted + 1):
                candidate = _normalised_ip(hops[-i])
                if candidate is None:
                    return peer
                client = candidate
                if i < trusted and not _is_allowed(candidate, allowed):
                    break  # not a proxy of ours: the client, whatever it wrote further left
            return client
    return peer or remote_addr or "unknown"


def _is_allowed(address: str, allowed: Sequence[str]) -> bool:
    """Return whether ``address`` is in one of the ``allowed`` networks (``"*"``: any)."""
    networks = _networks(tuple(allowed))
    if networks is None:
        return True
    ip = ipaddress.ip_address(address)
    return any(ip.version == net.version and ip in net for net in networks)


@functools.lru_cache(maxsize=8)
def _networks(
    allowed: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """Parse ``FORWARDED_ALLOW_IPS`` entries once; None when ``"*"`` allows every peer."""
    if "*" in allowed:
        return None
    return tuple(ipaddress.ip_network(a, strict=False) for a in allowed)


# A worker sees the same few addresses again and again (its clients, its proxies): parsed once each.
@functools.lru_cache(maxsize=4096)
def _normalised_ip(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def key_digest(api_key: str) -> str:
    """Return a stable, non-reversible name for ``api_key``: 32 hex digits of its SHA-256."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def client_identity() -> str:
    """Return the current request's client identity (call inside a request).

    ``key:<digest>`` for a request authenticated with an API key (``wsgi_app.http.auth`` notes the
    digest on the request's record, ``RequestRecord.api_key_digest``), else ``addr:<client address>``
    (see :func:`forwarded_client`). A bearer token sent while API keys are off is ignored: an
    unchecked token would let a client choose its own rate-limit bucket. The identity holds no
    secret, but still hash it (salted) before logging it.
    """
    record = g.get("record")
    digest = record.api_key_digest if record is not None else None
    if digest:
        return f"key:{digest}"
    return f"addr:{client_address()}"


def client_address() -> str:
    """Return the current request's client address (see :func:`client_of`)."""
    environ = request.environ
    return client_of(
        runtime(),
        environ.get("REMOTE_ADDR"),  # werkzeug's ``request.remote_addr``
        environ.get("HTTP_X_FORWARDED_FOR"),  # ``request.headers.get("X-Forwarded-For")``
        environ.get("SERVER_PORT"),
    )


def client_of(
    rt: Runtime, remote_addr: str | None, forwarded_for: str | None, server_port: str | None
) -> str:
    """Return the client address of a request (see :func:`forwarded_client`), through Flask or
    answered by the worker (``wsgi_app.http.probes``).

    On the health port (``Runtime.health_port``) ``X-Forwarded-For`` is never believed: probes and
    scrapes reach it directly, so a header there was written by whoever sent the request.

    Args:
        rt: the worker's runtime (``TRUSTED_PROXIES``, ``FORWARDED_ALLOW_IPS``, the health port).
        remote_addr: the TCP peer address (``REMOTE_ADDR``), or None.
        forwarded_for: the ``X-Forwarded-For`` header, or None.
        server_port: the port the request came in on (``SERVER_PORT``), or None.
    """
    on_health_port = rt.health_port is not None and server_port == str(rt.health_port)
    return forwarded_client(
        remote_addr,
        forwarded_for,
        0 if on_health_port else rt.settings.trusted_proxies,
        rt.settings.forwarded_allow_ips,
    )
