"""Who is asking: the client identity that rate limits count against and that logs hash.

The identity is the API key (as a digest, never the key itself) when API keys are on, else the client's
address: the TCP peer, or, behind ``TRUSTED_PROXIES=n`` proxies, the ``X-Forwarded-For`` entry the
outermost trusted proxy wrote (the n-th from the right). Entries further left were written by the client or
by proxies we do not trust, so they are never used: that is what makes the address unspoofable.

Source: werkzeug ``ProxyFix`` (``x_for`` semantics); RFC 7239 §5.2 (why only trusted hops count).
"""

from __future__ import annotations

import hashlib
import ipaddress

from flask import g, request

from wsgi_app.http.runtime import runtime


def forwarded_client(remote_addr: str | None, forwarded_for: str | None, trusted: int) -> str:
    """Return the client address implied by ``trusted`` proxies in front of the server.

    Each proxy appends the address it received the request from to ``X-Forwarded-For``, so with ``n``
    trusted proxies the n-th entry from the right is the one the outermost trusted proxy saw. With
    fewer entries than ``trusted`` (the request bypassed a proxy), or an entry that is not an IP
    address, the peer address is used, as werkzeug's ``ProxyFix`` does.

    Args:
        remote_addr: the TCP peer address (``REMOTE_ADDR``), or None.
        forwarded_for: the ``X-Forwarded-For`` header (repeated headers joined by commas), or None.
        trusted: how many proxies to trust (``TRUSTED_PROXIES``); 0 ignores the header.

    Returns:
        The client address as text (normalised when it is an IP address), or ``"unknown"``.
    """
    if trusted > 0 and forwarded_for:
        hops = [h.strip() for h in forwarded_for.split(",")]
        if len(hops) >= trusted:
            candidate = _normalised_ip(hops[-trusted])
            if candidate is not None:
                return candidate
    return _normalised_ip(remote_addr or "") or remote_addr or "unknown"


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

    ``key:<digest>`` for a request authenticated with an API key (``wsgi_app.http.auth`` stores the digest in
    ``g.api_key_digest``), else ``addr:<client address>`` (see :func:`forwarded_client`). A bearer token
    sent while API keys are off is ignored: an unchecked token would let a client choose its own
    rate-limit bucket. The identity holds no secret, but still hash it (salted) before logging it.
    """
    digest = g.get("api_key_digest")
    if digest:
        return f"key:{digest}"
    return f"addr:{client_address()}"


def client_address() -> str:
    """Return the current request's client address (see :func:`forwarded_client`)."""
    return forwarded_client(
        request.remote_addr,
        request.headers.get("X-Forwarded-For"),
        runtime().settings.trusted_proxies,
    )
