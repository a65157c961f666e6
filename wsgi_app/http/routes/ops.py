"""Operational endpoints: liveness, readiness, and the loopback-only debug views.

Served on both the API port and the health port, so probes never queue behind API traffic. A plain
``GET``/``HEAD`` of ``/healthz``, ``/health`` or ``/ready`` is answered by the worker before the app
(``wsgi_app.server.probes``); these routes answer the rest (a probe with a body or an ``Origin``, or
under another worker class), both with the answers ``wsgi_app.http.probes`` defines.
"""

from __future__ import annotations

import gc
import ipaddress
import os

from flask import Blueprint, Response, request

from wsgi_app.api.errors import ApiError
from wsgi_app.generation.registry import PRIMARY
from wsgi_app.http.error_handlers import json_response
from wsgi_app.http.probes import CONTENT_TYPE, probe_answer
from wsgi_app.http.runtime import runtime
from wsgi_app.server.probes import PROBE_PATHS

bp = Blueprint("ops", __name__)


def probe() -> Response:
    """Answer a health probe: liveness (``/healthz``, ``/health``) or readiness (``/ready``), as
    ``wsgi_app.http.probes`` defines them."""
    status, body = probe_answer(runtime(), request.path)
    return Response(body, status, content_type=CONTENT_TYPE)


# The paths the worker answers itself, so that what it passes on finds the same answer here.
for _path in sorted(PROBE_PATHS):
    bp.add_url_rule(_path, view_func=probe, methods=["GET"])


def loopback_host(host: str) -> bool:
    """True when ``host`` (a ``Host`` value) is ``localhost`` or a loopback IP literal, with or
    without a port: a page on another name (DNS rebinding) never gets the debug views.

    Source: RFC 9110 §7.2 (Host); RFC 3986 §3.2.2 (IP-literal in brackets).
    """
    name = host.strip().lower()
    if name.startswith("["):  # [::1] or [::1]:8000
        name, sep, port = name[1:].partition("]")
        if not sep or (port and not (port[0] == ":" and port[1:].isdigit())):
            return False
    else:
        name, _, port = name.partition(":")
        if port and not port.isdigit():
            return False
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_loopback() -> None:
    """Allow only a direct loopback peer that names a loopback host: never a request that came
    through a proxy, from a page, or for another host name (DNS rebinding).

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
    if not direct or forwarded or from_page or not loopback_host(request.host):
        raise ApiError(404, "Not found: no such route.", type="not_found_error")


@bp.get("/debug/state")
def debug_state() -> Response:
    """Slots, queue, in-flight requests and garbage-collector counts of the worker that answers
    (loopback clients only): those of its default model, each model's slots and queue under
    ``models`` (a canary or shadow variant's as ``name/variant``), and the shadow jobs under
    ``shadows``."""
    require_loopback()
    rt = runtime()
    state = rt.admission.state()
    state["rate_limit"] = {"storage_errors": rt.rate_limit_storage_errors}
    state["models"] = {}
    for served in rt.models.served:
        own = served.generation.admission.state()
        name = served.name if served.variant == PRIMARY else f"{served.name}/{served.variant}"
        state["models"][name] = {"slots": own["slots"], "queue": own["queue"]}
    prefix_cache = rt.engine.prefix_cache
    if prefix_cache is not None:  # the Llama engine's cached prompt blocks (PREFIX_CACHE=1)
        state["kv_cache_bytes"]["cached"] = prefix_cache.nbytes
        state["prefix_cache"] = prefix_cache.state()
    # the default model's compiled output constraints (structured outputs, tool calls)
    state["grammars"] = rt.generation.grammars.state()
    if rt.shadows is not None:  # the shadow variants' jobs: waiting and running
        state["shadows"] = rt.shadows.state()
    # The collector's view: a worker whose full collections stall the hub shows it here first.
    state["gc"] = {
        "frozen": gc.get_freeze_count(),
        "counts": list(gc.get_count()),
        "collections": [generation["collections"] for generation in gc.get_stats()],
    }
    return json_response({"pid": os.getpid(), "ready": rt.ready, "draining": rt.draining, **state})


@bp.post("/debug/drain")
def debug_drain() -> Response:
    """Drain the whole server: ``/ready`` answers 503 from every worker while they keep serving, until
    ``DELETE /debug/drain`` (loopback only). A SIGHUP reload keeps it; a new start clears it."""
    require_loopback()
    runtime().set_drained(True)
    return json_response({"status": "draining", "pid": os.getpid()})


@bp.delete("/debug/drain")
def debug_undrain() -> Response:
    """Undo ``POST /debug/drain``: ``/ready`` answers 200 again from every worker (loopback only)."""
    require_loopback()
    rt = runtime()
    rt.set_drained(False)
    return json_response({"status": "ready" if rt.ready else "not_ready", "pid": os.getpid()})
