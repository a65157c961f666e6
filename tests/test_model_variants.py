"""Canary variants of a model (``[models.NAME.variants.V]`` in ``MODELS_FILE``): a stated share of
the clients, each client always the same variant on every worker (its key hashed with
``VARIANT_SALT``, as nginx's ``split_clients``), a pin header, ``/v1/models``' ``variants``.

The server (two workers) serves a bigram trained on ``xyz`` as model ``loop``'s primary variant and
one trained on ``xzy`` as its canary ``v2`` (40 %): greedily, after ``x`` the first writes ``yzxyz``
and the second ``zyxzy``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loglines import request_line
from tests.modelfiles import version, write_trained
from tests.server import GunicornServer, failed_start
from wsgi_app.generation.registry import ServedModel, bucket, split
from wsgi_app.models_file import PRIMARY, read_models_file

SALT = "every-host-shares-this"
MODELS_TOML = """
[models.loop]
source = "xyz"

[models.loop.variants.v2]
source = "xzy"
weight = 40
"""


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("variants")
    write_trained(root / "xyz", b"xyz")
    write_trained(root / "xzy", b"xzy")
    (root / "models.toml").write_text(MODELS_TOML)
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    env = {"MODELS_FILE": str(models_dir / "models.toml"), "VARIANT_SALT": SALT}
    srv = GunicornServer(tmp_path_factory.mktemp("variants-server"), env, workers=2).start()
    try:
        srv.wait_workers(2)
        yield srv
    finally:
        srv.stop()


def answer(srv: GunicornServer, headers: dict[str, str] | None = None, **body) -> tuple:
    """Return the status, text and ``X-Model-Version`` of a greedy completion after ``x``."""
    request = {"model": "loop", "prompt": "x", "max_tokens": 5, "temperature": 0, **body}
    status, got, raw = srv.complete(request, headers=headers or {})
    if status != 200:
        return status, json.loads(raw), None
    return status, json.loads(raw)["choices"][0]["text"], got["x-model-version"]


def expected_variant(client_key: str) -> str:
    """The variant ``client_key`` gets: the canary ``v2`` of ``loop`` draws it below 40."""
    return "v2" if bucket(SALT, f"loop\0v2\0{client_key}") < 40 else PRIMARY


def test_each_user_always_gets_the_same_variant_on_every_worker(server, models_dir):
    versions = {PRIMARY: version(models_dir / "xyz"), "v2": version(models_dir / "xzy")}
    texts = {PRIMARY: "yzxyz", "v2": "zyxzy"}
    seen = set()
    for n in range(12):
        want = expected_variant(f"user:user-{n}")
        seen.add(want)
        for _ in range(3):  # whichever of the two workers answers, the same variant
            assert answer(server, user=f"user-{n}") == (200, texts[want], versions[want])
    assert seen == {PRIMARY, "v2"}  # both variants were exercised


def test_the_log_line_names_the_variant_that_answered(server, models_dir):
    body = {"model": "loop", "prompt": "x", "max_tokens": 1}
    server.complete(body, headers={"X-Model-Variant": "v2", "X-Request-Id": "pinned-v2"})
    line = request_line(server, "pinned-v2")
    assert line["model_version"] == version(models_dir / "xzy")


def test_a_messages_client_is_keyed_by_its_metadata_user_id(server, models_dir):
    versions = {PRIMARY: version(models_dir / "xyz"), "v2": version(models_dir / "xzy")}
    messages = [{"role": "user", "content": "x"}]
    for n in range(6):
        body = {"model": "loop", "messages": messages, "max_tokens": 1}
        body["metadata"] = {"user_id": f"m-{n}"}
        status, headers, _ = server.post("/v1/messages", body)
        assert (status, headers["x-model-version"]) == (
            200,
            versions[expected_variant(f"user:m-{n}")],
        )


def test_a_session_header_keys_a_client_without_a_user(server, models_dir):
    versions = {PRIMARY: version(models_dir / "xyz"), "v2": version(models_dir / "xzy")}
    for n in range(6):
        want = versions[expected_variant(f"session:s-{n}")]
        assert answer(server, {"X-Session-Id": f"s-{n}"})[2] == want


def test_a_request_without_a_client_key_gets_the_primary(server, models_dir):
    assert answer(server) == (200, "yzxyz", version(models_dir / "xyz"))


def test_the_pin_header_picks_a_variant(server, models_dir):
    for n in range(4):
        assert answer(server, {"X-Model-Variant": "v2"}, user=f"u{n}")[1:] == (
            "zyxzy",
            version(models_dir / "xzy"),
        )
        assert answer(server, {"X-Model-Variant": "primary"}, user=f"u{n}")[1] == "yzxyz"
    assert answer(server, {"X-Model-Variant": "v3"})[:2] == (
        400,
        {
            "error": {
                "message": "The model 'loop' has no variant 'v3' (it has 'primary', 'v2').",
                "type": "invalid_request_error",
                "param": "X-Model-Variant",
                "code": None,
            }
        },
    )


def test_models_lists_the_variants(server, models_dir):
    (card,) = json.loads(server.get("/v1/models")[2])["data"]
    assert card["variants"] == [
        {"variant": "primary", "weight": 60.0, "version": version(models_dir / "xyz")},
        {"variant": "v2", "weight": 40.0, "version": version(models_dir / "xzy")},
    ]
    assert server.state()["models"] == {
        "loop": {"slots": {"busy": 0, "total": 1024}, "queue": {"waiting": 0, "max": 1024}},
        "loop/v2": {"slots": {"busy": 0, "total": 1024}, "queue": {"waiting": 0, "max": 1024}},
    }


# -- the split itself (no server) ----------------------------------------------------------------


def _variants(canary_weight: float) -> list[ServedModel]:
    """A primary and one canary of ``canary_weight`` percent (no generation behind them)."""
    primary = ServedModel("m", (), None, None, PRIMARY, 100.0 - canary_weight)  # type: ignore[arg-type]
    return [primary, ServedModel("m", (), None, None, "canary", canary_weight)]  # type: ignore[arg-type]


@pytest.mark.parametrize(("clients", "slack"), [(10_000, 1.5), (1_000, 3.0)])
def test_a_ten_percent_canary_lands_near_ten_percent(clients, slack):
    variants = _variants(10.0)
    picked = [split(variants, SALT, f"user:client-{n}").variant for n in range(clients)]
    share = 100.0 * picked.count("canary") / clients
    assert 10.0 - slack <= share <= 10.0 + slack, share
    # Sticky: the same key, the same variant, whatever asks.
    again = [split(variants, SALT, f"user:client-{n}").variant for n in range(clients)]
    assert again == picked


def _canaries(model: str, weights: dict[str, float]) -> list[ServedModel]:
    """A primary of ``model`` and its canaries of the given weights, in order (no generation)."""
    rest = 100.0 - sum(weights.values())
    primary = ServedModel(model, (), None, None, PRIMARY, rest)  # type: ignore[arg-type]
    return [primary, *(ServedModel(model, (), None, None, v, w) for v, w in weights.items())]  # type: ignore[arg-type]


def test_a_canary_set_to_zero_or_removed_moves_only_its_own_clients():
    keys = [f"session:c-{n}" for n in range(10_000)]

    def picks(variants: list[ServedModel]) -> list[str]:
        return [split(variants, SALT, key).variant for key in keys]

    both = picks(_canaries("m", {"a": 10.0, "b": 10.0}))
    # Two of 10 %: the first its weight, the second its weight of the clients the first left.
    assert 8.5 <= 100 * both.count("a") / len(keys) <= 11.5
    assert 7.5 <= 100 * both.count("b") / len(keys) <= 10.5
    for zeroed in (_canaries("m", {"a": 0.0, "b": 10.0}), _canaries("m", {"b": 10.0})):
        after = picks(zeroed)
        # Every client of b stays on b; only a's clients move (to b's draw, else the primary).
        assert all(y == "b" for x, y in zip(both, after, strict=True) if x == "b")
        assert {(x, y) for x, y in zip(both, after, strict=True) if x != y} <= {
            ("a", "b"),
            ("a", PRIMARY),
        }
    raised = picks(_canaries("m", {"a": 20.0, "b": 10.0}))
    assert all(y == "a" for x, y in zip(both, raised, strict=True) if x == "a")


def test_two_models_canaries_draw_different_clients():
    keys = [f"key:k-{n}" for n in range(10_000)]
    m = {k for k in keys if split(_canaries("m", {"c": 10.0}), SALT, k).variant == "c"}
    n = {k for k in keys if split(_canaries("n", {"c": 10.0}), SALT, k).variant == "c"}
    # Independent draws: about 10 % of one's clients are the other's (the same clients: 100 %).
    assert len(m & n) < 0.2 * len(m), (len(m), len(n), len(m & n))


def test_bucket_is_a_fixed_function_of_salt_and_key():
    # sha256(b"s\x00k")[:8] as a fraction of 2**64, in percent: the same on every host.
    import hashlib

    digest = hashlib.sha256(b"s\x00k").digest()
    assert bucket("s", "k") == int.from_bytes(digest[:8], "big") / 2**64 * 100.0
    assert bucket("s", "k") != bucket("t", "k")


def test_variants_in_the_file(tmp_path):
    write_trained(tmp_path / "xyz", b"xyz")
    path = tmp_path / "models.toml"
    path.write_text(MODELS_TOML.replace('"xzy"', '"xyz"'))
    entries = read_models_file(str(path)).entries
    assert [(e.name, e.variant, e.weight) for e in entries] == [
        ("loop", PRIMARY, 60.0),
        ("loop", "v2", 40.0),
    ]


@pytest.mark.parametrize(
    ("variants", "why"),
    [
        (
            '[models.loop.variants.v2]\nsource = "xyz"\nweight = 70\n'
            '[models.loop.variants.v3]\nsource = "xyz"\nweight = 40\n',
            "models.loop.variants: the weights add up to 110 %, over 100",
        ),
        (
            '[models.loop.variants.primary]\nsource = "xyz"\nweight = 5\n',
            "models.loop.variants.primary: a variant's name must be letters, digits, '.', '_' or "
            "'-' (the X-Model-Variant header pins it by name), and not 'primary'",
        ),
        (
            '[models.loop.variants."v 2"]\nsource = "xyz"\nweight = 5\n',
            "models.loop.variants.v 2: a variant's name must be letters, digits, '.', '_' or "
            "'-' (the X-Model-Variant header pins it by name), and not 'primary'",
        ),
        (
            '[models.loop.variants.v2]\nsource = "xyz"\nweight = -1\n',
            "models.loop.variants.v2.weight: must be a percentage in [0, 100], got -1",
        ),
        (
            '[models.loop.variants.v2]\nsource = "xyz"\nweight = 5\nmirror = true\n',
            "models.loop.variants.v2: unknown key 'mirror' (known: source, weight, shadow)",
        ),
    ],
)
def test_a_bad_variant_is_one_line(tmp_path, variants, why):
    write_trained(tmp_path / "xyz", b"xyz")
    path = tmp_path / "models.toml"
    path.write_text('[models.loop]\nsource = "xyz"\n' + variants)
    _, plain = failed_start(tmp_path, {"MODELS_FILE": str(path)})
    assert plain == [f"greenserve: cannot start: MODELS_FILE ({path}): {why}"]
