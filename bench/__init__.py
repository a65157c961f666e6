"""Reproducible load benchmarks for greenserve: ``python -m bench.run [--quick]``.

Test-only: nothing in ``wsgi_app``, ``model`` or ``telemetry`` imports this package.
"""
