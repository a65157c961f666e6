"""Prometheus metrics read in tests: a live server's ``/metrics`` parsed with prometheus_client's own
parser, one sample's value, and the samples of an in-process registry.

Source: the Prometheus text exposition format (as ``prometheus_client.parser`` reads it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.server import GunicornServer


def scrape(srv: GunicornServer, port: int | None = None) -> dict[str, dict[tuple, float]]:
    """Parse ``/metrics`` with prometheus_client's own parser: {family: {(sample, labels): value}}.

    ``port`` defaults to the API port (pass ``srv.health_port`` for the health port); labels are a
    sorted tuple of ``(name, value)`` pairs.
    """
    status, headers, body = srv.get("/metrics", port=port)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        out[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
        }
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """Return one sample of a :func:`scrape` result: ``sample`` (default: the family's own name) of
    ``family`` with exactly ``labels``.

    Raises:
        KeyError: no such family or sample.
    """
    return metrics[family][(sample or family, tuple(sorted(labels.items())))]


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    """Return every sample of ``registry`` as ``{(name, sorted labels): value}``, the ``_created``
    timestamps left out (they differ between two registries fed the same observations)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }
