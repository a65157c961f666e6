"""Operational endpoints: liveness, readiness, and the loopback-only debug views.

Served on both the API port and the health port, so probes never queue behind API traffic.
"""

from __future__ import annotations

import gc
import ipaddress
import os

from flask import Blueprint, Response, request

from wsgi_app.errors import ApiError, json_bytes
from wsgi_app.runtime import runtime

bp = Blueprint("ops", __name__)


def _json(obj: object, status: int = 200) -> Response:
    return Response(json_bytes(obj), status=status, content_type="application/json")


@bp.get("/healthz")
def healthz() -> Response:
    """Answer 200 ``{"status":"ok"}`` while the worker's hub is responsive."""
    return _json({"status": "ok"})


@bp.get("/health")
def health() -> Response:
    """Liveness: 200 ``{"status":"ok"}`` while the worker runs."""
    return _json({"status": "ok"})


@bp.get("/ready")
def ready() -> Response:
    """Readiness: 200 when this worker should get traffic; 503 while draining or after an engine
    failure that leaves the engine untrustworthy."""
    rt = runtime()
    if rt.ready:
        return _json({"status": "ready"})
    reason = "draining" if rt.draining else "engine_failed"
    return _json({"status": "not_ready", "reason": reason}, 503)


def require_loopback() -> None:
    """Allow only a direct loopback peer: never a request that came through a proxy or from a page.

    Raises:
        ApiError: 404 for anyone else (the route does not exist for them).
    """
    try:
        direct = ipaddress.ip_address(request.remote_addr or "").is_loopback
    except ValueError:
        direct = False
    forwarded = any(h in request.headers for h in ("X-Forwarded-For", "Forwarded", "X-Real-IP"))
    # A browser sends Origin with every cross-site POST: a page open on the host must not be able to
    # drain the server (the operator's curl sends no Origin).
    from_page = "Origin" in request.headers
    if not direct or forwarded or from_page:
        raise ApiError(404, "Not found: no such route.", type="not_found_error")


@bp.get("/debug/state")
def debug_state() -> Response:
    """Slots, queue, in-flight requests and garbage-collector counts of the worker that answers
    (loopback clients only)."""
    require_loopback()
    rt = runtime()
    state = rt.admission.state()
    state["rate_limit"] = {"storage_errors": rt.rate_limit_storage_errors}
    # The collector's view: a worker whose full collections stall the hub shows it here first.
    state["gc"] = {
        "frozen": gc.get_freeze_count(),
        "counts": list(gc.get_count()),
        "collections": [generation["collections"] for generation in gc.get_stats()],
    }
    return _json({"pid": os.getpid(), "ready": rt.ready, "draining": rt.draining, **state})


@bp.post("/debug/drain")
def debug_drain() -> Response:
    """Turn ``/ready`` to 503 on the worker that answers, while it keeps serving (loopback only).

    With several workers, repeat until every worker answered (``pid`` tells which one did), or send
    the master SIGTERM to stop them all.
    """
    require_loopback()
    rt = runtime()
    rt.draining = True
    return _json({"status": "draining", "pid": os.getpid()})
