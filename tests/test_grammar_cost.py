"""A constraint's token masks are its own request's cost: computed off the gevent hub, charged to that
request in CPU seconds, bounded per mask (``MAX_MASK_TOKEN_S``) and per request
(``MAX_MASK_REQUEST_S``); a constraint whose first masks cross the first bound is refused before
admission, one that crosses a bound while generating ends its request with a 400 naming it (an error
event in a stream), and its slot is freed."""

from __future__ import annotations

import json
import re

import pytest

from tests.server import HUB_MONITOR_ENV, assert_hub_never_blocked, concurrently, wait_until
from tests.sse import sse_events

# Its masks take ~16-42 ms of CPU each once past its first token, its first one ~0.05 ms: the check at
# compile time cannot see them. (The lexer's states of y{20000} are built lazily and kept with the
# compiled grammar: a later request with the same grammar finds the first ones built.)
AFTER_A_CHOICE = 'start: ("a" | "b") Y\nY: /y{20000}/'
TOKEN_BOUND = (
    r"'structured_outputs\.(regex|grammar)' cannot be enforced: its token masks cost too much: "
    r"one took \d+\.\d ms of CPU, over the limit of 5 ms a token \(MAX_MASK_TOKEN_S\)"
)
REQUEST_BOUND = (
    r"'structured_outputs\.regex' cannot be enforced: its token masks cost too much: they took "
    r"1\.\d\d s of CPU, over the limit of 1 s a request \(MAX_MASK_REQUEST_S\)"
)


