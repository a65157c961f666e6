"""Stored responses (``store``) over real servers: ``previous_response_id`` answers as the whole
conversation sent again (function calls included), ``GET`` and ``DELETE``, ``store: false``, one API
key's responses invisible to another, the SQLite store shared by two workers, the bounds in count and
bytes and the expiry, and the Redis store shared by two servers (hosts)."""

from __future__ import annotations

import json
import re

import pytest

from tests.responses import PATH, city_tool, output_text, respond
from tests.server import concurrently, wait_until
from tests.services import RedisServer
from wsgi_app.http.response_store import RedisResponseStore, SqliteResponseStore, encode_record

ASK = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(serve_module):
    return serve_module(API_KEYS="key-a,key-b")


def auth(key: str) -> dict:
    return {"headers": {"Authorization": f"Bearer {key}"}}


def follow_and_whole(continuing, resending, first: dict, a: dict) -> tuple[dict, dict]:
    """Return the answer to "And then?" after ``first`` by ``previous_response_id`` (from
    ``continuing``) and by sending the whole conversation again (to ``resending``), at one seed."""
    follow = respond(
        continuing,
        {**ASK, "input": "And then?", "previous_response_id": first["id"], "seed": 2},
        **a,
    )
    whole = respond(
        resending,
        {
            **ASK,
            "input": [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": output_text(first)},
                {"role": "user", "content": "And then?"},
            ],
            "seed": 2,
        },
        **a,
    )
    return follow, whole


def test_previous_response_id_answers_as_the_whole_conversation(server):
    a = auth("key-a")
    first = respond(server, {**ASK, "input": "Hello", "seed": 1}, **a)
    follow, whole = follow_and_whole(server, server, first, a)
    assert output_text(follow) == output_text(whole)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert follow["previous_response_id"] == first["id"] and whole["previous_response_id"] is None
    # A chain of three: each link keeps the conversation before it.
    third = respond(
        server, {**ASK, "input": "Last.", "previous_response_id": follow["id"], "seed": 3}, **a
    )
    again = respond(
        server,
        {
            **ASK,
            "input": [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": output_text(first)},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": output_text(follow)},
                {"role": "user", "content": "Last."},
            ],
            "seed": 3,
        },
        **a,
    )
    assert output_text(third) == output_text(again)


def test_a_stored_function_call_is_answered_by_a_later_output(server):
    a = auth("key-a")
    ask = {"role": "user", "content": "Weather in Paris?"}
    tools = [city_tool()]
    called = respond(
        server,
        {
            "model": "m",
            "input": [ask],
            "tools": tools,
            "tool_choice": "required",
            "seed": 2,
            "max_output_tokens": 200,
        },
        **a,
    )
    (call,) = called["output"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}
    body = {"model": "m", "tools": tools, "seed": 4, "max_output_tokens": 12}
    follow = respond(server, {**body, "input": [result], "previous_response_id": called["id"]}, **a)
    sent_call = {k: call[k] for k in ("type", "call_id", "name", "arguments")}
    whole = respond(server, {**body, "input": [ask, sent_call, result]}, **a)
    assert output_text(follow) == output_text(whole)
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    # Without the stored call, the output answers nothing: a 400 naming it.
    status, _, raw = server.post(PATH, {**body, "input": [result]}, **a)
    assert status == 400 and json.loads(raw)["error"]["param"] == "input[0].call_id"


