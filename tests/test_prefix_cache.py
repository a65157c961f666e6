"""Prefix caching never changes an answer: stories260K on real gunicorn servers, the cache on and off.

Every case runs on a server with the cache off (the reference) and one with it on, cold and again
(a full hit), alone and all at once in one batch, greedy and seeded, with logprobs: the choices
(text, tokens, logprobs, top alternatives, finish reasons) are the same bytes, and only
``usage.prompt_tokens_details.cached_tokens`` tells the runs apart. Prompts are token ids; blocks are
16 tokens, so a prompt of 300 tokens caches 18 blocks (288 tokens), and a prompt of exactly 256 reuses
15 blocks and computes its last one again (its last logits come only from that), until its own prompt
end (its last partial block and its last logits) is cached: a repeat reuses it all. A sequence also
publishes the whole blocks of its answer when it ends (the next turn of a conversation reuses them:
tests/test_prefix_turns.py).
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import numpy as np
import pytest

from model.engine import GenerationRequest
from model.llama.forward.model import Llama
from model.llama.serving.prefix_cache import BLOCK_TOKENS, PrefixCache
from model.llama.serving.scheduler import BatchScheduler
from model.sampling import SamplingParams
from tests.decoding import run_to_end
from tests.llamafiles import convert_stories
from tests.server import GunicornServer, concurrently, wait_until
from tests.sse import events
from wsgi_app.settings import Settings

BLOCK = BLOCK_TOKENS
_rng = np.random.default_rng(28)
BASE = [1] + [int(t) for t in _rng.integers(3, 512, 480)]  # BOS, then ids of the 512-token vocab
OTHER = [1] + [int(t) for t in _rng.integers(3, 512, 480)]
# name -> (prompt ids, tokens its first request reuses in this order: whole blocks of the earlier
# prompts, leaving a position to compute; a repeat reuses the whole prompt)
CASES = {
    "300 tokens": (BASE[:300], 0),
    "256 tokens, whole blocks": (BASE[:256], 240),
    "256 + a new tail": (BASE[:256] + OTHER[1:40], 256),
    "200 + a new tail": (BASE[:200] + OTHER[1:100], 192),
    "128 and one token": (BASE[:129], 128),
    "short": (BASE[:60], 48),
    "other 400": (OTHER[:400], 0),
}
SAMPLINGS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 2828},
}


def body(prompt: list[int], sampling: dict, **extra) -> dict:
    return {
        "model": "stories",
        "prompt": prompt,
        "max_tokens": 24,
        "logprobs": 3,
        "ignore_eos": True,
        **sampling,
        **extra,
    }


@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory):
    return convert_stories(tmp_path_factory.mktemp("stories260K"))


def start(tmp_path_factory, stories_dir, name: str, **env: str) -> GunicornServer:
    settings = {"MODEL_DIR": str(stories_dir), "STATS_FLUSH_S": "0.1", **env}
    return GunicornServer(
        tmp_path_factory.mktemp(name), settings, health_port=False
    )  # `with` starts it


@pytest.fixture(scope="module")
def off(tmp_path_factory, stories_dir):
    with start(tmp_path_factory, stories_dir, "prefix-off", PREFIX_CACHE="0") as srv:
        yield srv


@pytest.fixture(scope="module")
def on(tmp_path_factory, stories_dir):
    with start(tmp_path_factory, stories_dir, "prefix-on") as srv:
        yield srv


def answer(srv: GunicornServer, payload: dict, headers: dict | None = None) -> dict:
    status, _, raw = srv.complete(payload, headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def same_choices(got: dict, want: dict) -> None:
    assert got["choices"] == want["choices"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][key] == want["usage"][key]


def cached(doc: dict) -> int:
    usage = doc["usage"]
    assert list(usage) == [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    ]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_cache_on_or_off_cold_warm_alone_or_batched_gives_the_same_bits(off, on, stories_dir):
    cases = [(name, s) for name in CASES for s in SAMPLINGS]
    want = {}
    for name, s in cases:
        want[name, s] = answer(off, body(CASES[name][0], SAMPLINGS[s]))
        assert "prompt_tokens_details" not in want[name, s]["usage"]  # no cache: no details
    # One at a time, in order: each prompt's first request reuses the blocks of those before it,
    # its second (the other sampling) the whole prompt.
    for name, s in cases:
        got = answer(on, body(CASES[name][0], SAMPLINGS[s]))
        same_choices(got, want[name, s])
        first = s == "greedy"
        assert cached(got) == (CASES[name][1] if first else len(CASES[name][0])), name
    # Again, alone: whole prompts from the cache.
    for name, s in cases:
        got = answer(on, body(CASES[name][0], SAMPLINGS[s]))
        same_choices(got, want[name, s])
        assert cached(got) == len(CASES[name][0]), name
    # Warm and all at once: one batch of hits, of partial hits and of a miss.
    got = concurrently(
        lambda i: answer(on, body(CASES[cases[i][0]][0], SAMPLINGS[cases[i][1]])), len(cases)
    )
    for (name, s), doc in zip(cases, got, strict=True):
        same_choices(doc, want[name, s])
        assert cached(doc) == len(CASES[name][0]), name
    state = on.state()
    # The same requests in-process hold the same entries: every whole block of each prompt and
    # each answer (but its last token), and one prompt end per prompt (its last partial block
    # and its 512 float32 logits).
    blocks = replayed_blocks(stories_dir, [(CASES[name][0], SAMPLINGS[s]) for name, s in cases])
    assert (state["prefix_cache"]["blocks"], state["prefix_cache"]["prompt_ends"]) == (blocks, 7)
    tails = sum(len(p) % BLOCK for p, _ in CASES.values())
    nbytes = (blocks * BLOCK + tails) * 1280 + 7 * 512 * 4
    assert state["kv_cache_bytes"]["cached"] == state["prefix_cache"]["bytes"] == nbytes


def replayed_blocks(stories_dir, requests: list[tuple[list[int], dict]]) -> int:
    """Return the whole blocks a scheduler caches for ``requests`` (their body's sampling), run one
    at a time in-process: what a server that answered them holds (with room for all)."""
    model = Llama.load(stories_dir)
    cache = PrefixCache.for_model(model.config, BLOCK, 1 << 30)
    sched = BatchScheduler(model, frozenset(), 4, prefix_cache=cache)
    for prompt, sampling in requests:
        params = SamplingParams(
            temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0)
        )
        seed = sampling.get("seed", 0)
        req = GenerationRequest(tuple(prompt), 24, params, seed, logprobs=3, ignore_eos=True)
        run_to_end(sched, [req])
    return cache.blocks


def test_first_pass_of_a_batch_publishes_only_finished_prefills(off, tmp_path_factory, stories_dir):
    """Sequences that prefill together reuse nothing of each other: blocks of a running prefill are
    never hit, and all of them still answer as without the cache."""
    with start(tmp_path_factory, stories_dir, "prefix-batch") as srv:
        prompts = [BASE[:300], BASE[:300] + [5], BASE[:256], OTHER[:200]]
        want = [answer(off, body(p, SAMPLINGS["seeded"])) for p in prompts]
        got = concurrently(
            lambda i: answer(srv, body(prompts[i], SAMPLINGS["seeded"])), len(prompts)
        )
        for doc, ref in zip(got, want, strict=True):
            same_choices(doc, ref)
        again = answer(srv, body(BASE[:300] + [5], SAMPLINGS["seeded"]))
        assert again["choices"] == want[1]["choices"] and cached(again) == 301


def last_usage(srv: GunicornServer, payload: dict) -> dict:
    status, _, raw = srv.complete(
        {**payload, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200, raw
    data = [e["data"] for e in events(raw)]
    assert data[-1] == "[DONE]"
    return json.loads(data[-2])["usage"]


def test_stream_and_include_usage_report_cached_tokens(off, on):
    payload = body(CASES["300 tokens"][0], SAMPLINGS["greedy"])
    answer(on, payload)  # primed
    assert last_usage(on, payload) == {
        "prompt_tokens": 300,
        "completion_tokens": 24,
        "total_tokens": 324,
        "prompt_tokens_details": {"cached_tokens": 300},
    }
    assert last_usage(off, payload) == {
        "prompt_tokens": 300,
        "completion_tokens": 24,
        "total_tokens": 324,
    }


def test_n_choices_and_a_list_of_prompts_count_each_prompt_once(off, on):
    prompts = [CASES["300 tokens"][0], CASES["other 400"][0]]
    for p in prompts:
        answer(on, body(p, SAMPLINGS["greedy"]))
    payload = body(prompts, {**SAMPLINGS["seeded"], "n": 2})
    got, want = answer(on, payload), answer(off, payload)
    same_choices(got, want)
    assert cached(got) == 300 + 400


def test_salts_isolate_api_keys_and_cache_salt(off, tmp_path_factory, stories_dir):
    with start(tmp_path_factory, stories_dir, "prefix-keys", API_KEYS="key-a,key-b") as srv:
        prompt = BASE[:300]
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        want = answer(off, body(prompt, SAMPLINGS["greedy"]))
        assert cached(answer(srv, body(prompt, SAMPLINGS["greedy"]), a)) == 0
        assert cached(answer(srv, body(prompt, SAMPLINGS["greedy"]), b)) == 0  # another tenant
        salted = body(prompt, SAMPLINGS["greedy"], cache_salt="team-1")
        assert cached(answer(srv, salted, a)) == 0  # another salt, same key
        got = answer(srv, body(prompt, SAMPLINGS["greedy"]), a)
        assert cached(got) == 300
        same_choices(got, want)
        assert cached(answer(srv, salted, a)) == 300
        assert cached(answer(srv, salted, b)) == 0
        status, _, raw = srv.complete({**salted, "cache_salt": ""}, headers=a)
        assert status == 400
        assert json.loads(raw)["error"]["param"] == "cache_salt"
        status, _, raw = srv.post(
            "/v1/chat/completions", {"model": "s", "messages": [], "cache_salt": 7}, headers=a
        )
        assert status == 400 and json.loads(raw)["error"]["param"] in ("cache_salt", "messages")


def test_metrics_and_the_log_line_count_hits_and_misses(on):
    prompt = OTHER[:300]
    answer(on, body(prompt, SAMPLINGS["greedy"]))
    doc = answer(on, body(prompt, SAMPLINGS["greedy"]), {"X-Request-Id": "prefix-log"})
    assert cached(doc) == 300
    hit = on.state()["prefix_cache"]["hit_tokens"]

    def metric(name: str) -> float:
        status, _, text = on.get("/metrics")
        assert status == 200
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return -1.0

    wait_until(
        lambda: metric("greenserve_prefix_cache_hit_tokens_total") == hit, what="the hit metric"
    )
    assert metric("greenserve_prefix_cache_miss_tokens_total") > 0
    assert metric("greenserve_prefix_cache_evicted_blocks_total") == 0
    logged = wait_until(
        lambda: [x for x in on.log_text().splitlines() if '"request_id": "prefix-log"' in x],
        what="the log line",
    )
    assert json.loads(logged[-1])["cached_tokens"] == 300


def test_answers_hold_while_other_sequences_evict_and_reuse_blocks(
    off, tmp_path_factory, stories_dir
):
    """A budget of 1 MiB holds a few blocks beside the running requests: rounds of concurrent
    requests over shared and private prefixes keep evicting and reusing blocks, and every answer is
    still the bits of the cache-off server."""
    families = [[1] + [3 + (53 * f + 29 * t) % 509 for t in range(255)] for f in range(4)]
    prompts = [fam + OTHER[1 + 7 * i : 40 + 7 * i] for i, fam in enumerate(families * 2)]
    want = [answer(off, body(p, SAMPLINGS["seeded"])) for p in prompts]
    with start(tmp_path_factory, stories_dir, "prefix-evict", KV_CACHE_BUDGET_MB="1") as srv:
        hits = 0
        for round_ in range(3):
            order = [(i * 3 + round_) % len(prompts) for i in range(len(prompts))]
            got = concurrently(
                lambda i, order=order: answer(srv, body(prompts[order[i]], SAMPLINGS["seeded"])),
                len(prompts),
            )
            for i, doc in zip(order, got, strict=True):
                same_choices(doc, want[i])
                hits += cached(doc)
        state = srv.state()["prefix_cache"]
        assert state["evicted_blocks"] > 0 and hits > 0, state
        assert state["bytes"] <= 1 << 20


def test_the_setting_turns_the_cache_off_and_is_checked():
    assert Settings.from_env({}).prefix_cache is True
    assert Settings.from_env({"PREFIX_CACHE": "0"}).prefix_cache is False
    with pytest.raises(ValueError, match="PREFIX_CACHE"):
        Settings.from_env({"PREFIX_CACHE": "2"})


def test_the_eventsource_stream_takes_cache_salt_from_its_query(on):
    """The ``GET`` stream carries no usage: the cache's own count of hit tokens shows the salt."""
    text = "Once upon a time, a little dog found a red ball in the park. " * 20
    primed = answer(on, body(text, SAMPLINGS["greedy"], cache_salt="get-salt", max_tokens=2))
    query = urlencode({"model": "s", "prompt": text, "max_tokens": 2, "temperature": 0})
    sse = {"Accept": "text/event-stream"}
    for salt, full in (("get-salt", True), ("another", False)):
        before = on.state()["prefix_cache"]["hit_tokens"]
        status, _, raw = on.get(f"/v1/completions?{query}&cache_salt={salt}", headers=sse)
        assert status == 200, raw
        assert events(raw)[-1]["data"] == "[DONE]"
        hits = on.state()["prefix_cache"]["hit_tokens"] - before
        assert hits == (primed["usage"]["prompt_tokens"] if full else 0)
