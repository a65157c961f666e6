"""Operational endpoints: liveness and readiness probes.

Served on both the API port and the health port, so probes never queue behind API traffic.
"""

from __future__ import annotations

from flask import Blueprint, Response

from wsgi_app.errors import json_bytes

bp = Blueprint("ops", __name__)


def _ok() -> Response:
    return Response(json_bytes({"status": "ok"}), content_type="application/json")


@bp.get("/healthz")
def healthz() -> Response:
    """Answer 200 ``{"status":"ok"}`` while the worker's hub is responsive."""
    return _ok()


@bp.get("/health")
def health() -> Response:
    """Liveness: 200 ``{"status":"ok"}`` while the worker runs."""
    return _ok()
