"""``/stats`` and ``/stats/history``: per-minute counts equal the traffic sent, the error budget
moves with injected 5xx, the SQLite store is shared by workers and survives restarts. A fake clock steps
through minutes and days instead of waiting for them."""

from __future__ import annotations

import json
import os

import pytest

from telemetry.flusher import Flusher
from telemetry.history import KEEP_MINUTES, HistoryStore
from telemetry.recorder import HistoryRecorder
from tests.server import GunicornServer, wait_until
from wsgi_app import create_app
from wsgi_app.http.routes.stats import parse_minutes
from wsgi_app.settings import Settings

T0 = 1_700_000_040.0  # a minute boundary: 28_333_334 * 60


class FakeClock:
    """Unix seconds that only move when a test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ok(rec: HistoryRecorder, ttft_s: float = 0.01, completion_tokens: int = 4) -> None:
    rec.observe(
        failed=False,
        ttft_s=ttft_s,
        e2e_s=0.05,
        prompt_tokens=2,
        completion_tokens=completion_tokens,
    )


def fail(rec: HistoryRecorder) -> None:
    rec.observe(failed=True, ttft_s=None, e2e_s=0.01, prompt_tokens=2, completion_tokens=0)


# -- the store, with a fake clock -------------------------------------------------------------------


def test_minutes_add_up_over_workers_and_restarts(tmp_path):
    clock = FakeClock()
    path = str(tmp_path / "stats.db")
    a, b = HistoryRecorder(clock, 1.0), HistoryRecorder(clock, 1.0)  # two "workers"
    store = HistoryStore(path)
    for _ in range(3):
        ok(a)
    ok(b, ttft_s=2.5)  # slower than the 1 s objective
    clock.now += 60
    fail(a)
    ok(b)
    clock.now += 60.5  # into the third minute, which has no traffic
    store.write(a.drain())
    store.write(b.drain())
    assert a.drain().rows == {}  # drained
    # A restarted server opens the same file and sees the same history.
    series = HistoryStore(path).series(clock.now, minutes=4)
    assert [m["t"] for m in series] == [T0 - 60 * 1, T0, T0 + 60, T0 + 120]
    assert [m["requests"] for m in series] == [0, 4, 2, 0]
    assert [m["failed"] for m in series] == [0, 0, 1, 0]
    assert [m["slow_ttft"] for m in series] == [0, 1, 0, 0]
    assert [m["bad"] for m in series] == [0, 1, 1, 0]
    assert [m["completion_tokens"] for m in series] == [0, 16, 4, 0]
    assert [m["prompt_tokens"] for m in series] == [0, 8, 4, 0]
    first = series[1]
    assert first["ttft_mean_s"] == pytest.approx((3 * 0.01 + 2.5) / 4)
    # TTFTs 0.01, 0.01, 0.01, 2.5 over both workers: the quantile at rank q * (n - 1) is an
    # observation, to the sketch's 1 % (not a value interpolated inside a histogram bucket).
    assert first["ttft_p50_s"] == pytest.approx(0.01, rel=0.01)  # rank 1.5: the 2nd
    assert first["ttft_p95_s"] == pytest.approx(0.01, rel=0.01)  # rank 2.85: the 3rd
    assert first["e2e_p95_s"] == pytest.approx(0.05, rel=0.01)
    assert series[0]["ttft_mean_s"] is None and series[0]["ttft_p50_s"] is None


def test_error_budget_over_seven_days(tmp_path):
    clock = FakeClock()
    store = HistoryStore(str(tmp_path / "s.db"))
    rec = HistoryRecorder(clock, 1.0)
    fail(rec)  # 8 days ago: outside the window
    clock.now += 8 * 86_400
    for _ in range(198):
        ok(rec)
    fail(rec)
    fail(rec)
    store.write(rec.drain())
    budget = store.budget(clock.now, target=0.99)
    assert (budget["requests"], budget["bad"], budget["failed"], budget["slow_ttft"]) == (
        200,
        2,
        2,
        0,
    )
    assert budget["allowed_bad"] == pytest.approx(2.0)
    assert budget["remaining"] == pytest.approx(0.0)  # exactly spent
    assert budget["burn_rate_1h"] == pytest.approx(1.0)  # 1 % bad against a 1 % budget
    assert budget["window_s"] == 604_800
    # An hour later the burn rate is back to 0, the week still remembers.
    clock.now += 3600
    later = store.budget(clock.now, target=0.99)
    assert (later["bad"], later["burn_rate_1h"]) == (2, 0.0)
    # Seven more days: all of it has left the window; no traffic means a full budget.
    clock.now += 7 * 86_400
    assert store.budget(clock.now, target=0.99)["remaining"] == 1.0


def test_rates_slide_over_the_minute_boundary(tmp_path):
    clock = FakeClock()
    store = HistoryStore(str(tmp_path / "s.db"))
    rec = HistoryRecorder(clock, 1.0)
    for _ in range(60):
        ok(rec)
    clock.now += 60
    for _ in range(30):
        ok(rec)
    store.write(rec.drain())
    clock.now += 15  # a quarter into the minute: 3/4 of the previous minute still counts
    rates = store.rates(clock.now)
    assert rates["requests_per_s"] == pytest.approx((30 + 60 * 0.75) / 60)
    assert rates["completion_tokens_per_s"] == pytest.approx(4 * (30 + 60 * 0.75) / 60)
    assert rates["failed_per_s"] == 0.0


def test_prune_keeps_eight_days(tmp_path):
    clock = FakeClock()
    store = HistoryStore(str(tmp_path / "s.db"))
    rec = HistoryRecorder(clock, 1.0)
    ok(rec)
    clock.now += (KEEP_MINUTES + 1) * 60
    ok(rec)
    store.write(rec.drain())
    store.prune(clock.now)
    assert store.budget(clock.now + 1, 0.99, window_s=10 * 86_400)["requests"] == 1


def test_flusher_heartbeat_workers_and_retry(tmp_path):
    clock = FakeClock()
    store = HistoryStore(str(tmp_path / "s.db"))
    rec = HistoryRecorder(clock, 1.0)
    flusher = Flusher(rec, store, 1.0, worker_state=lambda: {"slots_busy": 1})
    ok(rec)
    real_write = store.write
    store.write = lambda *a: (_ for _ in ()).throw(OSError("disk full"))
    assert flusher.flush() is False  # the batch goes back to the recorder
    store.write = real_write
    ok(rec)
    assert flusher.flush() is True
    assert store.series(clock.now, 1)[0]["requests"] == 2
    (me,) = store.workers(os.getppid(), clock.now, max_age_s=5.0)
    assert (me["pid"], me["slots_busy"], me["heartbeat_age_s"]) == (os.getpid(), 1, 0.0)
    assert store.workers(os.getppid() + 1, clock.now, 5.0) == []  # another server's workers
    assert store.workers(os.getppid(), clock.now + 6, 5.0) == []  # a stale heartbeat
    flusher.close()
    assert store.workers(os.getppid(), clock.now, 5.0) == []


# -- the endpoints, in process, with a fake clock ----------------------------------------------------


def test_history_endpoint_with_injected_clock_and_faults(succ_dir, tmp_path):
    clock = FakeClock()
    settings = Settings(
        model_dir=str(succ_dir), stats_db=str(tmp_path / "s.db"), faults="fail_at=4"
    )
    client = create_app(settings, clock=clock).test_client()

    def complete(max_tokens: int) -> int:
        resp = client.post(
            "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": max_tokens}
        )
        resp.close()  # runs call_on_close: the request is observed
        return resp.status_code

    assert [complete(3) for _ in range(5)] == [200] * 5
    clock.now += 60
    assert [complete(3) for _ in range(3)] + [complete(5), complete(5)] == [200] * 3 + [500] * 2
    clock.now += 30
    body = client.get("/stats/history").get_json()
    assert body["slo"] == {"ttft_s": 1.0, "target": 0.99}
    minutes = body["minutes"]
    assert len(minutes) == 60 and minutes[-1]["t"] == T0 + 60
    assert [m["requests"] for m in minutes[-2:]] == [5, 5]
    assert [m["failed"] for m in minutes[-2:]] == [0, 2]
    assert sum(m["requests"] for m in minutes) == 10
    budget = body["error_budget"]
    assert (budget["requests"], budget["bad"], budget["failed"]) == (10, 2, 2)
    assert budget["remaining"] == pytest.approx(1 - 2 / 0.1)  # overspent twenty times over
    assert client.get("/stats/history?minutes=2").get_json()["minutes"][0]["requests"] == 5
    err = client.get("/stats/history?minutes=x").get_json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "minutes")
    stats = client.get("/stats").get_json()
    assert stats["totals"]["requests"] == 10 and stats["totals"]["failed"] == 2
    assert stats["totals"]["by_status"] == {"200": 8, "500": 2}
    assert stats["totals"]["generation_tokens"] == 8 * 3 + 2 * 3  # a failure stops before token 4
    assert stats["rates"]["requests_per_s"] == pytest.approx((5 + 5 * 0.5) / 60)
    assert [w["pid"] for w in stats["workers"]] == [os.getpid()]


@pytest.mark.parametrize(
    ("raw", "minutes"), [(None, 60), ("1", 1), ("60", 60), ("1440", 1440), ("0060", 60)]
)
def test_minutes_in_range_are_taken_as_sent(raw, minutes):
    assert parse_minutes(raw) == minutes


# Each refused ``?minutes=`` value (as sent in the query string) and how the message quotes it.
REFUSED_MINUTES = [
    ("0", "'0'"),
    ("0000", "'0000'"),
    ("1441", "'1441'"),
    ("5000", "'5000'"),  # once silently capped to 1440
    ("01441", "'01441'"),
    ("9" * 30, "'" + "9" * 20 + "…'"),  # never parsed, and quoted cut short
    ("-5", "'-5'"),
    ("1.5", "'1.5'"),
    ("1e3", "'1e3'"),
    ("", "''"),
    (" 5", "' 5'"),
    ("+5", "'+5'"),
    ("1_0", "'1_0'"),  # int() would read 10
    ("\u0665", "'\u0665'"),  # ARABIC-INDIC DIGIT FIVE: int() would read 5
    ("x", "'x'"),
]


def test_history_refuses_minutes_outside_1_to_1440(succ_dir, tmp_path):
    clock = FakeClock()
    settings = Settings(model_dir=str(succ_dir), stats_db=str(tmp_path / "s.db"))
    client = create_app(settings, clock=clock).test_client()
    for raw, shown in REFUSED_MINUTES:
        resp = client.get("/stats/history", query_string={"minutes": raw})
        assert (resp.status_code, resp.content_type) == (400, "application/json"), raw
        assert resp.get_json() == {
            "error": {
                "message": f"'minutes' must be an integer in 1..1440, got {shown}.",
                "type": "invalid_request_error",
                "param": "minutes",
                "code": None,
            }
        }
    # The whole range is served exactly: a day ends at the current minute, a minute is just it.
    day = client.get("/stats/history?minutes=1440").get_json()["minutes"]
    assert (len(day), day[0]["t"], day[-1]["t"]) == (1440, T0 - 1439 * 60, T0)
    (one,) = client.get("/stats/history?minutes=1").get_json()["minutes"]
    assert (one["t"], one["requests"]) == (T0, 0)
    assert len(client.get("/stats/history").get_json()["minutes"]) == 60


# -- against a real gunicorn with two workers -------------------------------------------------------


def history(srv: GunicornServer) -> dict:
    status, _, body = srv.get("/stats/history", port=srv.health_port)
    assert status == 200
    return json.loads(body)


def wait_history(srv: GunicornServer, requests: int, timeout_s: float = 10.0) -> dict:
    """Poll until every worker has flushed (``STATS_FLUSH_S``) and the hour holds ``requests``."""
    seen: list[dict] = []

    def counted() -> dict | None:
        seen[:] = [history(srv)]
        return seen[0] if sum(m["requests"] for m in seen[0]["minutes"]) == requests else None

    return wait_until(counted, timeout_s, lambda: f"{requests} requests: {seen[0]['minutes'][-2:]}")


def test_history_counts_traffic_budget_and_survives_restart(succ_dir, tmp_path):
    env = {
        "MODEL_DIR": str(succ_dir),
        "STATS_DB": str(tmp_path / "stats.db"),
        "STATS_FLUSH_S": "0.1",
        "GREENSERVE_FAULTS": "fail_at=6",
    }
    with GunicornServer(tmp_path / "a", env, workers=2) as srv:
        for i in range(30):
            body = {"model": "m", "prompt": "a", "max_tokens": 3, "stream": i % 2 == 0}
            assert srv.complete(body)[0] == 200
        h = wait_history(srv, 30)
        assert sum(m["completion_tokens"] for m in h["minutes"]) == 90
        assert h["error_budget"]["bad"] == 0 and h["error_budget"]["remaining"] == 1.0
        for _ in range(4):  # past fail_at: 500s
            assert srv.complete({"model": "m", "prompt": "a", "max_tokens": 8})[0] == 500
        h = wait_history(srv, 34)
        budget = h["error_budget"]
        assert (budget["requests"], budget["failed"], budget["bad"]) == (34, 4, 4)
        assert budget["remaining"] == pytest.approx(1 - 4 / (0.01 * 34))
        assert sum(m["failed"] for m in h["minutes"]) == 4
        stats = wait_until(  # the 2nd worker may boot late
            lambda: len((s := json.loads(srv.get("/stats")[2]))["workers"]) == 2 and s,
            20,
            "both workers in /stats",
        )
        assert stats["totals"]["requests"] == 34 and stats["totals"]["failed"] == 4
        assert {w["slots_busy"] for w in stats["workers"]} == {0}
        assert sum(w["served"] for w in stats["workers"]) == 34
        assert stats["latency"]["ttft"]["count"] == 34
        assert stats["load"] == {"running": 0, "queued": 0}
    with GunicornServer(tmp_path / "b", env, workers=1) as again:
        h = history(again)
        assert sum(m["requests"] for m in h["minutes"]) == 34
        assert h["error_budget"]["failed"] == 4
        # Prometheus counters start afresh with the new server; the history does not.
        assert json.loads(again.get("/stats")[2])["totals"]["requests"] == 0
