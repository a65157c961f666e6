"""``GET /`` (the streamed demo) and ``GET /status`` (charts and SLOs): the two pages for people.

Both are Jinja templates (``wsgi_app/templates``) with hand-written CSS, SVG charts and JavaScript
served from ``/assets/<name>`` (``wsgi_app/assets``; both directories are package data). Nothing comes
from another origin: no CDN, no chart library, and the ``Content-Security-Policy`` of every page makes
the browser refuse anything but this server. The demo streams a completion through ``EventSource`` on
the ``GET /v1/completions`` stream, passing the optional API key as ``api_key`` (``EventSource`` cannot
send headers); its chat mode (when the worker has a chat template) streams each answer on the
``GET /v1/chat/completions`` stream with the whole conversation as ``messages``; the status page
polls ``/stats`` and ``/stats/history``. With ``PAGES=0`` the blueprint is not registered, so the
pages and their assets are 404.

Source: docs/ARCHITECTURE.md §8; WHATWG HTML Living Standard §9.2 (``EventSource``); W3C CSP Level 3.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from functools import cache
from pathlib import Path

from flask import Blueprint, Response, render_template, request

from wsgi_app.api.completions import MAX_TOKENS_LIMIT
from wsgi_app.api.errors import ApiError
from wsgi_app.http.runtime import runtime

# The templates stay package data of wsgi_app itself (beside the assets), not of this subpackage.
bp = Blueprint("pages", __name__, template_folder=str(Path(__file__).parents[2] / "templates"))

ASSET_DIR = "assets"
# Every file the pages load, with its media type: the route serves these names and nothing else.
ASSETS = {
    "pages.css": "text/css; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "demo.js": "text/javascript; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# Same-origin only: scripts, styles, images and fetch/EventSource all come from this server.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
STATUS_REFRESH_S = 5  # how often the status page polls /stats and /stats/history, seconds
# ``prompt`` travels in the GET stream's query string, which gunicorn caps at ``limit_request_line``
# (8190 bytes); percent-encoding can triple a character, so the box holds at most this many.
PROMPT_MAX_CHARS = 2000


@cache
def asset_bytes(name: str) -> bytes:
    """Return the bytes of the asset ``name`` (read from the package once per process).

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    return importlib.resources.files("wsgi_app").joinpath(ASSET_DIR, name).read_bytes()


def _page(template: str, **context: object) -> Response:
    rt = runtime()
    html = render_template(
        template,
        model_id=rt.models.default.name,  # the id /v1/models lists (the default model's)
        model_version=rt.model_version,
        **context,
    )
    return Response(html, content_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@bp.get("/")
def demo() -> Response:
    """The demo: a prompt (or a conversation, in chat mode), sampling settings, and the answer streaming
    in with TTFT and tokens/s."""
    rt = runtime()
    context = rt.model.context_length
    llama = rt.model.engine_kind == "llama"
    return _page(
        "demo.html",
        keys_required=bool(rt.settings.api_keys),
        # A transformer's context bounds prompt + completion; leave room for a short prompt.
        max_tokens_limit=MAX_TOKENS_LIMIT
        if context is None
        else min(MAX_TOKENS_LIMIT, context // 2),
        prompt_max_chars=PROMPT_MAX_CHARS,
        default_prompt="Once upon a time" if llama else "ROMEO:",
        # Every model chats (the default template counts); the page offers chat when one is loaded.
        chat_template=rt.chat_template is not None,
    )


@bp.get("/status")
def status() -> Response:
    """The status page: traffic, latency and error charts, the TTFT objective and the error budget."""
    settings = runtime().settings
    return _page(
        "status.html",
        slo_ttft_s=settings.slo_ttft_s,
        slo_target=settings.slo_target,
        refresh_s=STATUS_REFRESH_S,
    )


@bp.get("/assets/<name>")
def asset(name: str) -> Response:
    """Serve one of the pages' files, with an ``ETag`` (revalidated, so an upgrade shows at once).

    Raises:
        ApiError: 404 for a name that is not one of ``ASSETS``.
    """
    if name not in ASSETS:
        raise ApiError(404, "Not found: no such asset.", type="not_found_error")
    body = asset_bytes(name)
    response = Response(body, content_type=ASSETS[name])
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.set_etag(hashlib.sha256(body).hexdigest()[:32])
    return response.make_conditional(request)
