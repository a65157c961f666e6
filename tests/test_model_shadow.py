"""Shadow variants (``shadow = P`` in a ``[models.NAME.variants.V]`` table): a sampled copy of the
requests a model's primary variant answers in full, generated again on the shadow's engine while
the worker is idle, never sent, its tokens compared with the primary's (``/metrics``, ``/stats``).

One server (one worker) serves bigrams trained on ``xyz`` and on ``xyzw``: model ``twin`` has a
shadow of its own weights (every request), ``cross`` a shadow trained on ``xyzw`` (greedily after
``x``: ``yzxyzx`` against ``yzwxyz``, first differing at token 2), ``half`` a canary and a shadow
that mirrors half the requests. A second server serves ``twin`` without a shadow, to compare the
answers byte for byte; a third slows its shadows' steps (``GREENSERVE_FAULTS=shadow_step_s``) to
catch one running.

Each test waits for a mirrored request's outcome before sending the next request: a client's
request admitted while a shadow runs preempts it (the test of that does so on purpose).
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from model.engine import Step
from telemetry.metrics import Metrics
from tests.loglines import wait_for
from tests.modelfiles import version, write_trained
from tests.scrape import samples, scrape, value
from tests.server import GunicornServer, failed_start, wait_until
from tests.sse import sse_events
from wsgi_app.generation.choice import TokenTrace
from wsgi_app.generation.registry import PRIMARY, ServedModel, bucket, split
from wsgi_app.generation.shadow import QUEUE_BOUND, ShadowJob, ShadowRunner
from wsgi_app.generation.shadow_check import ChoiceCheck, Divergence
from wsgi_app.models_file import read_models_file

SALT = "shadow-salt"
SHADOWED = """
default = "twin"

[models.twin]
source = "xyz"

[models.twin.variants.copy]
source = "xyz"
shadow = 100

[models.cross]
source = "xyz"

[models.cross.variants.w]
source = "xyzw"
shadow = 100

[models.half]
source = "xyz"

[models.half.variants.canary]
source = "xyz"
weight = 50

[models.half.variants.copy]
source = "xyz"
shadow = 50
"""
PLAIN = '[models.twin]\nsource = "xyz"\n'
SLOW = (
    '[models.twin]\nsource = "xyz"\n\n[models.twin.variants.copy]\nsource = "xyz"\nshadow = 100\n'
)
FAIL_AT = 40  # shadow_fail_at: a shadow of a longer answer fails (as its engine's own failure)
OUTCOMES = ("exact", "diverged", "dropped")
REASONS = ("queue_full", "preempted", "failed", "shutdown")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shadow")
    write_trained(root / "xyz", b"xyz")
    write_trained(root / "xyzw", b"xyzw")
    for name, text in (("shadowed", SHADOWED), ("plain", PLAIN), ("slow", SLOW)):
        (root / f"{name}.toml").write_text(text)
    return root


def _serve(
    models_dir: Path, tmp: pytest.TempPathFactory, name: str, **env: str
) -> Iterator[GunicornServer]:
    """Run a server of the models file ``name`` while the module's tests use it."""
    env = {"MODELS_FILE": str(models_dir / f"{name}.toml"), "VARIANT_SALT": SALT, **env}
    srv = GunicornServer(tmp.mktemp(f"shadow-{name}"), env).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory) -> Iterator[GunicornServer]:
    faults = f"shadow_fail_at={FAIL_AT}"
    yield from _serve(models_dir, tmp_path_factory, "shadowed", GREENSERVE_FAULTS=faults)


@pytest.fixture(scope="module")
def plain(models_dir, tmp_path_factory) -> Iterator[GunicornServer]:
    yield from _serve(models_dir, tmp_path_factory, "plain")


@pytest.fixture(scope="module")
def slow(models_dir, tmp_path_factory) -> Iterator[GunicornServer]:
    yield from _serve(models_dir, tmp_path_factory, "slow", GREENSERVE_FAULTS="shadow_step_s=0.1")


@pytest.fixture(scope="module")
def masked(models_dir, tmp_path_factory) -> Iterator[GunicornServer]:
    """``twin`` and its shadow, each mask spun to 10 ms, 0.3 s of masks allowed a request."""
    yield from _serve(
        models_dir,
        tmp_path_factory,
        "slow",
        GREENSERVE_FAULTS="mask_spin_s=0.01",
        MAX_MASK_REQUEST_S="0.3",
        MAX_MASK_TOKEN_S="0.05",
    )


