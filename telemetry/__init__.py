"""Tracing, metrics and structured logs for greenserve.

Submodules are imported explicitly (``from telemetry import otlp``) rather than re-exported here:
``telemetry.otlp`` pulls in ``requests``, and gunicorn's master must not import ``ssl``/``urllib3``
before a gevent worker has monkey-patched (docs/ARCHITECTURE.md §15): importing this package stays cheap.

Dependencies: the standard library, ``requests``, ``gevent`` and ``prometheus_client`` only; never
Flask, ``wsgi_app`` or ``model``.
"""
