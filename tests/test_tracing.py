"""Server spans exported as OTLP/HTTP JSON to a real (fake) collector."""

from __future__ import annotations

import json
import re
import time

import pytest

from model import __version__
from tests.collector import FakeCollector
from tests.server import wait_until

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def traced(succ_dir, collector, serve_module):
    srv = serve_module(
        MODEL_DIR=str(succ_dir),
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_SERVICE_NAME="greenserve-test",
    )
    return srv, collector


def _attrs(span: dict) -> dict:
    return {a["key"]: a["value"] for a in span["attributes"]}


def test_span_joins_the_callers_trace(traced):
    srv, collector = traced
    status, _, _ = srv.complete(
        {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0},
        headers={"traceparent": PARENT, "X-Request-Id": "trace-child-1"},
    )
    assert status == 200
    span = collector.span_for("trace-child-1")
    assert span["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span["parentSpanId"] == "00f067aa0ba902b7"
    assert re.fullmatch(r"[0-9a-f]{16}", span["spanId"]) and span["spanId"] != "00f067aa0ba902b7"
    assert span["kind"] == 2
    assert span["name"] == "POST /v1/completions"
    assert int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"]) > 1_600_000_000 * 10**9
    attrs = _attrs(span)
    assert attrs["http.response.status_code"] == {"intValue": "200"}
    assert attrs["http.request.method"] == {"stringValue": "POST"}
    assert attrs["gen_ai.usage.input_tokens"] == {"intValue": "1"}
    assert attrs["gen_ai.usage.output_tokens"] == {"intValue": "3"}
    assert attrs["gen_ai.response.finish_reasons"] == {"stringValue": "length"}
    # The resource names the service.
    payload = next(a.payload for a in collector.attempts() if "trace-child-1" in a.body.decode())
    resource = payload["resourceSpans"][0]["resource"]["attributes"]
    assert {"key": "service.name", "value": {"stringValue": "greenserve-test"}} in resource
    # The instrumentation scope carries greenserve's one version (as X-Model-Version does).
    scope = payload["resourceSpans"][0]["scopeSpans"][0]["scope"]
    assert scope == {"name": "greenserve", "version": __version__}


@pytest.mark.parametrize(
    "header",
    [
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
        "garbage",
    ],
)
def test_invalid_traceparent_starts_a_new_trace(traced, header):
    srv, collector = traced
    rid = f"bad-tp-{abs(hash(header))}"
    srv.complete(
        {"model": "m", "prompt": "a", "max_tokens": 1},
        headers={"traceparent": header, "X-Request-Id": rid},
    )
    span = collector.span_for(rid)
    assert "parentSpanId" not in span
    assert re.fullmatch(r"[0-9a-f]{32}", span["traceId"])
    assert span["traceId"] != "0" * 32 and span["traceId"] != "4bf92f3577b34da6a3ce929d0e0e4736"


def test_stream_span_and_error_status(traced):
    srv, collector = traced
    srv.complete(
        {"model": "m", "prompt": "a", "max_tokens": 4, "stream": True},
        headers={"X-Request-Id": "trace-stream"},
    )
    span = collector.span_for("trace-stream")
    assert _attrs(span)["gen_ai.usage.output_tokens"] == {"intValue": "4"}
    srv.complete({"model": "m"}, headers={"X-Request-Id": "trace-400"})
    span = collector.span_for("trace-400")
    assert _attrs(span)["http.response.status_code"] == {"intValue": "400"}
    srv.get("/nope", headers={"X-Request-Id": "trace-404"})
    assert collector.span_for("trace-404")["name"] == "GET"


@pytest.mark.parametrize("mode", ["down", "slow"])
def test_dead_or_slow_collector_does_not_delay_answers(succ_dir, serve, mode):
    if mode == "slow":
        ctx = FakeCollector(delay_s=5.0)
    else:
        ctx = FakeCollector()
    with ctx as collector:
        url = collector.url
        if mode == "down":
            collector.close()  # nothing listens on that port any more
        srv = serve(MODEL_DIR=str(succ_dir), OTEL_EXPORTER_OTLP_ENDPOINT=url)
        body = {"model": "m", "prompt": "a", "max_tokens": 8, "temperature": 0}
        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            status, _, raw = srv.complete(body)
            latencies.append(time.perf_counter() - started)
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == "bcdefghi"
        # The exporter posts from its own greenlet: no answer waits for the 5 s collector.
        assert max(latencies) < 5.0 / 2, latencies


def test_lost_spans_are_logged_once_per_outage(succ_dir, serve):
    # Two outages (the collector refuses batches with a 400, which is not retried), each followed by
    # an accepted batch: one warning as each begins, one line with its count as each ends.
    with FakeCollector(statuses=[400, 400, 200, 400, 200]) as collector:
        srv = serve(MODEL_DIR=str(succ_dir), OTEL_EXPORTER_OTLP_ENDPOINT=collector.url)
        for wave in range(5):  # one batch per wave: the exporter posts every 0.5 s
            for i in range(3):
                srv.get("/v1/models", headers={"X-Request-Id": f"wave-{wave}-{i}"})
            wait_until(lambda w=wave: len(collector.attempts()) > w, what=f"post {wave + 1}")
        srv.stop()
    lines = [json.loads(x) for x in srv.log_text().splitlines() if "span export to" in x]
    where = collector.url.replace("http://", "")
    posts = collector.attempts()
    assert [a.status for a in posts[:5]] == [400, 400, 200, 400, 200]
    first, second = len(posts[0].spans) + len(posts[1].spans), len(posts[3].spans)
    assert [(x["level"], x["message"]) for x in lines] == [
        (
            "WARNING",
            f"span export to http://{where} failing: spans are being failed (one line "
            "per outage; greenserve_exported_spans_total counts them)",
        ),
        ("INFO", f"span export to http://{where} recovered: {first} spans lost during the outage"),
        (
            "WARNING",
            f"span export to http://{where} failing: spans are being failed (one line "
            "per outage; greenserve_exported_spans_total counts them)",
        ),
        ("INFO", f"span export to http://{where} recovered: {second} spans lost during the outage"),
    ]