# -- reading the server's counts ------------------------------------------------------------------


def counts(srv: GunicornServer, model: str, variant: str) -> dict[str, int]:
    """The shadow's outcomes and drop reasons, from ``/metrics``."""
    metrics = scrape(srv)
    out = {
        o: int(
            value(
                metrics,
                "greenserve_shadow_requests",
                "greenserve_shadow_requests_total",
                model=model,
                variant=variant,
                outcome=o,
            )
        )
        for o in OUTCOMES
    }
    for r in REASONS:
        out[r] = int(
            value(
                metrics,
                "greenserve_shadow_dropped",
                "greenserve_shadow_dropped_total",
                model=model,
                variant=variant,
                reason=r,
            )
        )
    return out


def mirrored(srv: GunicornServer, model: str, variant: str) -> int:
    c = counts(srv, model, variant)
    return sum(c[o] for o in OUTCOMES)


def settled(srv: GunicornServer, model: str, variant: str, total: int) -> dict[str, int]:
    """Poll until ``total`` requests were mirrored to the shadow and none runs or waits; return
    the counts."""
    seen: list = []

    def done() -> dict[str, int] | None:
        seen[:] = [counts(srv, model, variant), srv.state()["shadows"]]
        c, state = seen
        idle = state["running"] is None and state["pending"] == 0
        return c if idle and sum(c[o] for o in OUTCOMES) == total else None

    return wait_until(done, 20.0, lambda: f"{total} mirrored requests to settle; saw {seen}")


def requests_total(srv: GunicornServer) -> int:
    """``greenserve_requests_total`` over every label."""
    family = scrape(srv).get("greenserve_requests", {})
    return int(sum(v for (name, _), v in family.items() if name == "greenserve_requests_total"))


_VOLATILE = re.compile(rb'"(id|created|created_at)":\s*("[^"]*"|\d+)')


def answer(srv: GunicornServer, path: str, body: dict, headers: dict | None = None) -> bytes:
    """A 200 answer's bytes without its id and creation time; of a stream, its ``data:`` events."""
    status, _, raw = srv.post(path, body, headers=headers or {})
    assert status == 200, raw
    raw = _VOLATILE.sub(rb'"\1":_', raw)
    return b"\n".join(sse_events(raw)) if body.get("stream") else raw


CHAT = [{"role": "user", "content": "xy"}]
SAME_WEIGHTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": "xyz", "max_tokens": 12, "temperature": 1, "seed": 7, "n": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "temperature": 0, "stream": True}),
    (
        "/v1/completions",
        {"prompt": "zx", "max_tokens": 10, "temperature": 1, "seed": 3, "n": 2, "stream": True},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9, "temperature": 1, "seed": 11}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 9, "temperature": 1, "seed": 5, "n": 2, "stream": True},
    ),
    ("/v1/responses", {"input": "xy", "max_output_tokens": 8, "temperature": 1, "seed": 4}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 8, "temperature": 0}),
]


def test_a_shadow_of_the_same_weights_matches_every_token(server, plain):
    before = counts(server, "twin", "copy")
    sent = requests_total(server)
    for n, (path, body) in enumerate(SAME_WEIGHTS, start=1):
        body = {"model": "twin", **body}
        # The client's answer is the one a server without the shadow gives, byte for byte.
        assert answer(server, path, body) == answer(plain, path, body)
        settled(server, "twin", "copy", sum(before[o] for o in OUTCOMES) + n)
    # An unseeded request is mirrored with the seed it drew.
    for n, path in enumerate(("/v1/completions", "/v1/chat/completions"), start=1):
        body = {"model": "twin", "max_tokens": 12, "temperature": 1, "n": 2}
        body |= {"messages": CHAT} if "chat" in path else {"prompt": "y"}
        answer(server, path, body)
        settled(server, "twin", "copy", sum(before[o] for o in OUTCOMES) + len(SAME_WEIGHTS) + n)
    after = counts(server, "twin", "copy")
    assert {k: after[k] - before[k] for k in after} == {
        "exact": len(SAME_WEIGHTS) + 2,
        "diverged": 0,
        "dropped": 0,
        **dict.fromkeys(REASONS, 0),
    }
    # Shadow work is no client request: only the client's own are counted.
    assert requests_total(server) - sent == len(SAME_WEIGHTS) + 2
    status, _, raw = server.get("/stats")
    shadow = json.loads(raw)["shadows"]["twin"]["copy"]
    assert shadow == {
        "mirrored": after["exact"],
        "exact": after["exact"],
        "diverged": 0,
        "dropped": 0,
        "exact_ratio": 1.0,
        "dropped_by_reason": dict.fromkeys(REASONS, 0),
    }


