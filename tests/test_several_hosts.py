"""Several hosts on loopback: two greenserve servers behind one real nginx upstream (the example site,
passive health checks with ``max_fails``/``fail_timeout``) sharing one real Redis for rate limits.

A client past the limit is refused exactly once across both hosts. Then one host is killed (SIGKILL to
its process group) under load: every request sent after it died is answered by the other host, and
each stream that was in flight on it ends so a client can tell it from a complete answer (no
``[DONE]``, an unterminated chunked body: the official ``openai`` SDK raises), while the other host's
streams end complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from tests.server import GunicornServer, wait_until
from tests.services import NginxServer, RedisServer

pytestmark = pytest.mark.services

LIMIT = 20  # requests per minute per client
STEP_S = 0.1  # every token takes at least this long (GREENSERVE_FAULTS)
STREAM_TOKENS = 40
# The succ model ("A" -> "B" -> "C" ...), greedy.
STREAM_TEXT = "".join(chr(ord("B") + i) for i in range(STREAM_TOKENS))


@pytest.fixture(scope="module")
def hosts(succ_dir, tmp_path_factory) -> Iterator[tuple[NginxServer, list[GunicornServer]]]:
    """nginx -> two gunicorns (1 worker each) -> one Redis for the limits."""
    with contextlib.ExitStack() as stack:  # stopped in reverse: nginx, the hosts, Redis
        redis = stack.enter_context(RedisServer(tmp_path_factory.mktemp("redis")))
        env = {
            "MODEL_DIR": str(succ_dir),
            "TRUSTED_PROXIES": "1",
            "RATE_LIMIT": f"{LIMIT}/minute",
            "RATE_LIMIT_STORAGE_URI": redis.url(0),
            "GREENSERVE_FAULTS": f"slow_step_s={STEP_S}",
        }
        servers = [
            stack.enter_context(GunicornServer(tmp_path_factory.mktemp(f"host{i}"), env))
            for i in (1, 2)
        ]
        nginx = stack.enter_context(
            NginxServer(tmp_path_factory.mktemp("nginx"), [s.port for s in servers])
        )
        yield nginx, servers


def complete(nginx: NginxServer, source: str) -> tuple[int, bytes]:
    body = json.dumps({"model": "m", "prompt": "A", "max_tokens": 1, "temperature": 0}).encode()
    status, _, data = nginx.request(
        "POST", "/v1/completions", body, {"Content-Type": "application/json"}, source=source
    )
    return status, data


def served(srv: GunicornServer) -> float:
    """Completions this host answered with 200 (its own metrics)."""
    _, _, body = srv.get("/metrics", port=srv.health_port)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("greenserve_requests_total{") and 'status="200"' in line
    )


def test_a_client_past_the_limit_is_refused_once_across_hosts(hosts):
    nginx, servers = hosts
    before = [served(s) for s in servers]
    results = [complete(nginx, "127.0.0.2") for _ in range(LIMIT + 1)]
    assert [s for s, _ in results] == [200] * LIMIT + [429]
    assert all(json.loads(b)["choices"][0]["text"] == "B" for _, b in results[:LIMIT])
    assert json.loads(results[-1][1])["error"]["code"] == "rate_limit_exceeded"
    # Both hosts answered (nginx alternates), and they counted in one bucket, not one each.
    gained = [served(s) - b for s, b in zip(servers, before, strict=True)]
    assert sum(gained) == LIMIT and min(gained) >= LIMIT // 2 - 1, gained
    # Another client has its own full budget on either host.
    assert complete(nginx, "127.0.0.3")[0] == 200


def test_a_killed_host_fails_over(hosts, tmp_path):
    nginx, (doomed, survivor) = hosts
    client = OpenAI(base_url=f"http://127.0.0.1:{nginx.port}/v1", api_key="unused", max_retries=0)
    texts: dict[str, list[str]] = {}
    finish: dict[str, str | None] = {}
    errors: dict[str, Exception] = {}

    def stream(rid: str) -> None:
        texts[rid], finish[rid] = [], None
        try:
            chunks = client.completions.create(
                model="m", prompt="A", max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                extra_headers={"X-Request-Id": rid},
            )  # fmt: skip
            for chunk in chunks:
                texts[rid].append(chunk.choices[0].text)
                finish[rid] = chunk.choices[0].finish_reason
        except Exception as exc:  # what the client sees is the point of the test
            errors[rid] = exc

    # Four streams, one at a time, so that nginx's round robin puts two on each host.
    streams, where = [], {}
    for i in range(4):
        rid = f"stream-{i}"
        streams.append(threading.Thread(target=stream, args=(rid,)))
        streams[-1].start()
        host = wait_until(
            lambda rid=rid: (
                (doomed.in_flight(rid) is not None and "doomed")
                or (survivor.in_flight(rid) is not None and "survivor")
            ),
            what=f"{rid} to start",
        )
        where[rid] = host
    assert sorted(where.values()) == ["doomed", "doomed", "survivor", "survivor"], where

    # Load: short completions from many client addresses (each well inside its limit).
    log: list[tuple[float, int, bytes]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            status, body = complete(nginx, f"127.0.{10 + worker}.{n % 200 + 1}")
            log.append((started, status, body))

    loaders = [threading.Thread(target=load, args=(w,)) for w in range(2)]
    for t in loaders:
        t.start()
    wait_until(lambda: len(log) >= 4, 30, "the load to be answered before the kill")
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    doomed.proc.wait(timeout=10)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", doomed.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_until(refused, what="the killed host's port to refuse connections")
    dead_at = time.monotonic()
    wait_until(  # the load goes on after the host died
        lambda: sum(started >= dead_at for started, _, _ in log) >= 10,
        30,
        "10 requests sent after the host died to be answered",
    )
    stop.set()
    for t in loaders + streams:
        t.join(30)

    # Every request sent after the host died was answered, by the other host.
    after = [(status, body) for started, status, body in log if started >= dead_at]
    assert len(after) >= 5, len(after)
    for status, body in after:
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == "B"
    # nginx left the dead host out at its first failure (max_fails=1) instead of trying it again on
    # every other request: at most one refused connection per load thread.
    upstream = f"127.0.0.1:{doomed.port}/v1/completions"
    lines = [ln for ln in nginx.log_tail(10_000).splitlines() if upstream in ln]
    assert any("upstream server temporarily disabled" in ln for ln in lines), lines
    assert sum("connect() failed (111: Connection refused)" in ln for ln in lines) <= 2, lines

    for rid, host in where.items():
        text = "".join(texts[rid])
        if host == "survivor":
            assert rid not in errors, errors.get(rid)
            assert (text, finish[rid]) == (STREAM_TEXT, "length")
        else:
            # Cut off: never a well-formed short answer. nginx closes the client's connection without
            # the last chunk, and the SDK raises instead of ending the iteration.
            error = errors[rid]
            assert type(error) is openai.APIConnectionError, repr(error)
            assert type(error.__cause__).__name__ == "RemoteProtocolError"
            assert str(error.__cause__) == (
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)"
            )
            assert finish[rid] is None
            assert 0 < len(text) < STREAM_TOKENS and STREAM_TEXT.startswith(text), text
