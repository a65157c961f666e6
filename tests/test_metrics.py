"""Prometheus metrics: exact counts summed over gunicorn workers, parseable exposition, no gauge
left behind by a killed worker, span-export counters; plus the pure pieces (quantiles, bucket adds)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from telemetry.batch import Observation
from telemetry.exposition import render, summarize
from telemetry.metrics import ITL_BUCKETS, Metrics, add_bucket_counts
from telemetry.quantiles import bucket_index, cumulate, histogram_quantile
from tests.collector import FakeCollector
from tests.scrape import samples, scrape, value
from tests.server import GunicornServer, concurrently, wait_until
from tests.sse import EventReader, sse_json

BUCKETS = [(0.1, 2), (0.5, 6), (1.0, 8), (math.inf, 10)]


# -- pure pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.1, 0.05), (0.5, 0.4), (0.7, 0.75), (0.8, 1.0), (0.95, 1.0), (1.0, 1.0)],
)
def test_histogram_quantile_known_answers(q, expected):
    # rank q*10; linear inside the bucket; the lowest bucket starts at 0; +Inf answers the top bound.
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected, abs=1e-12)


def test_histogram_quantile_edge_cases():
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None
    assert histogram_quantile(0.5, [(1.0, 3)]) is None  # no +Inf bucket
    assert histogram_quantile(0.5, list(reversed(BUCKETS))) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="q must be in 0..1"):
        histogram_quantile(1.5, BUCKETS)


def test_bucket_index_and_cumulate():
    bounds = (0.1, 0.5, 1.0)
    assert [bucket_index(bounds, v) for v in (0.0, 0.1, 0.10001, 0.5, 1.0, 7.0)] == [
        0,
        0,
        1,
        1,
        2,
        3,
    ]
    assert cumulate(bounds, [2, 4, 2, 2]) == BUCKETS
    with pytest.raises(ValueError, match="expected 4 entries, got 3"):
        cumulate(bounds, [1, 2, 3])


def test_summary_per_model_and_variant():
    reg = CollectorRegistry()
    m = Metrics.create(reg)
    m.declare_models([("loop", "primary"), ("loop", "v2"), ("other", "primary")])
    loop, canary = {"model": "loop", "variant": "primary"}, {"model": "loop", "variant": "v2"}
    for ttft in (0.002, 0.003, 0.04):  # buckets (0.001, 0.0025], (0.0025, 0.005], (0.025, 0.05]
        done = Observation("/v1/completions", 200, "length", "finished", 1, 4, ttft, 0.1, 0.0)
        m.observe_request(**done._replace(**loop)._asdict())
    # An error after the first byte, a 5xx before it, a refusal: two errors of three requests.
    late = Observation("/v1/completions", 200, "error", "engine_error", 1, 2, 0.004, 0.1, 0.0)
    m.observe_request(**late._replace(**canary)._asdict())
    busy = Observation("/v1/completions", 503, "error", "none", 0, 0, None, None, None)
    m.observe_request(**busy._replace(**canary)._asdict())
    bad = Observation("/v1/completions", 400, "none", "none", 0, 0, None, None, None)
    m.observe_request(**bad._replace(**canary)._asdict())
    m.observe_request(**bad._asdict())  # picked no model: the totals only
    m.set_load({("loop", "v2"): (2, 1), ("other", "primary"): (1, 0)})
    s = summarize(reg)
    assert (s["requests"], s["failed"]) == (7, 2)
    assert (s["running"], s["queued"]) == (3, 1)  # the load: the sums of the rows'
    empty = {"count": 0, "mean": None, "p50": None, "p90": None}
    assert s["models"] == {
        "loop": {
            "primary": {
                "requests": 3,
                "errors": 0,
                "generation_tokens": 12,
                "running": 0,
                "queued": 0,
                # rank 1.5 of 3: half-way through (0.0025, 0.005]; rank 2.7: 0.7 of (0.025, 0.05]
                "ttft": {
                    "count": 3,
                    "mean": pytest.approx(0.045 / 3),
                    "p50": pytest.approx(0.00375),
                    "p90": pytest.approx(0.0425),
                },
            },
            "v2": {
                "requests": 3,
                "errors": 2,
                "generation_tokens": 2,
                "running": 2,
                "queued": 1,
                "ttft": {"count": 1, "mean": 0.004, "p50": 0.00375, "p90": pytest.approx(0.00475)},
            },
        },
        "other": {
            "primary": {
                "requests": 0,
                "errors": 0,
                "generation_tokens": 0,
                "running": 1,
                "queued": 0,
                "ttft": empty,
            }
        },
    }


def test_add_bucket_counts_equals_one_observe_per_value():
    values = [0.000004, 0.00001, 0.00003, 0.0007, 0.0007, 0.2, 3.0, 0.01]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("itl_seconds", "x", buckets=ITL_BUCKETS, registry=one)
    h2 = Histogram("itl_seconds", "x", buckets=ITL_BUCKETS, registry=many)
    for v in values:
        h1.observe(v)
    counts = [0] * (len(ITL_BUCKETS) + 1)
    for v in values:
        counts[bucket_index(ITL_BUCKETS, v)] += 1
    add_bucket_counts(h2, counts, sum(values))
    assert samples(one) == samples(many)
    assert samples(many)[("itl_seconds_count", ())] == 8
    with pytest.raises(ValueError, match="expected 16 entries"):
        add_bucket_counts(h2, [1, 2], 0.0)


def test_metrics_are_per_registry_and_summarize_exactly():
    reg = CollectorRegistry()
    m = Metrics.create(reg)
    Metrics.create(CollectorRegistry())  # no module-level state: a second set is independent
    with pytest.raises(ValueError):
        Metrics.create(reg)  # the same names twice in one registry
    # A finished request, an engine error, and a refused request that generated nothing.
    finished = Observation("/v1/completions", 200, "length", "finished", 3, 5, 0.004, 0.02, 0.0)
    m.observe_request(**finished._asdict(), itl_counts=[0] * 5 + [4] + [0] * 10, itl_sum_s=0.001)
    failed = Observation("/v1/completions", 500, "error", "engine_error", 2, 1, 0.004, 0.03, 0.5)
    m.observe_request(**failed._asdict())
    refused = Observation("/v1/completions", 400, "none", "none", 0, 0, None, None, None)
    m.observe_request(**refused._asdict())
    m.set_load({("a", "primary"): (2, 0), ("b", "v2"): (1, 1)})
    m.on_span_result("sent", 7)
    m.on_span_result("dropped", 2)
    s = summarize(reg)
    assert (s["requests"], s["failed"], s["by_status"]) == (3, 1, {"200": 1, "400": 1, "500": 1})
    assert (s["prompt_tokens"], s["generation_tokens"]) == (5, 6)
    assert (s["running"], s["queued"]) == (3, 1)
    assert s["spans"] == {"sent": 7, "dropped": 2, "failed": 0}
    ttft = s["latency"]["ttft"]
    assert ttft["count"] == 2 and ttft["mean"] == pytest.approx(0.004)
    # Both in the (0.0025, 0.005] bucket: the median interpolates to its middle.
    assert ttft["p50"] == pytest.approx(0.00375)
    itl = s["latency"]["itl"]
    assert itl["count"] == 4 and itl["p50"] == pytest.approx(0.000375)  # in (0.00025, 0.0005]
    assert s["latency"]["queue_wait"]["count"] == 2
    # None of these requests picked a model (in the totals only); the load is the models'.
    assert {
        m: {v: (r["requests"], r["running"], r["queued"]) for v, r in rows.items()}
        for m, rows in s["models"].items()
    } == {"a": {"primary": (0, 2, 0)}, "b": {"v2": (0, 1, 1)}}
    body, content_type = render(reg, None)
    assert content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {
        "greenserve_requests",
        "greenserve_requests_running",
        "greenserve_exported_spans",
    } <= names


# -- against a real gunicorn with two workers -------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(succ_dir, serve_module):
    return serve_module(MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="slow_step_s=0.001", workers=2)


def test_forty_requests_over_two_workers_count_exactly(two_workers, succ_dir):
    srv = two_workers
    served = {"model": succ_dir.name, "variant": "primary"}  # MODEL_DIR's one model
    srv.wait_workers(2)  # both serve: the counts below are sums over two processes

    def one(i: int) -> dict:
        body = {"model": "m", "prompt": "ab"[: 1 + i % 2], "max_tokens": 1 + i % 7}
        if i % 3 == 0:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            status, _, raw = srv.complete(body)
            usage = sse_json(raw)[-1]["usage"]
        else:
            status, _, raw = srv.complete(body)
            usage = json.loads(raw)["usage"]
        assert status == 200
        return usage

    results = concurrently(one, 40)

    def all_observed(port: int) -> bool:
        m = scrape(srv, port)
        return (
            sum(m["greenserve_requests"].values()) == 40
            and value(m, "greenserve_requests_running", **served) == 0
        )

    for port in (srv.port, srv.health_port):  # both ports answer with the sum of both workers
        # A worker observes a request a loop turn after its last byte, off the request's path: a
        # scrape may come first.
        wait_until(lambda p=port: all_observed(p), 5, "all 40 requests observed")
        m = scrape(srv, port)
        assert (
            value(
                m,
                "greenserve_requests",
                "greenserve_requests_total",
                endpoint="/v1/completions",
                status="200",
                finish_reason="length",
                end_reason="finished",
                **served,
            )
            == 40
        )
        assert sum(m["greenserve_requests"].values()) == 40
        assert value(
            m, "greenserve_generation_tokens", "greenserve_generation_tokens_total", **served
        ) == sum(u["completion_tokens"] for u in results)
        assert value(m, "greenserve_prompt_tokens", "greenserve_prompt_tokens_total") == sum(
            u["prompt_tokens"] for u in results
        )
        for hist, labels in (
            ("greenserve_time_to_first_token_seconds", served),
            ("greenserve_e2e_request_latency_seconds", {}),
            ("greenserve_queue_wait_seconds", {}),
        ):
            assert value(m, hist, hist + "_count", **labels) == 40
            assert value(m, hist, hist + "_bucket", le="+Inf", **labels) == 40
        itl = "greenserve_inter_token_latency_seconds"
        assert value(m, itl, itl + "_count") == sum(u["completion_tokens"] - 1 for u in results)
        assert value(m, "greenserve_requests_running", **served) == 0
        assert value(m, "greenserve_requests_queued", **served) == 0


def master_children(master_pid: int) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == master_pid:
                pids.add(int(entry))
    return pids


def test_killed_worker_leaves_no_running_gauge(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="slow_step_s=0.02", workers=2)
    served = {"model": succ_dir.name, "variant": "primary"}  # MODEL_DIR's one model
    readers = []
    body = {"model": "m", "prompt": "a", "max_tokens": 3000, "stream": True}
    for _ in range(6):
        r = EventReader(srv.port, body)
        r.open()
        assert r.next_frame() == b": ok\n"
        readers.append(r)
    assert value(scrape(srv), "greenserve_requests_running", **served) == 6
    # The worker that answers /debug/state while busy holds some of the streams: kill it.
    state = wait_until(
        lambda: (s := srv.state())["slots"]["busy"] > 0 and s, what="a busy worker to answer"
    )
    victim = state["pid"]
    assert victim in master_children(srv.proc.pid)
    os.kill(victim, signal.SIGKILL)
    for r in readers:
        r.close()
    # gunicorn respawns the worker; child_exit dropped its gauge file, the streams on the other
    # worker ended with their readers: nothing is left running anywhere.
    seen: list[dict] = []

    def settled() -> bool:
        seen[:] = [scrape(srv)]
        running = value(seen[0], "greenserve_requests_running", **served)
        return running == 0 and len(master_children(srv.proc.pid)) == 2

    wait_until(settled, 20, lambda: f"no stream running: {seen[0]['greenserve_requests_running']}")
    assert victim not in master_children(srv.proc.pid)
    assert value(seen[0], "greenserve_requests_queued", **served) == 0
    assert srv.complete({"model": "m", "prompt": "a", "max_tokens": 2})[0] == 200


def exported(srv: GunicornServer) -> dict[str, float]:
    """The ``greenserve_exported_spans_total`` counts by result, summed over workers."""
    m = scrape(srv)
    name = "greenserve_exported_spans"
    return {r: value(m, name, name + "_total", result=r) for r in ("sent", "dropped", "failed")}


def test_span_export_counters_match_the_collector(succ_dir, serve):
    # The first POST is refused with a non-retryable 400 (failed); later ones are accepted (sent).
    with FakeCollector(statuses=[400]) as collector:
        srv = serve(MODEL_DIR=str(succ_dir), OTEL_EXPORTER_OTLP_ENDPOINT=collector.url)
        assert srv.complete({"model": "m", "prompt": "a", "max_tokens": 2})[0] == 200
        seen: list = []

        def counted() -> bool:
            attempts = collector.attempts()
            want = {
                "sent": sum(len(a.spans) for a in attempts if a.status == 200),
                "dropped": 0,
                "failed": sum(len(a.spans) for a in attempts if a.status == 400),
            }
            seen[:] = [exported(srv), want]
            return seen[0] == want and want["sent"] >= 1 and want["failed"] >= 1

        wait_until(counted, 20, lambda: f"counters equal to the collector's: {seen}")