def tokens(srv: GunicornServer, body: dict, headers: dict | None = None) -> list[list[str]]:
    """Each choice's tokens (``logprobs.tokens``) of a completion's answer."""
    status, _, raw = srv.complete(body, headers=headers or {})
    assert status == 200, raw
    return [c["logprobs"]["tokens"] for c in json.loads(raw)["choices"]]


def first_difference(a: list[str], b: list[str]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one is the
    other's start), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_a_shadow_of_other_weights_reports_where_it_diverges(server):
    bodies = [
        {"prompt": "x", "max_tokens": 6, "temperature": 0},  # yzxyzx / yzwxyz: token 2
        {"prompt": "x", "max_tokens": 2, "temperature": 0},  # yz / yz: exact
        {"prompt": "xy", "max_tokens": 16, "temperature": 1, "seed": 8, "n": 2},
        {"prompt": "z", "max_tokens": 16, "temperature": 1, "seed": 3, "n": 2},
    ]
    positions: list[int] = []
    exact = diverged = 0
    before = counts(server, "cross", "w")
    histogram = scrape(server)
    for n, body in enumerate(bodies, start=1):
        body = {"model": "cross", "logprobs": 0, **body}
        primary = tokens(server, body, {"X-Request-Id": f"div-{n}"})
        # The shadow's own answer to the same request: pinned, which is never mirrored.
        own = tokens(server, body, {"X-Model-Variant": "w"})
        found = [first_difference(a, b) for a, b in zip(primary, own, strict=True)]
        positions += [p for p in found if p is not None]
        diverged += any(p is not None for p in found)
        exact += all(p is None for p in found)
        settled(server, "cross", "w", sum(before[o] for o in OUTCOMES) + n)
    # What the pinned answers said: the first at 2; seed 8's choice 0 at 13, choice 1 exact;
    # seed 3's choice 0 exact, choice 1 at its first token.
    assert (positions, exact, diverged) == ([2, 13, 0], 1, 3)
    after = counts(server, "cross", "w")
    assert (after["exact"] - before["exact"], after["diverged"] - before["diverged"]) == (
        exact,
        diverged,
    )
    # One histogram observation per diverged choice, at its position.
    now = scrape(server)
    key = "greenserve_shadow_first_divergence_tokens"

    def grew(sample: str, **labels: str) -> float:
        labels |= {"model": "cross", "variant": "w"}
        return value(now, key, key + sample, **labels) - value(
            histogram, key, key + sample, **labels
        )

    assert (grew("_count"), grew("_sum")) == (len(positions), sum(positions))
    for le in ("0.0", "1.0", "2.0", "4.0", "8.0", "16.0"):
        assert grew("_bucket", le=le) == sum(p <= float(le) for p in positions), le
    # The log names the request, the choice, the position and both tokens: x (120) against w (119).
    (line,) = wait_for(
        server, lambda x: x.get("message") == "shadow diverged" and x.get("request_id") == "div-1"
    )
    assert {k: line[k] for k in ("model", "variant", "choice", "position")} == {
        "model": "cross",
        "variant": "w",
        "choice": 0,
        "position": 2,
    }
    assert (line["primary_token"], line["shadow_token"], line["level"]) == (120, 119, "INFO")


def test_only_unpinned_requests_of_the_primary_are_sampled(server):
    before = mirrored(server, "half", "copy")
    want = 0
    for k in range(16):
        body = {"model": "half", "prompt": "x", "max_tokens": 3, "user": f"u-{k}"}
        headers = {"X-Request-Id": f"half-{k}"}
        if k % 4 == 3:  # pinned to the primary: the operator's own check, never mirrored
            headers["X-Model-Variant"] = PRIMARY
        answer(server, "/v1/completions", body, headers)
        variants = [
            ServedModel("half", (), None, None, PRIMARY, 50.0),  # type: ignore[arg-type]
            ServedModel("half", (), None, None, "canary", 50.0),
        ]  # type: ignore[arg-type]
        primary = split(variants, SALT, f"user:u-{k}").variant == PRIMARY
        if primary and k % 4 != 3 and bucket(SALT, f"half-{k}") < 50:
            want += 1
            settled(server, "half", "copy", before + want)
    assert 0 < want < 12  # the split and the sampling both left some out
    assert settled(server, "half", "copy", before + want)["exact"] >= want


def test_a_failing_shadow_is_counted_and_leaves_readiness_alone(server):
    before = counts(server, "twin", "copy")
    body = {"model": "twin", "prompt": "x", "max_tokens": FAIL_AT + 5, "temperature": 0}
    status, _, raw = server.complete(body)
    assert status == 200 and len(json.loads(raw)["choices"][0]["text"]) == FAIL_AT + 5
    after = settled(server, "twin", "copy", sum(before[o] for o in OUTCOMES) + 1)
    assert (after["dropped"] - before["dropped"], after["failed"] - before["failed"]) == (1, 1)
    # The shadow's engine failed (GREENSERVE_FAULTS makes it its engine's own failure): the
    # worker stays ready, and the primary answers as before.
    assert server.get("/ready", port=server.health_port)[0] == 200
    assert server.complete({**body, "max_tokens": 4})[0] == 200


def test_models_lists_a_shadow_with_its_percentage(server, models_dir):
    cards = {c["id"]: c for c in json.loads(server.get("/v1/models")[2])["data"]}
    v = version(models_dir / "xyz")
    assert cards["twin"]["variants"] == [
        {"variant": "primary", "weight": 100.0, "version": v},
        {"variant": "copy", "weight": 0.0, "shadow": 100.0, "version": v},
    ]
    assert cards["half"]["variants"][1:] == [
        {"variant": "canary", "weight": 50.0, "version": v},
        {"variant": "copy", "weight": 0.0, "shadow": 50.0, "version": v},
    ]


def test_a_llama_shadow_of_the_same_weights_matches_every_token(stories_dir, tmp_path):
    # The batching engine on its thread: ticks, seeds, n choices, stories that end on their own.
    path = tmp_path / "models.toml"
    path.write_text(
        f'[models.s]\nsource = "{stories_dir}"\n'
        f'[models.s.variants.copy]\nsource = "{stories_dir}"\nshadow = 100\n'
    )
    srv = GunicornServer(tmp_path / "run", {"MODELS_FILE": str(path)}).start()
    try:
        bodies = [
            {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 1, "seed": 3, "n": 2},
            {"prompt": "Lily", "max_tokens": 256, "temperature": 0},  # its story ends at 224
            {"prompt": "The cat", "max_tokens": 60, "temperature": 0.8, "n": 3, "stream": True},
        ]
        ended = False
        for n, body in enumerate(bodies, start=1):
            status, _, raw = srv.complete({"model": "s", **body})
            assert status == 200, raw
            if not body.get("stream"):
                ended |= "stop" in [c["finish_reason"] for c in json.loads(raw)["choices"]]
            settled(srv, "s", "copy", n)
        assert ended  # some story ended before max_tokens: the shadow's ended there too
        assert counts(srv, "s", "copy") == {
            "exact": 3,
            "diverged": 0,
            "dropped": 0,
            **dict.fromkeys(REASONS, 0),
        }
    finally:
        srv.stop()


# -- priority: preempted by clients, a bounded queue -----------------------------------------------


def test_a_client_request_preempts_a_running_shadow(slow):
    before = counts(slow, "twin", "copy")
    body = {"model": "twin", "prompt": "x", "max_tokens": 40, "temperature": 0}
    assert slow.complete(body, headers={"X-Request-Id": "long"})[0] == 200
    # Its shadow runs now (0.1 s a token, 4 s in all) ...
    wait_until(lambda: (slow.state()["shadows"]["running"] or {}).get("request_id") == "long")
    # ... and a client's request is served at once, as if there were none.
    status, _, raw = slow.complete({**body, "max_tokens": 3})
    assert (status, json.loads(raw)["choices"][0]["text"]) == (200, "yzx")
    after = settled(slow, "twin", "copy", sum(before[o] for o in OUTCOMES) + 2)
    assert {k: after[k] - before[k] for k in ("exact", "dropped", "preempted")} == {
        "exact": 1,  # the second request's own shadow, once the worker was idle again
        "dropped": 1,
        "preempted": 1,
    }


def _pinned_stream(port: int, body: dict, variant: str) -> socket.socket:
    """Send a streamed completion pinned to ``variant`` and return its socket, unread."""
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"X-Model-Variant: {variant}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(head.encode() + data)
    return sock


def test_jobs_past_the_bound_are_dropped(slow):
    before = counts(slow, "twin", "copy")
    # A request pinned to the shadow variant (its steps slowed as its shadows') keeps the worker
    # busy: no shadow starts meanwhile.
    hold = {"model": "twin", "prompt": "x", "max_tokens": 1000, "stream": True}
    sock = _pinned_stream(slow.port, hold, "copy")
    try:
        wait_until(lambda: slow.state()["models"]["twin/copy"]["slots"]["busy"] == 1)
        quick = {"model": "twin", "prompt": "x", "max_tokens": 1}
        for _ in range(QUEUE_BOUND + 2):
            assert slow.complete(quick)[0] == 200
        state = slow.state()["shadows"]
        assert (state["pending"], state["running"]) == (QUEUE_BOUND, None)
        now = counts(slow, "twin", "copy")
        assert (now["dropped"] - before["dropped"], now["queue_full"] - before["queue_full"]) == (
            2,
            2,
        )
    finally:
        sock.close()  # the held stream ends (client_left: not mirrored), the shadows run
    after = settled(slow, "twin", "copy", sum(before[o] for o in OUTCOMES) + QUEUE_BOUND + 2)
    assert {k: after[k] - before[k] for k in ("exact", "dropped", "queue_full")} == {
        "exact": QUEUE_BOUND,
        "dropped": 2,
        "queue_full": 2,
    }


# -- the comparison and the runner, in process ----------------------------------------------------


def _steps(*items: int | tuple[int, str]) -> list[Step]:
    return [Step(i) if isinstance(i, int) else Step(i[0], finish_reason=i[1]) for i in items]


def _trace(ids: list[int], ended: bool) -> TokenTrace:
    def stream():
        yield from _steps(*ids[:-1], (ids[-1], "stop") if ended else ids[-1])

    trace = TokenTrace(stream())
    for _ in trace:
        pass
    return trace


@pytest.mark.parametrize(
    ("primary", "ended", "max_tokens", "shadow", "want"),
    [
        ([1, 2, 3], False, 3, [1, 2, 3], None),
        (
            [1, 2, 3],
            False,
            9,
            [1, 2, 3],
            None,
        ),  # a stop string ended it: the shadow goes no further
        ([1, 2, 3], False, 3, [1, 5], Divergence(0, 1, 2, 5)),
        ([1, 2, 3], False, 3, [1], Divergence(0, 1, 2, None)),  # the shadow's stream ran out
        ([1, 2, 3], False, 3, [1, (2, "stop")], Divergence(0, 2, 3, None)),  # its EOS came early
        ([1, 2, 0], True, 9, [1, 2, (0, "stop")], None),  # both ended at the same EOS
        ([1, 2, 0], True, 9, [1, 2, 0, 7], Divergence(0, 3, None, 7)),  # the shadow went on
        ([1, 2, 0], True, 3, [1, 2, 0], None),  # ... but max_tokens ends it there anyway
    ],
)
def test_a_choice_is_compared_up_to_the_primary_s_count(primary, ended, max_tokens, shadow, want):
    check = ChoiceCheck(0, _trace(primary, ended), max_tokens)
    for step in _steps(*shadow):
        assert not check.done
        check.feed(step)
    if not check.done:
        check.end()
    assert (check.done, check.divergence) == (True, want)


def _job(target: ServedModel) -> ShadowJob:
    return ShadowJob("r", target, (), (), 0)


def test_the_queue_bound_and_a_stop_drop_jobs():
    registry = CollectorRegistry()
    metrics = Metrics.create(registry)
    target = ServedModel("m", (), None, None, "s", 0.0, 100.0)  # type: ignore[arg-type]
    runner = ShadowRunner(lambda: False, metrics, [target], bound=2)  # never idle: nothing runs
    for _ in range(3):
        runner.submit(_job(target))
    runner.stop()
    runner.submit(_job(target))
    got = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples(registry).items()
        if name == "greenserve_shadow_dropped_total"
    }
    assert got == {"queue_full": 1, "preempted": 0, "failed": 0, "shutdown": 3}


