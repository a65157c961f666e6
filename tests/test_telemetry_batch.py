"""Telemetry observed in batches: the same quantiles to the bit and the same metric counts as the
per-request path, and a deferred observer that queues until its flush."""

from __future__ import annotations

import random
from array import array

import pytest
from prometheus_client import CollectorRegistry

from telemetry.batch import Observation, Quantiles, count_all, reduce_gaps
from telemetry.metrics import Metrics
from telemetry.observer import Observer, summarize
from telemetry.spans import start_server_span
from tests.scrape import samples
from wsgi_app.generation.record import RequestRecord


def _stamps(rng: random.Random, n: int) -> array:
    t, out = rng.random(), array("d")
    for _ in range(n):
        out.append(t)
        t += rng.choice((0.00002, 0.0001, rng.random() * 0.01))  # ties, and spread
    return out


def test_reduce_gaps_equals_summarize_per_request():
    rng = random.Random(7)
    batch = [_stamps(rng, n) for n in (0, 1, 2, 3, 64, 0, 5, 1, 257, 2)]
    got = reduce_gaps(batch)
    counts = [0] * len(got.counts)
    total = 0.0
    for stamps, q in zip(batch, got.quantiles, strict=True):
        one = summarize(stamps)
        if one is None:
            assert q is None
            continue
        assert q == Quantiles(one.p50_s, one.p95_s)  # bit for bit
        counts = [a + b for a, b in zip(counts, one.counts, strict=True)]
        total += one.sum_s
    assert got.counts == counts
    assert sum(got.counts) == sum(max(len(s) - 1, 0) for s in batch)
    assert got.sum_s == pytest.approx(total, rel=1e-12)


def test_reduce_gaps_known_answer_and_empty():
    got = reduce_gaps([array("d", [0.0, 1.0, 3.0, 6.0, 10.0]), array("d", [5.0])])
    assert got.quantiles[0].p50_s == 2.5 and got.quantiles[1] is None
    assert got.quantiles[0].p95_s == pytest.approx(3.85, abs=1e-12)
    assert (got.counts, got.sum_s) == ([0] * 14 + [1, 3], 10.0)
    empty = reduce_gaps([array("d"), array("d", [1.0])])
    assert empty.quantiles == [None, None] and sum(empty.counts) == 0 and empty.sum_s == 0.0


def test_count_all_equals_one_observe_request_each():
    rng = random.Random(3)
    batch = [_stamps(rng, n) for n in (5, 1, 9)]
    loop, canary = {"model": "loop", "variant": "primary"}, {"model": "loop", "variant": "v2"}
    obs = [
        Observation("/v1/completions", 200, "length", "finished", 3, 5, 0.004, 0.02, 0.0, **loop),
        Observation("/v1/completions", 500, "error", "engine_error", 2, 1, 0.3, 2.5, 0.5, **canary),
        Observation(
            "/v1/chat/completions", 200, "length", "finished", 1, 9, 0.0007, 0.01, 1e-6, **loop
        ),
        Observation("/v1/completions", 400, "none", "none", 0, 0, None, None, None),  # no model
        Observation(
            "/v1/chat/completions",
            200,
            "stop",
            "stop",
            4,
            7,
            0.01,
            0.1,
            0.0,
            "json_schema",
            0.002,
            3e-4,
        ),
    ]
    stamps = [*batch, array("d"), array("d", [0.0, 0.01])]
    one, many = CollectorRegistry(), CollectorRegistry()
    m1, m2 = Metrics.create(one), Metrics.create(many)
    for o, s in zip(obs, stamps, strict=True):
        g = summarize(s)
        m1.observe_request(
            **o._asdict(),
            itl_counts=() if g is None else g.counts,
            itl_sum_s=0.0 if g is None else g.sum_s,
        )
    count_all(m2, obs, reduce_gaps(stamps))
    a, b = samples(one), samples(many)
    assert a.keys() == b.keys()
    for key, value in a.items():  # sums are added once per batch: equal up to rounding
        assert b[key] == pytest.approx(value, rel=1e-12), key
    done = (
        "greenserve_requests_total",
        (
            ("end_reason", "finished"),
            ("endpoint", "/v1/completions"),
            ("finish_reason", "length"),
            ("model", "loop"),
            ("status", "200"),
            ("variant", "primary"),
        ),
    )
    assert b[done] == 1
    # Per model and variant; a request that picked none is counted under empty labels.
    tokens = "greenserve_generation_tokens_total"
    assert b[(tokens, (("model", "loop"), ("variant", "primary")))] == 5 + 9
    assert b[(tokens, (("model", "loop"), ("variant", "v2")))] == 1
    assert b[(tokens, (("model", ""), ("variant", "")))] == 7
    ttft = "greenserve_time_to_first_token_seconds_count"
    assert b[(ttft, (("model", "loop"), ("variant", "primary")))] == 2
    assert b[(ttft, (("model", "loop"), ("variant", "v2")))] == 1


