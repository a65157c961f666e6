"""Wrong API keys are rate-limited per client address (``AUTH_FAILURE_LIMIT``).

A real gunicorn with one key and a budget of 3 wrong keys per 3 seconds: the 4th request with a key
from the address, a right one included, is a 429 with ``Retry-After``, logged; requests without a key
keep their 401; once the window has passed, the right key is served again.

Source: RFC 6585 §4 (429); RFC 9110 §10.2.3 (Retry-After).
"""

from __future__ import annotations

import json

import pytest

from tests.server import GunicornServer, failed_start, wait_until

KEY = "key-one-0123456789"
BODY = {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(succ_dir, tmp_path):
    env = {"MODEL_DIR": str(succ_dir), "API_KEYS": KEY, "AUTH_FAILURE_LIMIT": "3/3 seconds"}
    with GunicornServer(tmp_path / "keyed", env) as srv:
        yield srv


def refusals(srv: GunicornServer) -> list[dict]:
    out = []
    for line in srv.log_text().splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if obj.get("logger") == "greenserve.auth":
                out.append(obj)
    return out


def test_wrong_keys_past_the_limit_get_429_until_the_window_passes(keyed):
    for i in range(3):
        status, _, _ = keyed.complete(BODY, headers=bearer(f"wrong-{i}"))
        assert status == 401
    status, headers, body = keyed.complete(BODY, headers=bearer("wrong-3"))
    assert status == 429, body
    assert 1 <= int(headers["retry-after"]) <= 3
    assert json.loads(body) == {
        "error": {
            "message": "Too many requests with a wrong API key from this address: 3 per 3 second. "
            "Retry after the number of seconds in the Retry-After header.",
            "type": "rate_limit_error",
            "param": None,
            "code": "too_many_auth_failures",
        }
    }
    status, headers, _ = keyed.complete(BODY, headers=bearer(KEY))  # even the right key
    assert status == 429 and "retry-after" in headers
    status, _, _ = keyed.complete(BODY)  # no key: still the plain 401
    assert status == 401
    logged = refusals(keyed)
    assert len(logged) == 2, logged
    assert all(
        r["level"] == "WARNING" and "too many wrong API keys" in r["message"] for r in logged
    )
    assert all("127.0.0.1" not in r["message"] for r in logged)  # the address only as its hash
    wait_until(
        lambda: keyed.complete(BODY, headers=bearer(KEY))[0] == 200,
        timeout_s=10,
        what="the window to pass",
    )


def test_the_setting_is_checked_at_start(tmp_path):
    _, lines = failed_start(tmp_path, {"API_KEYS": KEY, "AUTH_FAILURE_LIMIT": "lots"})
    assert lines == [
        "greenserve: cannot start: AUTH_FAILURE_LIMIT must look like '600/minute', got 'lots'"
    ]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    from tests.services import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


def test_with_redis_the_count_is_shared_by_every_worker(succ_dir, serve, redis_server):
    redis_server.client(2).flushdb()
    srv = serve(
        workers=2,
        MODEL_DIR=str(succ_dir),
        API_KEYS=KEY,
        AUTH_FAILURE_LIMIT="5/minute",
        RATE_LIMIT_STORAGE_URI=redis_server.url(2),
    )
    srv.wait_workers(2)
    statuses = [srv.complete(BODY, headers=bearer(f"wrong-{i}"))[0] for i in range(8)]
    assert statuses == [401] * 5 + [429] * 3  # whichever worker answered each
    keys = [k.decode() for k in redis_server.client(2).keys("*")]
    assert len(keys) == 1 and "greenserve-auth-failures/127.0.0.1" in keys[0], keys
