"""The queue neither starves short requests nor keeps ones that cannot finish.

Order: first fit in arrival order. A waiter whose KV-cache bytes are not free yet (a long prompt)
is passed by later ones that fit beside the running requests; strict FIFO held a 31-token chat
behind eight long prompts until all ended 504. With ``DECODE_TOKENS_PER_S`` set, a queued request
whose ``max_tokens`` no longer fits before its deadline at that pace leaves the queue at once, a 504
(the same rule as the refusal at arrival), instead of holding its place until its deadline.

Source: docs/ARCHITECTURE.md §9 (admission).
"""

from __future__ import annotations

import json
import threading
import time

from tests.server import wait_until

LONG = [1] + [403] * 249  # 250 prompt tokens


def timed(srv, body: dict, out: dict, key: str) -> None:
    start = time.perf_counter()
    status, _, raw = srv.complete(body, timeout_s=60)
    out[key] = (status, time.perf_counter() - start, json.loads(raw), time.perf_counter())


def test_a_short_request_passes_long_ones_waiting_for_kv_bytes(stories_dir, serve):
    # stories260K holds 1,280 bytes of KV a token: 1 MiB is 819 tokens, one long request (250 +
    # 250) at a time, and a short one (3 + 4) beside it.
    srv = serve(
        MODEL_DIR=str(stories_dir), KV_CACHE_BUDGET_MB="1", GREENSERVE_FAULTS="slow_step_s=0.02"
    )
    long = {"model": "s", "prompt": LONG, "max_tokens": 250, "ignore_eos": True}
    out: dict = {}
    threads = [threading.Thread(target=timed, args=(srv, long, out, k)) for k in ("a", "b")]
    threads[0].start()
    wait_until(lambda: srv.state()["slots"]["busy"] == 1, 10, "the first long request to run")
    threads[1].start()
    wait_until(lambda: srv.state()["queue"]["waiting"] == 1, 10, "the second one to wait")
    short = {"model": "s", "prompt": [1, 403, 407], "max_tokens": 4, "ignore_eos": True}
    timed(srv, short, out, "c")
    assert "a" not in out, "the short request waited for the long one to finish"
    for t in threads:
        t.join(60)
    assert [out[k][0] for k in "abc"] == [200, 200, 200]
    assert out["c"][3] < out["a"][3] < out["b"][3]


def test_a_queued_request_that_cannot_finish_leaves_at_once(stories_dir, serve):
    # 10 tokens/s, 4 s: 30 tokens fit at arrival. The second request's 15 tokens need 2 s of the
    # 4 (at 75 %): past 2 s in the queue its deadline is unreachable, and the first holds the one
    # slot for ~3 s.
    srv = serve(
        MODEL_DIR=str(stories_dir),
        MAX_SLOTS="1",
        DECODE_TOKENS_PER_S="10",
        REQUEST_TIMEOUT_S="4",
        GREENSERVE_FAULTS="slow_step_s=0.1",
    )
    first = {"model": "s", "prompt": [1, 403, 407], "max_tokens": 30, "ignore_eos": True}
    out: dict = {}
    holder = threading.Thread(target=timed, args=(srv, first, out, "a"))
    holder.start()
    wait_until(lambda: srv.state()["slots"]["busy"] == 1, 10, "the first request to run")
    timed(srv, {**first, "max_tokens": 15}, out, "b")
    holder.join(30)
    status, elapsed_s, answer, done_at = out["b"]
    assert status == 504 and answer["error"]["code"] == "timeout", answer
    assert "cannot finish" in answer["error"]["message"]
    assert 1.5 < elapsed_s < 3.0, elapsed_s  # at its latest start (2 s), not its deadline (4 s)
    assert out["a"][0] == 200 and done_at < out["a"][3]  # it left while the slot was still held
    assert srv.wait_idle()["queue"]["waiting"] == 0
