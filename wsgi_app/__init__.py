"""The greenserve WSGI app: HTTP routes, validation, SSE, admission.

Use ``create_app()`` as gunicorn's app (``wsgi_app:create_app()``); it builds the per-worker state.
Importing this package stays light (no Flask): ``gunicorn.conf.py`` reads ``wsgi_app.settings`` in the
master, before gevent patches the workers, and nothing there may import ``ssl`` unpatched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask

    from wsgi_app.settings import Settings


def create_app(settings: Settings | None = None, clock: Callable[[], float] | None = None) -> Flask:
    """Create the app and load the model (once per worker); see :func:`wsgi_app.app.create_app`."""
    from wsgi_app.app import create_app as build

    return build(settings, clock)