def body(constraint: dict, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {
        "model": "m",
        "prompt": "x",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "structured_outputs": constraint,
        **extra,
    }


def rid(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


def logged(srv, request_id: str) -> dict:
    return wait_until(lambda: srv.log_line(request_id), what=f"{request_id}'s log line")


def assert_idle_and_ready(srv) -> None:
    srv.wait_idle()
    assert srv.get("/ready")[0] == 200


@pytest.fixture(scope="module")
def each_family(family, serve_module):
    """A server on each model family in turn, default mask bounds, the hub monitored."""
    return serve_module(**HUB_MONITOR_ENV, **family[1])


def test_a_constraint_whose_first_mask_is_too_costly_is_refused_before_admission(each_family):
    status, _, raw = each_family.complete(body({"regex": "y{20000}"}, 8))
    err = json.loads(raw)["error"]
    assert (status, err["param"], err["type"]) == (
        400,
        "structured_outputs.regex",
        "invalid_request_error",
    )
    assert re.fullmatch(TOKEN_BOUND, err["message"]), err["message"]
    # The refusal is cached: the same answer again, at once.
    assert each_family.complete(body({"regex": "y{20000}"}, 8))[2] == raw


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_mask_over_the_bound_while_generating_ends_the_request(each_family, stream):
    fresh = f"{AFTER_A_CHOICE}\n// {stream}"  # a grammar of its own, its lexer states unbuilt
    status, _, raw = each_family.complete(body({"grammar": fresh}, 8, stream))
    if stream:
        events = sse_events(raw)
        assert status == 200 and events[-1] == b"[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert "".join(texts) in ("a", "b")  # the one cheap token, then the costly mask
        err = json.loads(events[-2])["error"]
    else:
        assert status == 400
        err = json.loads(raw)["error"]
    assert (err["param"], err["type"]) == ("structured_outputs.grammar", "invalid_request_error")
    assert re.fullmatch(TOKEN_BOUND, err["message"]), err["message"]
    assert_idle_and_ready(each_family)
    assert_hub_never_blocked(each_family)


@pytest.fixture(scope="module")
def spinning(family, serve_module):
    """A server on each family whose every token mask also spins 0.15 s of CPU (a costly mask),
    bounded at 1 s a mask and 1 s a request, the hub monitored (it reports 0.1 s without a turn)."""
    return serve_module(
        GREENSERVE_FAULTS="mask_spin_s=0.15",
        MAX_MASK_TOKEN_S="1",
        MAX_MASK_REQUEST_S="1",
        **HUB_MONITOR_ENV,
        **family[1],
    )


def test_masks_run_off_the_hub_and_are_charged_to_their_request(spinning):
    def run(i: int):
        if i == 0:
            return spinning.complete(body({"regex": "[a-z]{4}"}, 4), headers=rid("costly"))
        return spinning.complete({"model": "m", "prompt": "x", "max_tokens": 64, "stream": True})

    (status, _, raw), (free_status, _, free) = concurrently(run, 2)
    choice = json.loads(raw)["choices"][0]
    assert status == 200 and re.fullmatch("[a-z]{4}", choice["text"])
    assert choice["finish_reason"] == "stop"
    assert free_status == 200 and sse_events(free)[-1] == b"[DONE]"
    line = logged(spinning, "costly")
    tokens = line["completion_tokens"]
    assert 1 <= tokens <= 4
    # Every one of its masks spun 0.15 s of CPU where it was computed: all charged to it.
    assert tokens * 0.15 <= line["mask_s"] < 1
    # Not on the hub: a 0.15 s spin there would leave it without a turn past the monitor's 0.1 s.
    assert_hub_never_blocked(spinning)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_masks_over_the_request_bound_end_it(spinning, stream):
    # 40 letters take at least 13 tokens; the 7th mask crosses 1 s (7 x 0.15 s).
    status, _, raw = spinning.complete(body({"regex": "[a-z]{40}"}, 40, stream))
    if stream:
        events = sse_events(raw)
        assert status == 200 and events[-1] == b"[DONE]"
        assert len(events) == 6 + 2  # the six tokens within the bound, the error, [DONE]
        err = json.loads(events[-2])["error"]
    else:
        assert status == 400
        err = json.loads(raw)["error"]
    assert err["param"] == "structured_outputs.regex"
    assert re.fullmatch(REQUEST_BOUND, err["message"]), err["message"]
    assert_idle_and_ready(spinning)


def test_each_request_is_charged_its_own_masks_in_a_batch(stories_dir, serve):
    """On the Llama engine the masks of a step are computed together: a cheap constraint beside a
    costly one in the same steps is charged its own masks, not a share of the step's."""
    srv = serve(MODEL_DIR=str(stories_dir), MAX_MASK_TOKEN_S="10", MAX_MASK_REQUEST_S="100")
    costly = body({"grammar": AFTER_A_CHOICE}, 24)
    cheap = body({"regex": "[a-z]{200}"}, 24)
    for warm in (costly, cheap):  # compiled first, so both start in the same step
        assert srv.complete({**warm, "max_tokens": 1})[0] == 200
    results = concurrently(
        lambda i: srv.complete([costly, cheap][i], headers=rid(["costly", "cheap"][i])), 2
    )
    assert [status for status, _, _ in results] == [200, 200]
    lines = {rid: logged(srv, rid) for rid in ("costly", "cheap")}
    assert lines["costly"]["completion_tokens"] == lines["cheap"]["completion_tokens"] == 24
    # ~26 ms a mask against ~0.02 ms: shared by the step, the cheap one would pay half of both.
    assert lines["cheap"]["mask_s"] * 10 < lines["costly"]["mask_s"]


def test_a_request_computes_no_mask_past_its_bound(spinning, family):
    """Once one choice's mask crosses the request's bound, the others compute no more: on the
    Llama engine, whose step computes every choice's mask, the request pays for the mask that
    crossed, not for the rest of that step's."""
    if family[0] == "bigram":
        pytest.skip("the bigram's choices compute their masks one at a time, ahead by one")
    four = {**body({"regex": "[a-z]{40}"}, 40), "n": 4}
    status, _, raw = spinning.complete(four, headers=rid("four"))
    assert status == 400 and re.fullmatch(REQUEST_BOUND, json.loads(raw)["error"]["message"])
    # Four masks a step of 0.15 s: the 7th crosses 1 s; the 8th, in the same step, is not computed.
    assert 7 * 0.15 <= logged(spinning, "four")["mask_s"] < 8 * 0.15
