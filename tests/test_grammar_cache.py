"""The compiled-grammar cache is kept per tenant (API key and ``cache_salt``, as the prefix cache
salts its blocks), bounded by an estimate of its bytes (``GRAMMAR_CACHE_MB``), and never keeps a
grammar estimated over a 32nd of that budget; ``/debug/state`` shows its entries and bytes."""

from __future__ import annotations

import pytest

BUDGET = 4 << 20  # GRAMMAR_CACHE_MB=4: entries of up to 128 KiB are kept


@pytest.fixture(scope="module")
def keyed(serve_module):
    """A bigram server with two API keys and a 4 MiB grammar cache."""
    return serve_module(API_KEYS="key-a,key-b", GRAMMAR_CACHE_MB="4")


def constrained(srv, constraint: dict, key: str = "key-a", **extra) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "structured_outputs": constraint}
    status, _, raw = srv.complete({**body, **extra}, headers={"Authorization": f"Bearer {key}"})
    assert status == 200, raw


def grammars(srv) -> dict:
    return srv.state()["grammars"]


def schema(i: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]}


def test_a_compiled_grammar_is_kept_per_tenant(keyed):
    constrained(keyed, {"json": schema(-1)})
    before = grammars(keyed)["cache_entries"]
    constrained(keyed, {"json": schema(-1)})  # the same tenant: from its cache
    assert grammars(keyed)["cache_entries"] == before
    constrained(keyed, {"json": schema(-1)}, key="key-b")  # another key: its own entry
    assert grammars(keyed)["cache_entries"] == before + 1
    constrained(keyed, {"json": schema(-1)}, cache_salt="s")  # another salt: its own too
    assert grammars(keyed)["cache_entries"] == before + 2
    constrained(keyed, {"json": schema(-1)}, key="key-b")
    assert grammars(keyed)["cache_entries"] == before + 2


def test_the_cache_stays_within_its_bytes(keyed):
    for i in range(80):  # ~83 KiB each by the estimate: 80 of them are 6.5 MiB
        constrained(keyed, {"json": schema(i)})
        state = grammars(keyed)
        assert state["cache_budget_bytes"] == BUDGET
        assert 0 < state["cache_bytes"] <= BUDGET
    assert state["cache_entries"] < 80  # the least recently used went


def test_a_grammar_too_large_to_keep_is_compiled_every_time(keyed):
    choices = [f"a choice of some length, number {i:03d}" for i in range(100)]  # 4 kB
    constrained(keyed, {"json": schema(-2)})
    state = grammars(keyed)
    for _ in range(2):
        constrained(keyed, {"choice": choices})
        assert grammars(keyed) == state  # compiled, answered, not kept