# -- the models file ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        (
            "weight = 5\nshadow = 10",
            "models.m.variants.s.shadow: a variant has either 'weight' (a canary: percent of "
            "clients) or 'shadow' (percent of requests mirrored), not both",
        ),
        ("shadow = 0", "models.m.variants.s.shadow: must be a percentage in (0, 100], got 0"),
        (
            "shadow = 100.5",
            "models.m.variants.s.shadow: must be a percentage in (0, 100], got 100.5",
        ),
        ('shadow = "10"', "models.m.variants.s.shadow: must be a percentage in (0, 100], got '10'"),
        (
            "",
            "models.m.variants.s: needs 'weight' (a canary: percent of clients) or 'shadow' "
            "(percent of requests mirrored)",
        ),
    ],
)
def test_a_bad_shadow_is_one_line(tmp_path, variant, why):
    path = models_file(tmp_path, "s", f'source = "xyz"\n{variant}')
    with pytest.raises(ValueError) as err:
        read_models_file(str(path))
    assert str(err.value) == f"MODELS_FILE ({path}): {why}"


def models_file(tmp_path: Path, variant: str, table: str) -> Path:
    """Write a models file: model ``m`` (the bigram trained on ``xyz``) and its variant
    ``variant`` of the TOML lines ``table``."""
    write_trained(tmp_path / "xyz", b"xyz")
    path = tmp_path / "models.toml"
    path.write_text(f'[models.m]\nsource = "xyz"\n[models.m.variants.{variant}]\n{table}\n')
    return path