def _record(i: int, n_tokens: int) -> RequestRecord:
    record = RequestRecord(
        request_id=f"r{i}",
        span=start_server_span("POST /v1/completions", None, {}),
        method="POST",
        path="/v1/completions",
        route="/v1/completions",
        status=200,
        prompt_tokens=2,
        completion_tokens=n_tokens,
        finish_reasons=["length"],
        ttft_s=0.001,
        queue_wait_s=0.0,
        slot_at=0.0,
        served_model="m",
        variant="primary",
    )
    record.token_times.extend(0.001 * k for k in range(n_tokens))
    return record


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def observe(self, *, completion_tokens: int, **_: object) -> None:
        self.seen.append(completion_tokens)


class _Flusher:
    def __init__(self) -> None:
        self.recorder, self.store = _Recorder(), None


def test_deferred_observer_queues_until_its_flush(caplog):
    reg = CollectorRegistry()
    observer = Observer(reg, Metrics.create(reg), _Flusher(), slow_request_s=0.0)
    scheduled = []
    observer.defer = scheduled.append
    caplog.set_level("INFO", logger="greenserve.access")
    for i, n in enumerate((4, 1, 7)):
        observer.request_done(_record(i, n), 0.01)
    assert scheduled == [observer.flush]  # one turn of the loop observes the three
    assert observer.flusher.recorder.seen == [] and not caplog.records
    scheduled[0]()
    assert observer.flusher.recorder.seen == [4, 1, 7]
    lines = [r for r in caplog.records if r.getMessage() == "request"]
    assert [r.request_id for r in lines] == ["r0", "r1", "r2"]
    assert [r.itl_p50_s for r in lines] == [0.001, None, 0.001]
    picked = (("model", "m"), ("variant", "primary"))
    assert samples(reg)[("greenserve_generation_tokens_total", picked)] == 12
    assert samples(reg)[("greenserve_inter_token_latency_seconds_count", ())] == 3 + 6
    observer.request_done(_record(3, 2), 0.01)  # the next request schedules the next flush
    assert len(scheduled) == 2
    observer.defer = None  # no loop: observed at once
    observer.flush()
    observer.request_done(_record(4, 2), 0.01)
    assert observer.flusher.recorder.seen == [4, 1, 7, 2, 2]


def test_deferred_load_gauges_take_the_turns_last_values():
    reg = CollectorRegistry()
    metrics = Metrics.create(reg)
    metrics.declare_models([("m", "primary"), ("m", "v2")])
    observer = Observer(reg, metrics, _Flusher(), slow_request_s=0.0)
    scheduled = []
    observer.defer = scheduled.append
    m, v2 = ("m", "primary"), ("m", "v2")
    observer.set_load({m: (1, 0), v2: (0, 0)})
    observer.set_load({m: (2, 1), v2: (0, 0)})
    observer.set_load({m: (1, 1), v2: (1, 0)})
    assert len(scheduled) == 1
    running = {
        v: ("greenserve_requests_running", (("model", "m"), ("variant", v)))
        for v in ("primary", "v2")
    }
    queued = ("greenserve_requests_queued", (("model", "m"), ("variant", "primary")))
    assert samples(reg)[running["primary"]] == 0
    scheduled[0]()
    assert (samples(reg)[running["primary"]], samples(reg)[queued]) == (1, 1)
    assert samples(reg)[running["v2"]] == 1
    observer.set_load({m: (0, 0), v2: (1, 0)})
    observer.flush()  # a scrape flushes first: the gauges are current
    assert (samples(reg)[running["primary"]], samples(reg)[running["v2"]]) == (0, 1)
