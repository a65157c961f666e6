"""The metrics an operator alerts on besides traffic (deploy/prometheus/): live and ready workers, and
rate-limit storage failures, against a real gunicorn with two workers and an unreachable Redis."""

from __future__ import annotations

import json

from tests.scrape import scrape, value
from tests.server import wait_until
from tests.services import free_port

BODY = {"model": "m", "prompt": "a", "max_tokens": 1, "temperature": 0}


def test_workers_ready_and_storage_errors(succ_dir, serve):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    srv = serve(
        workers=2,
        MODEL_DIR=str(succ_dir),
        RATE_LIMIT="100/minute",
        RATE_LIMIT_STORAGE_URI=dead_redis,
        STATS_FLUSH_S="0.1",
    )
    srv.wait_workers(2)
    first = scrape(srv, srv.health_port)
    assert value(first, "greenserve_workers") == 2
    assert value(first, "greenserve_workers_ready") == 2
    assert (
        value(
            first,
            "greenserve_rate_limit_storage_errors",
            "greenserve_rate_limit_storage_errors_total",
        )
        == 0
    )
    # Redis is down: the request is served without limits, and the failure is counted once
    # per cool-down, by the worker that met it.
    status, headers, body = srv.complete(BODY)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "b"
    assert "x-ratelimit-limit" not in headers
    errors = value(
        scrape(srv, srv.health_port),
        "greenserve_rate_limit_storage_errors",
        "greenserve_rate_limit_storage_errors_total",
    )
    assert errors == 1
    # The server drains (every worker): /metrics says so within a heartbeat, while both stay alive;
    # undoing it counts both as ready again.
    status, _, body = srv.post("/debug/drain", {})
    assert status == 200
    wait_until(
        lambda: value(scrape(srv, srv.health_port), "greenserve_workers_ready") == 0,
        what="both drained workers to count as not ready",
    )
    assert value(scrape(srv, srv.health_port), "greenserve_workers") == 2
    assert srv.request("DELETE", "/debug/drain")[0] == 200
    wait_until(
        lambda: value(scrape(srv, srv.health_port), "greenserve_workers_ready") == 2,
        what="both workers to count as ready again",
    )
