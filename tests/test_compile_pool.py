"""The compile pool cannot be starved: one client's compiles take turns on one thread of the two,
requests for the same constraint share one compile, and the wait for a grammar counts against the
request's deadline (a 504 at the deadline, not after the compile; the compile goes on and its
grammar is cached). Compiles are made slow by ``GREENSERVE_FAULTS`` ``compile_spin_s``."""

from __future__ import annotations

import json
import threading
import time

from tests.server import concurrently, wait_until

SPIN_S = 2.0


def body(i: int) -> dict:
    """A request whose constraint is new to the cache (``i`` makes it its own)."""
    return {
        "model": "m",
        "prompt": "x",
        "max_tokens": 2,
        "structured_outputs": {"regex": f"[a-z]{{{i + 1}}}"},
    }


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def pool(srv) -> dict:
    return srv.state().get("grammars", {})


def under_way(srv) -> tuple[int, int, int] | None:
    """(compiles running, compiles queued, requests waiting), or None before the first compile."""
    state = pool(srv)
    if not state:
        return None
    return state["compiles_running"], state["compiles_queued"], state["compile_waiters"]


def test_one_client_cannot_occupy_the_pool(serve):
    srv = serve(API_KEYS="key-a,key-b", GREENSERVE_FAULTS=f"compile_spin_s={SPIN_S}")
    done: dict[str, float] = {}

    def send(name: str, key: str, i: int) -> None:
        status, _, raw = srv.complete(body(i), headers=bearer(key), timeout_s=60)
        assert status == 200, raw
        done[name] = time.monotonic()

    hogs = [threading.Thread(target=send, args=(f"a{i}", "key-a", i)) for i in range(3)]
    for t in hogs:
        t.start()
    # All three of key-a's compiles are under way (one running, two in its line) before key-b asks.
    wait_until(lambda: under_way(srv) == (1, 2, 3), 30, lambda: f"key-a's lines: {pool(srv)}")
    send("b", "key-b", 10)
    for t in hogs:
        t.join()
    # key-b's compile ran beside key-a's first, on the other thread: answered before key-a's
    # second was (without the lines, key-a's first two held both threads and its third was next).
    assert done["b"] < sorted(done[f"a{i}"] for i in range(3))[1]


def test_requests_for_one_constraint_share_one_compile(serve):
    srv = serve(GREENSERVE_FAULTS=f"compile_spin_s={SPIN_S}")

    def send(i: int):
        return srv.complete(body(7), timeout_s=60)

    answers: list = []
    runner = threading.Thread(target=lambda: answers.extend(concurrently(send, 3)))
    runner.start()
    wait_until(lambda: under_way(srv) == (1, 0, 3), 30, lambda: f"one compile: {pool(srv)}")
    runner.join()
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert pool(srv)["cache_entries"] == 1


def test_the_wait_for_a_compile_counts_against_the_deadline(serve):
    srv = serve(REQUEST_TIMEOUT_S="1", GREENSERVE_FAULTS="compile_spin_s=6")
    start = time.monotonic()
    status, _, raw = srv.complete(body(3), headers={"X-Request-Id": "late"}, timeout_s=30)
    elapsed = time.monotonic() - start
    err = json.loads(raw)["error"]
    assert (status, err["code"], err["type"]) == (504, "timeout", "server_error")
    # At the 1 s deadline, not after the 6 s compile (halfway between the two).
    assert elapsed < 3.5
    line = wait_until(lambda: srv.log_line("late"), what="the 504's log line")
    assert line["end_reason"] == "deadline"
    # The compile went on: once it is done, the grammar answers from the cache at once.
    wait_until(lambda: pool(srv).get("cache_entries") == 1, 15, "the compile's end")
    status, _, raw = srv.complete(body(3))
    assert status == 200, raw
