"""OTLP/HTTP JSON encoding (golden vectors) and the span exporter against a fake collector.

How gevent is used here: the tests do not monkey-patch (patching inside pytest would turn every
later test's threads and sockets into greenlets). The exporter's worker greenlet runs on this
thread's hub whenever the test yields (``flush()`` waits on a gevent Event, ``gevent.sleep``).
Unpatched, its ``requests`` call blocks the whole OS thread while in flight, which is harmless
here because the FakeCollector answers from its own OS thread. Production runs in a patched
gunicorn gevent worker, where the same call is cooperative;
``test_slow_collector_does_not_stall_hub`` checks exactly that in a patched subprocess.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gevent
import pytest

from telemetry.otlp import NullExporter, SpanExporter, encode_spans, traces_url
from telemetry.spans import Span
from tests.collector import FakeCollector
from tests.server import SLACK_S, wait_until

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
ROOT = Path(__file__).resolve().parents[1]


def make_span(name: str = "POST /v1/completions", span_id: str = "b7ad6b7169203331") -> Span:
    return Span(
        name=name,
        trace_id=TID,
        span_id=span_id,
        parent_span_id=PARENT,
        start_ns=1_700_000_000_123_456_789,
        end_ns=1_700_000_000_987_654_321,
        attributes={"i": 1},
    )


def numbered(n: int) -> list[Span]:
    return [make_span(f"s{i}", f"{i + 1:016x}") for i in range(n)]


def test_golden_encoding() -> None:
    span = Span(
        name="POST /v1/completions",
        trace_id=TID,
        span_id="b7ad6b7169203331",
        parent_span_id=PARENT,
        start_ns=1_700_000_000_123_456_789,
        end_ns=1_700_000_000_987_654_321,
        attributes={
            "http.request.method": "POST",
            "http.response.status_code": 500,
            "gen_ai.request.temperature": 0.5,
            "greenserve.stream": True,
        },
        status_code=2,
        status_message="engine failed",
    )
    assert encode_spans([span], service_name="greenserve-test", scope_version="0.1.0") == {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": "service.name", "value": {"stringValue": "greenserve-test"}}
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "greenserve", "version": "0.1.0"},
                        "spans": [
                            {
                                "traceId": TID,
                                "spanId": "b7ad6b7169203331",
                                "parentSpanId": PARENT,
                                "name": "POST /v1/completions",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000123456789",
                                "endTimeUnixNano": "1700000000987654321",
                                "attributes": [
                                    {
                                        "key": "http.request.method",
                                        "value": {"stringValue": "POST"},
                                    },
                                    {
                                        "key": "http.response.status_code",
                                        "value": {"intValue": "500"},
                                    },
                                    {
                                        "key": "gen_ai.request.temperature",
                                        "value": {"doubleValue": 0.5},
                                    },
                                    {"key": "greenserve.stream", "value": {"boolValue": True}},
                                ],
                                "status": {"code": 2, "message": "engine failed"},
                            }
                        ],
                    }
                ],
            }
        ]
    }


def test_root_span_omits_parent_and_empty_message() -> None:
    span = Span(name="GET /healthz", trace_id=TID, span_id="0000000000000001",
                parent_span_id=None, start_ns=1, end_ns=2)  # fmt: skip
    out = encode_spans([span], service_name="s", scope_name="sc", scope_version="9")
    scope_spans = out["resourceSpans"][0]["scopeSpans"][0]
    assert scope_spans["scope"] == {"name": "sc", "version": "9"}
    assert scope_spans["spans"] == [
        {
            "traceId": TID,
            "spanId": "0000000000000001",
            "name": "GET /healthz",
            "kind": 2,
            "startTimeUnixNano": "1",
            "endTimeUnixNano": "2",
            "attributes": [],
            "status": {"code": 0},
        }
    ]
    assert json.dumps(out, separators=(",", ":")) == (
        '{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":'
        '{"stringValue":"s"}}]},"scopeSpans":[{"scope":{"name":"sc","version":"9"},"spans":'
        '[{"traceId":"4bf92f3577b34da6a3ce929d0e0e4736","spanId":"0000000000000001",'
        '"name":"GET /healthz","kind":2,"startTimeUnixNano":"1","endTimeUnixNano":"2",'
        '"attributes":[],"status":{"code":0}}]}]}]}'
    )


def test_attribute_values() -> None:
    span = make_span()
    span.attributes = {"f": False, "t": True, "big": 2**63 - 1, "neg": -7, "z": 0.0,
                       "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
                       "u": "é"}  # fmt: skip
    attrs = encode_spans([span], service_name="s")["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert attrs["attributes"] == [
        {"key": "f", "value": {"boolValue": False}},
        {"key": "t", "value": {"boolValue": True}},
        {"key": "big", "value": {"intValue": "9223372036854775807"}},
        {"key": "neg", "value": {"intValue": "-7"}},
        {"key": "z", "value": {"doubleValue": 0.0}},
        {"key": "nan", "value": {"doubleValue": "NaN"}},
        {"key": "inf", "value": {"doubleValue": "Infinity"}},
        {"key": "ninf", "value": {"doubleValue": "-Infinity"}},
        {"key": "u", "value": {"stringValue": "é"}},
    ]


def test_several_spans_share_one_scope() -> None:
    out = encode_spans(numbered(3), service_name="s")
    assert len(out["resourceSpans"]) == 1
    spans = out["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["spanId"] for s in spans] == [f"{i:016x}" for i in (1, 2, 3)]


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example/prefix/", "https://otel.example/prefix/v1/traces"),
        ("https://otel.example/prefix", "https://otel.example/prefix/v1/traces"),
    ],
)
def test_traces_url(base: str, expected: str) -> None:
    assert traces_url(base) == expected


def test_traces_endpoint_used_as_is() -> None:
    assert traces_url("http://a:4318", traces_endpoint="http://b/custom") == "http://b/custom"
    assert traces_url("http://a:4318", traces_endpoint="") == "http://a:4318/v1/traces"


# ---- exporter -------------------------------------------------------------------------------


@pytest.fixture
def exporter_factory() -> Iterator[Callable[..., SpanExporter]]:
    made: list[SpanExporter] = []

    def make(endpoint: str, **kw: object) -> SpanExporter:
        kw = {"service_name": "test", "initial_backoff_s": 0.01, "max_backoff_s": 0.1, **kw}
        exp = SpanExporter(endpoint, **kw)  # type: ignore[arg-type]
        made.append(exp)
        return exp

    yield make
    for exp in made:
        exp.shutdown(1.0)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/traces"


def test_export_posts_compact_json(exporter_factory) -> None:
    spans = numbered(3)
    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, headers={"Authorization": "Bearer k"})
        for span in spans:
            exp.export(span)
        assert exp.flush(5.0) is True
        (attempt,) = col.attempts()
    assert (exp.sent, exp.dropped, exp.failed) == (3, 0, 0)
    assert attempt.headers["content-type"] == "application/json"
    assert attempt.headers["authorization"] == "Bearer k"
    payload = encode_spans(spans, service_name="test")
    assert attempt.body == json.dumps(payload, separators=(",", ":")).encode()


def test_batches_up_to_max_batch(exporter_factory) -> None:
    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, max_batch=2)
        for span in numbered(5):
            exp.export(span)
        assert exp.flush(5.0)
        sizes = [len(a.spans) for a in col.attempts()]
        names = [s["name"] for s in col.spans()]
    assert sizes == [2, 2, 1]
    assert names == ["s0", "s1", "s2", "s3", "s4"]
    assert exp.sent == 5


def test_worker_sends_without_flush(exporter_factory) -> None:
    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, schedule_delay_s=0.05)
        exp.export(make_span())
        assert exp.sent == 0  # export() only queues; nothing happens until the caller yields
        wait_until(lambda: exp.sent == 1, 5, "the worker to send", sleep=gevent.sleep)
        assert len(col.spans()) == 1


def test_retry_503_then_success_delivers_once(exporter_factory) -> None:
    with FakeCollector(statuses=[503, 503, 200]) as col:
        exp = exporter_factory(col.traces_url)
        for span in numbered(4):
            exp.export(span)
        assert exp.flush(5.0)
        statuses = [a.status for a in col.attempts()]
        accepted = [s["spanId"] for s in col.spans()]
    assert statuses == [503, 503, 200]
    assert accepted == [f"{i:016x}" for i in (1, 2, 3, 4)]
    assert (exp.sent, exp.failed, exp.dropped) == (4, 0, 0)


@pytest.mark.parametrize("status", [429, 502, 504])
def test_other_retryable_statuses(exporter_factory, status: int) -> None:
    with FakeCollector(statuses=[status, 200]) as col:
        exp = exporter_factory(col.traces_url)
        exp.export(make_span())
        assert exp.flush(5.0)
        assert [a.status for a in col.attempts()] == [status, 200]
    assert (exp.sent, exp.failed) == (1, 0)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 500])
def test_non_retryable_status_fails_once(exporter_factory, status: int) -> None:
    with FakeCollector(statuses=[status]) as col:
        exp = exporter_factory(col.traces_url)
        for span in numbered(3):
            exp.export(span)
        assert exp.flush(5.0)
        assert [a.status for a in col.attempts()] == [status]
    assert (exp.sent, exp.failed, exp.dropped) == (0, 3, 0)


def test_retry_after_is_honoured(exporter_factory) -> None:
    with FakeCollector(statuses=[(503, {"Retry-After": "1"}), 200]) as col:
        exp = exporter_factory(col.traces_url)
        exp.export(make_span())
        assert exp.flush(5.0)
        first, second = col.attempts()
    assert 1.0 <= second.received_s - first.received_s < 1.0 + SLACK_S  # not the 0.01 s backoff
    assert exp.sent == 1


def test_retry_after_past_deadline_gives_up_at_once(exporter_factory) -> None:
    with FakeCollector(statuses=[(429, {"Retry-After": "30"})]) as col:
        exp = exporter_factory(col.traces_url, max_elapsed_s=2.0)
        exp.export(make_span())
        t0 = time.monotonic()
        assert exp.flush(5.0)
        assert time.monotonic() - t0 < 2.0 / 2  # at once, not at max_elapsed_s
        assert len(col.attempts()) == 1
    assert (exp.sent, exp.failed) == (0, 1)


def test_dead_endpoint_fails_within_max_elapsed(exporter_factory) -> None:
    exp = exporter_factory(closed_port_url(), max_elapsed_s=0.5)
    for span in numbered(2):
        exp.export(span)
    t0 = time.monotonic()
    assert exp.flush(5.0)
    elapsed = time.monotonic() - t0
    # It did retry (backoff 0.01 s doubling), but stopped at max_elapsed_s (0.5 s).
    assert 0.2 < elapsed < 0.5 + SLACK_S
    assert (exp.sent, exp.failed, exp.dropped) == (0, 2, 0)


def test_timeouts_are_retried_then_given_up(exporter_factory) -> None:
    with FakeCollector(delay_s=0.3) as col:
        exp = exporter_factory(col.traces_url, timeout_s=0.1, max_elapsed_s=0.5)
        exp.export(make_span())
        assert exp.flush(5.0)
        assert (exp.sent, exp.failed) == (0, 1)
        # The collector records a request once it has answered it, after the client gave up.
        wait_until(lambda: len(col.attempts()) >= 2, 5, "the abandoned request to be retried")


def test_queue_overflow_drops_oldest(exporter_factory) -> None:
    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, max_queue=3)
        for span in numbered(5):
            exp.export(span)  # never yields, so the worker cannot drain in between
        assert exp.dropped == 2
        assert exp.flush(5.0)
        names = [s["name"] for s in col.spans()]
    assert names == ["s2", "s3", "s4"]
    assert (exp.sent, exp.dropped, exp.failed) == (3, 2, 0)


def test_shutdown_flushes_then_drops(exporter_factory) -> None:
    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, schedule_delay_s=10.0)
        for span in numbered(4):
            exp.export(span)
        exp.shutdown(5.0)
        assert [s["name"] for s in col.spans()] == ["s0", "s1", "s2", "s3"]
        exp.export(make_span())
        exp.shutdown(5.0)  # idempotent
        assert exp.flush(1.0) is True
        gevent.sleep(0.05)
        assert len(col.attempts()) == 1
    assert (exp.sent, exp.dropped, exp.failed) == (4, 1, 0)


def test_shutdown_timeout_counts_in_flight_and_queued(exporter_factory) -> None:
    with FakeCollector(statuses=[503] * 1000) as col:
        exp = exporter_factory(col.traces_url, max_batch=2, max_elapsed_s=30.0)
        for span in numbered(3):
            exp.export(span)
        t0 = time.monotonic()
        exp.shutdown(0.3)
        assert time.monotonic() - t0 < 0.3 + SLACK_S  # the shutdown's timeout
        assert len(col.spans()) == 0
    # The batch being retried is given up; the span still queued never left.
    assert (exp.sent, exp.failed, exp.dropped) == (0, 2, 1)


def test_flush_times_out_while_retrying(exporter_factory) -> None:
    with FakeCollector(statuses=[503, 503, 503, 503, 503, 503]) as col:
        exp = exporter_factory(col.traces_url, initial_backoff_s=0.1, max_backoff_s=0.1)
        exp.export(make_span())
        assert exp.flush(0.2) is False
        assert exp.flush(5.0) is True
        assert len(col.spans()) == 1
    assert (exp.sent, exp.failed) == (1, 0)


def test_export_never_raises_and_worker_survives(exporter_factory) -> None:
    results: list[tuple[str, int]] = []

    def on_result(kind: str, n: int) -> None:
        results.append((kind, n))
        raise RuntimeError("a broken metrics hook")

    with FakeCollector() as col:
        exp = exporter_factory(col.traces_url, on_result=on_result)
        exp.export(object())  # type: ignore[arg-type]  # not a Span: encoding fails
        assert exp.flush(5.0)
        exp.export(make_span())
        assert exp.flush(5.0)
        assert len(col.spans()) == 1
    assert results == [("failed", 1), ("sent", 1)]
    assert (exp.sent, exp.failed) == (1, 1)


def test_null_exporter() -> None:
    exp = NullExporter()
    exp.start()
    exp.export(make_span())
    assert exp.flush(0.0) is True
    exp.shutdown()
    assert (exp.sent, exp.dropped, exp.failed) == (0, 0, 0)


PATCHED_SCRIPT = """
from gevent import monkey; monkey.patch_all()
import time, gevent
from telemetry.otlp import SpanExporter
from telemetry.spans import start_server_span
from tests.collector import FakeCollector

with FakeCollector(delay_s=0.5) as col:
    exp = SpanExporter(col.traces_url, service_name="t")
    span = start_server_span("x", None); span.end()
    exp.export(span)
    gaps, last = [], time.monotonic()
    def tick():
        global last
        while True:
            gevent.sleep(0.01); now = time.monotonic(); gaps.append(now - last); last = now
    ticker = gevent.spawn(tick)
    ok = exp.flush(5.0)
    ticker.kill()
    print(ok, exp.sent, len(col.spans()), len(gaps) > 20, max(gaps) < 0.2)
"""


def test_slow_collector_does_not_stall_hub() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PATCHED_SCRIPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "1", "True", "True"]
