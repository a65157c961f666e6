"""The Prometheus files in deploy/prometheus/: valid for ``promtool``, their unit tests pass (alerts
that must and must not fire), every alert is exercised, and every metric they read is one a real
server exports."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from telemetry.metrics import Metrics
from tests.needs import binary
from tests.server import ROOT

PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "greenserve.rules.yml"
RULE_TESTS = PROM / "greenserve.rules.test.yml"


def promtool(*args: str) -> str:
    """Run ``promtool`` in deploy/prometheus/ and return its output; skip without it (never in CI)."""
    promtool = binary("promtool", "prometheus")
    proc = subprocess.run([promtool, *args], cwd=PROM, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.services
def test_rules_and_config_check():
    assert "SUCCESS: 27 rules found" in promtool("check", "rules", RULES.name)
    assert "is valid prometheus config file syntax" in promtool("check", "config", "prometheus.yml")


@pytest.mark.services
def test_rule_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", RULE_TESTS.name)


def test_every_alert_is_tested_firing():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert len(alerts) == 14
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == alerts


def test_rules_read_only_exported_metrics(succ_server, succ_dir):
    # greenserve_requests_total has its first sample once a request was answered.
    assert succ_server.complete({"model": "m", "prompt": "a", "max_tokens": 1})[0] == 200
    status, _, body = succ_server.get("/metrics", port=succ_server.health_port)
    assert status == 200
    exported = set(re.findall(r"^(greenserve_\w+)", body.decode(), re.MULTILINE))
    # Metric names, not the level:name:operations of recording rules.
    used = set(re.findall(r"(?<![:\w])(greenserve_\w+)", RULES.read_text()))
    assert used == {
        "greenserve_requests_total",
        "greenserve_time_to_first_token_seconds_bucket",
        "greenserve_time_to_first_token_seconds_count",
        "greenserve_requests_queued",
        "greenserve_rate_limit_storage_errors_total",
        "greenserve_exported_spans_total",
        "greenserve_workers_ready",
        "greenserve_workers",
        "greenserve_shadow_requests_total",
    }
    # A shadow's series exist once a models file has one (this server has none): the name the
    # rule reads is the one the worker's metrics export for a shadow.
    registry = CollectorRegistry()
    Metrics.create(registry).add_shadow("m", "next")
    shadow = set(re.findall(r"^(greenserve_shadow\w+)", generate_latest(registry).decode(), re.M))
    assert used <= exported | shadow, used - exported - shadow
    # The TTFT objective's bucket (SLO_TTFT_S = 1 s) is one the histogram has, and the series carry
    # the model and variant the per-variant rules group by (the session's server: counts vary).
    model = succ_dir.name
    assert (
        f'greenserve_time_to_first_token_seconds_bucket{{le="1.0",model="{model}",'
        f'variant="primary"}} '
    ).encode() in body
    assert (
        f'greenserve_requests_total{{end_reason="finished",endpoint="/v1/completions",'
        f'finish_reason="length",model="{model}",status="200",variant="primary"}} '
    ).encode() in body