def test_get_and_delete_a_stored_response(server):
    a = auth("key-a")
    stored = respond(server, {**ASK, "input": "Hi", "seed": 5}, **a)
    status, headers, raw = server.get(f"{PATH}/{stored['id']}", **a)
    assert (status, headers["content-type"]) == (200, "application/json")
    assert json.loads(raw) == stored
    status, _, raw = server.request("DELETE", f"{PATH}/{stored['id']}", **a)
    assert (status, json.loads(raw)) == (
        200,
        {"id": stored["id"], "object": "response", "deleted": True},
    )
    for method in ("GET", "DELETE"):
        status, _, raw = server.request(method, f"{PATH}/{stored['id']}", **a)
        assert status == 404
        assert json.loads(raw)["error"] == {
            "message": f"Response with id '{stored['id']}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }


def test_concurrent_creates_reads_and_deletes_all_finish(serve):
    """30 clients each store, read and delete 10 responses at once: every call is answered (the
    store's calls run on the hub's thread pool one at a time, the lock taken by the greenlet; a
    lock taken in the pool threads left some calls asleep for good, their slots with them)."""
    srv = serve()

    def client(i: int) -> int:
        for n in range(10):
            stored = respond(srv, {**ASK, "input": f"hi {i} {n}", "max_output_tokens": 4})
            status, _, raw = srv.get(f"{PATH}/{stored['id']}", timeout_s=20)
            assert status == 200 and json.loads(raw)["id"] == stored["id"]
            status, _, _ = srv.request("DELETE", f"{PATH}/{stored['id']}", timeout_s=20)
            assert status == 200
        return 10

    assert sum(concurrently(client, 30, timeout_s=120)) == 300
    assert srv.state()["slots"]["busy"] == 0


def test_a_store_that_cannot_be_reached_is_a_503_and_an_answer_not_kept_says_so(serve):
    srv = serve(RESPONSES_REDIS_URL="redis://127.0.0.1:1/0")  # nothing listens on port 1
    answer = respond(srv, {**ASK, "input": "Hi"})
    assert answer["status"] in ("completed", "incomplete") and answer["store"] is False
    unavailable = {
        "message": "The response store is unavailable (ConnectionError); try again later.",
        "type": "server_error",
        "param": None,
        "code": "store_unavailable",
    }
    for method, path, body in (
        ("GET", f"{PATH}/{answer['id']}", None),
        ("DELETE", f"{PATH}/{answer['id']}", None),
        ("POST", PATH, {**ASK, "input": "More", "previous_response_id": answer["id"]}),
    ):
        status, _, raw = srv.request(method, path, body)
        assert (status, json.loads(raw)["error"]) == (503, unavailable), raw
    assert srv.get("/ready")[0] == 200  # the engine is fine


def test_store_false_keeps_nothing(server):
    a = auth("key-a")
    kept = respond(server, {**ASK, "input": "Hi", "store": False}, **a)
    assert kept["store"] is False
    assert server.get(f"{PATH}/{kept['id']}", **a)[0] == 404
    status, _, raw = server.post(
        PATH, {**ASK, "input": "x", "previous_response_id": kept["id"]}, **a
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "previous_response_id"


def test_a_stored_response_is_invisible_to_another_key(server):
    mine = respond(server, {**ASK, "input": "Secret"}, **auth("key-a"))
    b = auth("key-b")
    assert server.get(f"{PATH}/{mine['id']}", **b)[0] == 404
    assert server.request("DELETE", f"{PATH}/{mine['id']}", **b)[0] == 404
    status, _, raw = server.post(
        PATH, {**ASK, "input": "x", "previous_response_id": mine["id"]}, **b
    )
    assert status == 400 and json.loads(raw)["error"]["code"] == "previous_response_not_found"
    assert server.get(f"{PATH}/{mine['id']}", **auth("key-a"))[0] == 200  # still there


def pid_of(srv, request_id: str) -> int:
    """Return the pid of the worker whose log line answered ``request_id`` (written once the
    answer is: waited for)."""

    def logged() -> int | None:
        for line in srv.log_text().splitlines():
            if f'"request_id": "{request_id}"' in line:
                return int(re.search(r'"pid": (\d+)', line).group(1))
        return None

    return wait_until(logged, 10, f"the log line of {request_id}")


def test_two_workers_share_the_store(serve):
    srv = serve(workers=2)
    srv.wait_workers(2)
    status, headers, raw = srv.post(PATH, {**ASK, "input": "Hi"})
    assert status == 200
    stored = json.loads(raw)
    wrote = pid_of(srv, headers["x-request-id"])
    readers: set[int] = set()

    def read_elsewhere() -> bool:
        status, headers, raw = srv.get(f"{PATH}/{stored['id']}")
        assert status == 200 and json.loads(raw) == stored
        readers.add(pid_of(srv, headers["x-request-id"]))
        return bool(readers - {wrote})

    wait_until(read_elsewhere, 60, "a GET served by the other worker")


def test_the_oldest_go_past_the_count(serve):
    srv = serve(RESPONSES_MAX_COUNT="2")
    ids = [respond(srv, {**ASK, "input": f"Hi {i}"})["id"] for i in range(3)]
    assert [srv.get(f"{PATH}/{i}")[0] for i in ids] == [404, 200, 200]


def test_stored_responses_expire(serve):
    srv = serve(RESPONSES_TTL_S="1")
    stored = respond(srv, {**ASK, "input": "Hi"})["id"]
    wait_until(lambda: srv.get(f"{PATH}/{stored}")[0] == 404, 30, "the response to expire")


def put_five(store, record: dict, now: list[float]) -> None:
    """Put ``record`` five times, a second apart, into a store bounded to three of them by bytes:
    the two oldest are evicted, the three newest kept."""
    for i in range(5):
        now[0] += 1
        store.put("k", f"r{i}", record)
    assert [store.get("k", f"r{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]


def test_sqlite_store_bounds_bytes_and_count(tmp_path):
    record = {"response": {"id": "x"}, "items": ["y" * 100]}
    size = len(encode_record(record))
    now = [1000.0]
    store = SqliteResponseStore(str(tmp_path / "r.db"), 10, 3 * size, 60, clock=lambda: now[0])
    put_five(store, record, now)
    assert store.get("other", "r4") is None and not store.delete("other", "r4")
    assert store.delete("k", "r4") and store.get("k", "r4") is None
    now[0] += 61
    assert store.get("k", "r3") is None  # expired


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.services
def test_redis_store_is_shared_by_two_servers(redis_server, serve):
    env = {"RESPONSES_REDIS_URL": redis_server.url(3), "API_KEYS": "key-a,key-b"}
    one, two = serve(**env), serve(**env)
    a = auth("key-a")
    first = respond(one, {**ASK, "input": "Hello", "seed": 1}, **a)
    status, _, raw = two.get(f"{PATH}/{first['id']}", **a)
    assert status == 200 and json.loads(raw) == first
    assert two.get(f"{PATH}/{first['id']}", **auth("key-b"))[0] == 404
    follow, whole = follow_and_whole(two, one, first, a)
    assert output_text(follow) == output_text(whole)
    assert one.request("DELETE", f"{PATH}/{first['id']}", **a)[0] == 200
    assert two.get(f"{PATH}/{first['id']}", **a)[0] == 404
    keys = redis_server.client(3).keys("greenserve:responses:r:*")
    assert all(k.startswith(b"greenserve:responses:r:") for k in keys) and keys


@pytest.mark.services
def test_redis_store_bounds_bytes_and_count(redis_server):
    record = {"response": {"id": "x"}, "items": ["y" * 100]}
    size = len(encode_record(record))
    now = [1000.0]
    store = RedisResponseStore(redis_server.url(4), "t:", 10, 3 * size, 60, clock=lambda: now[0])
    put_five(store, record, now)
    client = redis_server.client(4)
    assert int(client.get("t:bytes")) == 3 * size and client.zcard("t:index") == 3
    assert store.get("other", "r4") is None and not store.delete("other", "r4")
    assert store.delete("k", "r4") and store.get("k", "r4") is None
    assert int(client.get("t:bytes")) == 2 * size
    counted = RedisResponseStore(redis_server.url(5), "c:", 2, 1 << 20, 60)
    for i in range(3):
        counted.put("k", f"r{i}", record)
    assert counted.get("k", "r0") is None and counted.get("k", "r2") is not None
    assert redis_server.client(5).ttl("c:r:k:r2") == 60