def refused(tmp_path: Path, variant: str, table: str) -> list[str]:
    """The lines a server started on :func:`models_file` writes as it refuses to start, without
    their ``greenserve: cannot start: MODELS_FILE (path): `` prefix."""
    path = models_file(tmp_path, variant, table)
    _, plain = failed_start(tmp_path, {"MODELS_FILE": str(path)})
    return [
        line.removeprefix(f"greenserve: cannot start: MODELS_FILE ({path}): ") for line in plain
    ]


def test_the_server_refuses_a_bad_shadow_in_one_line(tmp_path):
    assert refused(tmp_path, "s", 'source = "xyz"\nweight = 1\nshadow = 1') == [
        "models.m.variants.s.shadow: a variant has either 'weight' (a canary: percent of "
        "clients) or 'shadow' (percent of requests mirrored), not both"
    ]


def test_a_shadow_with_another_tokenizer_is_refused_at_start(tmp_path, stories_dir):
    assert refused(tmp_path, "story", f'source = "{stories_dir}"\nshadow = 10') == [
        "models.m.variants.story: a shadow's tokenizer must be its primary's (models.m), token "
        "for token: 512 tokens, the primary's 256"
    ]


def test_a_constrained_shadow_charges_its_masks_to_a_budget_of_its_own(masked):
    """20 constrained tokens at a spun 10 ms a mask take ~0.2 s of the client's 0.3 s budget; the
    shadow's masks take as much again, on a budget of their own (on the client's, it failed)."""
    body = {"model": "twin", "prompt": "x", "guided_regex": "[a-z]{1,60}", "seed": 1}
    status, _, raw = masked.complete({**body, "max_tokens": 20})
    assert status == 200, raw
    assert settled(masked, "twin", "copy", 1) == {
        "exact": 1,
        "diverged": 0,
        "dropped": 0,
        **dict.fromkeys(REASONS, 0),
    }


def test_an_answer_without_tokens_is_not_mirrored(server):
    before = mirrored(server, "twin", "copy")
    body = {"model": "twin", "prompt": "xyz", "max_tokens": 0, "echo": True}
    status, _, raw = server.complete(body)
    assert status == 200, raw
    # A request after it is mirrored: once both would have run, only that one was (nothing to
    # compare in an answer of no tokens; it counted as exact before).
    assert server.complete({"model": "twin", "prompt": "x", "max_tokens": 2})[0] == 200
    assert settled(server, "twin", "copy", before + 1)["exact"] >= 1
