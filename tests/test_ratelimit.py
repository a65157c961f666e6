"""Per-client rate limits against a real gunicorn and a real Redis.

Redis storage is exact across workers; memory storage counts per worker (the README's caveat); a Redis
that goes away is failed open, logged and counted; the client is its API key or its address, and a
forged ``X-Forwarded-For`` only counts when a proxy is trusted to have written it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.server import GunicornServer, ServerDied, concurrently, wait_until
from tests.services import RedisServer

BODY = {"model": "m", "prompt": "a", "max_tokens": 1, "temperature": 0}


def too_many(limit: str) -> dict:
    return {
        "error": {
            "message": f"Rate limit exceeded for this client: {limit}. "
            "Retry after the number of seconds in the Retry-After header.",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }


Result = tuple[int, dict[str, str], bytes]


def burst(srv: GunicornServer, n: int, **kw) -> list[Result]:
    """Send ``n`` completions at once, each from its own thread on a fresh connection."""
    return concurrently(lambda _: srv.complete(BODY, **kw), n)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One Redis for the module; each test uses its own database number."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture
def make_server(succ_dir, serve):
    """Return ``make(workers=1, **env)``: a started succ-model server."""

    def make(workers: int = 1, **env: str) -> GunicornServer:
        return serve(MODEL_DIR=str(succ_dir), workers=workers, **env)

    return make


@pytest.mark.services
def test_redis_limit_is_exact_across_two_workers(make_server, redis_server):
    redis_server.client(1).flushdb()
    srv = make_server(2, RATE_LIMIT="5/minute", RATE_LIMIT_STORAGE_URI=redis_server.url(1))
    srv.wait_workers(2)
    # One at a time, the counter reads 4, 3, 2 left (whichever worker answered).
    first = [srv.complete(BODY) for _ in range(3)]
    assert [int(h["x-ratelimit-remaining"]) for _, h, _ in first] == [4, 3, 2]
    # Then 21 at once over both workers: exactly 2 more get through. (Remaining is read after the
    # hit, so concurrent answers may show the same number; the admission itself is atomic.)
    results = burst(srv, 21)
    statuses = [s for s, _, _ in results]
    assert (statuses.count(200), statuses.count(429)) == (2, 19)
    for status, headers, body in first + results:
        assert headers["x-ratelimit-limit"] == "5"
        assert int(headers["x-ratelimit-reset"]) > time.time() + 50
        if status == 429:
            assert json.loads(body) == too_many("5 per 1 minute")
            assert headers["x-ratelimit-remaining"] == "0"
            assert 55 <= int(headers["retry-after"]) <= 60
        else:
            assert json.loads(body)["choices"][0]["text"] == "b"
            assert "retry-after" not in headers
    # One bucket, in Redis, named by the client's address (the API key digest when keys are on).
    keys = redis_server.client(1).keys("*")
    assert [k.decode() for k in keys] == ["LIMITS:LIMITER/greenserve/addr:127.0.0.1/api/5/1/minute"]
    # Only the API is limited: ops endpoints answer and carry no rate-limit headers.
    for path in ("/healthz", "/health", "/ready", "/debug/state"):
        status, headers, _ = srv.get(path)
        assert status == 200 and "x-ratelimit-limit" not in headers, path


def test_memory_storage_counts_per_worker(make_server):
    # The README's caveat: with W workers and memory:// storage a client may get up to W x the limit.
    srv = make_server(2, RATE_LIMIT="5/minute")
    srv.wait_workers(2)
    results: list[Result] = []
    for _ in range(10):  # which worker accepts is up to the kernel: send until both are spent
        results += burst(srv, 20)
        if sum(s == 200 for s, _, _ in results) == 10:
            break
    assert sum(s == 200 for s, _, _ in results) == 10  # 2 workers x 5, not 5
    assert {s for s, _, _ in burst(srv, 8)} == {429}


@pytest.mark.services
def test_redis_down_fails_open_and_recovers(make_server, tmp_path):
    with RedisServer(tmp_path / "redis") as redis:
        srv = make_server(1, RATE_LIMIT="2/minute", RATE_LIMIT_STORAGE_URI=redis.url(2))
        assert [srv.complete(BODY)[0] for _ in range(3)] == [200, 200, 429]
        redis.stop()
        # Redis is gone: requests are still served, without rate-limit headers.
        for _ in range(5):
            status, headers, body = srv.complete(BODY)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == "b"
            assert "x-ratelimit-limit" not in headers
        assert srv.state()["rate_limit"]["storage_errors"] >= 1
        assert f"rate-limit storage {redis.url(2)} unreachable" in srv.log_text()
        # Redis is back (empty, on the same port): counting resumes after the cool-down.
        redis.start()

        def counted() -> dict[str, str] | None:
            status, headers, _ = srv.complete(BODY)
            assert status == 200
            return headers if "x-ratelimit-remaining" in headers else None

        headers = wait_until(counted, 10, "limits to resume")
        assert headers["x-ratelimit-remaining"] == "1"
        assert [srv.complete(BODY)[0] for _ in range(2)] == [200, 429]


def test_forwarded_for_is_ignored_unless_trusted(make_server):
    srv = make_server(1, RATE_LIMIT="2/minute")
    spoofed = [srv.complete(BODY, headers={"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(3)]
    # Every request is the peer 127.0.0.1, whatever it claims.
    assert [s for s, _, _ in spoofed] == [200, 200, 429]


def test_trusted_proxy_hop_is_the_client(make_server):
    srv = make_server(1, RATE_LIMIT="2/minute", TRUSTED_PROXIES="1")

    def status(xff: str | None) -> int:
        return srv.complete(BODY, headers={"X-Forwarded-For": xff} if xff else {})[0]

    # The proxy (here: the test) appended the client's address last.
    assert [status("198.51.100.7") for _ in range(3)] == [200, 200, 429]
    # Anything the client put before that entry changes nothing.
    assert status("203.0.113.9, 198.51.100.7") == 429
    # Another client address, another bucket; no header at all: the peer's own bucket.
    assert [status("198.51.100.8") for _ in range(3)] == [200, 200, 429]
    assert [status("198.51.100.7, 198.51.100.9") for _ in range(2)] == [200, 200]
    assert [status(None) for _ in range(3)] == [200, 200, 429]


def test_api_key_is_the_client(make_server):
    srv = make_server(1, RATE_LIMIT="2/minute", API_KEYS="key-a,key-b")

    def status(key: str) -> int:
        return srv.complete(BODY, headers={"Authorization": f"Bearer {key}"})[0]

    # Same address, two keys: two buckets.
    assert [status("key-a") for _ in range(3)] == [200, 200, 429]
    assert [status("key-b") for _ in range(3)] == [200, 200, 429]
    # A refused key is a 401, never counted nor a 429.
    assert status("key-c") == 401


def test_bad_rate_limit_stops_the_server_at_start(succ_dir, tmp_path):
    srv = GunicornServer(tmp_path, {"MODEL_DIR": str(succ_dir), "RATE_LIMIT": "lots"})
    with pytest.raises(ServerDied) as exc:
        srv.start(timeout_s=20)  # a failed start leaves nothing running
    assert "greenserve: cannot start: RATE_LIMIT must look like '600/minute', got 'lots'" in str(
        exc.value
    )
