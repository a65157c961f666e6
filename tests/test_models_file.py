"""Several models from a models file (``MODELS_FILE``): read and checked before the server starts,
routed by name and alias on every endpoint, listed by ``/v1/models``, counted against
``MEMORY_BUDGET_MB``, and ``/ready`` over every model's engine.

The server serves the packaged bigram (the default, alias ``gpt-4o-mini``), a bigram trained here on
``xyz`` repeated (alias ``loop``: greedily it continues ``x`` with ``yzxyz``), and stories260K.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from model.bigram.model import default_model_dir
from model.bigram.train import train_bigram, write_model
from model.fetch import MODELS
from model.loader import load_model
from tests.llamafiles import convert_stories, write_tiny_llama
from tests.modelfiles import version
from tests.readiness import (
    ENGINE_FAILED,
    READY,
    assert_ready_answers,
    ready_on_both_ports,
    tensor_bytes,
    write_in_place,
)
from tests.server import GunicornServer, failed_start, wait_until
from wsgi_app.models_file import FETCH_NAMES, ModelEntry, read_models_file

XYZ_TEXT = b"xyz" * 200
CAPABILITIES = {"chat": True, "tools": True, "structured_outputs": True, "logprobs": True}
MODELS_TOML = """
default = "bigram"

[models.bigram]
source = "bigram"
aliases = ["gpt-4o-mini"]

[models.xyz]
source = "xyz"
aliases = ["loop"]
max_slots = 2
max_queue = 3

[models.stories]
source = "stories"
"""


def write_xyz(directory: Path) -> Path:
    """Write the bigram trained on ``xyz`` repeated into ``directory``."""
    write_model(directory, train_bigram([XYZ_TEXT]), {"trained_on": ["xyz"]})
    return directory


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the models file and the models it names by relative paths."""
    root = tmp_path_factory.mktemp("models")
    write_xyz(root / "xyz")
    convert_stories(root / "stories")
    (root / "models.toml").write_text(MODELS_TOML)
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    """One gunicorn (1 gevent worker) serving the three models of the file."""
    env = {
        "MODELS_FILE": str(models_dir / "models.toml"),
        "KV_CACHE_BUDGET_MB": "16",
        "MEMORY_BUDGET_MB": "64",
    }
    srv = GunicornServer(tmp_path_factory.mktemp("models-server"), env).start(timeout_s=120)
    try:
        yield srv
    finally:
        srv.stop()


def greedy(srv: GunicornServer, model: str, prompt: str = "x") -> tuple[str, str, str]:
    """Return the model echoed, the text and ``X-Model-Version`` of a greedy 5-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    status, headers, raw = srv.complete(body)
    assert status == 200, raw
    answer = json.loads(raw)
    return answer["model"], answer["choices"][0]["text"], headers["x-model-version"]


def test_a_model_is_picked_by_name_and_by_alias(server, models_dir):
    xyz = version(models_dir / "xyz")
    assert greedy(server, "xyz") == ("xyz", "yzxyz", xyz)
    assert greedy(server, "loop") == ("loop", "yzxyz", xyz)
    default = version(default_model_dir())
    _, text, got = greedy(server, "bigram")
    assert got == default and text != "yzxyz"
    assert greedy(server, "gpt-4o-mini") == ("gpt-4o-mini", text, default)


def test_an_unknown_name_goes_to_the_default_model(server):
    _, text, got = greedy(server, "bigram")
    assert greedy(server, "no-such-model") == ("no-such-model", text, got)


def test_every_endpoint_routes_by_model(server, models_dir):
    xyz, stories = version(models_dir / "xyz"), version(models_dir / "stories")
    messages = [{"role": "user", "content": "Hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
        ("/v1/messages", {"messages": messages, "max_tokens": 2}),
        ("/v1/messages/count_tokens", {"messages": messages}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 16, "store": False}),
    ):
        for model, expected in (("loop", xyz), ("stories", stories)):
            status, headers, raw = server.post(path, {**body, "model": model})
            assert status == 200, raw
            assert headers["x-model-version"] == expected, path
            if path != "/v1/messages/count_tokens":
                assert json.loads(raw)["model"] == model
    status, headers, _ = server.get(
        "/v1/completions?model=loop&prompt=x&max_tokens=1", headers={"Accept": "text/event-stream"}
    )
    assert (status, headers["x-model-version"]) == (200, xyz)


def test_a_prompt_is_counted_with_its_models_tokenizer(server):
    # The bigram counts bytes; stories260K's sentencepiece vocabulary counts fewer tokens.
    prompts = {}
    for model in ("xyz", "stories"):
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1}
        status, _, raw = server.complete(body)
        assert status == 200, raw
        prompts[model] = json.loads(raw)["usage"]["prompt_tokens"]
    stories = load_model(Path(server.env["MODELS_FILE"]).parent / "stories")
    assert prompts == {
        "xyz": len("Once upon a time"),
        "stories": len(stories.tokenizer.encode("Once upon a time")),
    }
    assert prompts["stories"] < prompts["xyz"]


def card(model_dir: Path, name: str, **extra) -> dict:
    """The ``/v1/models`` object of the model at ``model_dir`` listed as ``name``."""
    model = load_model(model_dir)
    listed = {
        "id": name,
        "object": "model",
        "created": int(os.stat(model_dir / "config.json").st_mtime),
        "owned_by": "greenserve",
    }
    if model.context_length is not None:
        listed["context_length"] = model.context_length
    return {
        **listed,
        "max_completion_tokens": extra.pop("max_completion_tokens"),
        "capabilities": CAPABILITIES,
        "parameters": extra.pop("parameters"),
        "resident_bytes": extra.pop("resident_bytes"),
        **extra,
    }


def test_models_lists_every_model_and_alias(server, models_dir):
    bigram = card(
        default_model_dir(),
        "bigram",
        max_completion_tokens=4096,
        parameters=65_536,
        resident_bytes=262_144,
        aliases=["gpt-4o-mini"],
    )
    xyz = card(
        models_dir / "xyz",
        "xyz",
        max_completion_tokens=4096,
        parameters=65_536,
        resident_bytes=262_144,
        aliases=["loop"],
    )
    stories = load_model(models_dir / "stories")
    stories_card = card(
        models_dir / "stories",
        "stories",
        max_completion_tokens=511,  # a 512-token context less one prompt token
        parameters=stories.parameters,
        resident_bytes=stories.weights_bytes,
        aliases=[],
    )
    assert stories_card["context_length"] == 512
    assert 260_000 <= stories.parameters <= 300_000  # stories260K

    def alias(listed: dict, name: str) -> dict:
        return {
            **{k: v for k, v in listed.items() if k != "aliases"},
            "id": name,
            "alias_of": listed["id"],
        }

    status, _, raw = server.get("/v1/models")
    assert status == 200
    assert json.loads(raw) == {
        "object": "list",
        "data": [bigram, alias(bigram, "gpt-4o-mini"), xyz, alias(xyz, "loop"), stories_card],
    }
    assert json.loads(server.get("/v1/models/loop")[2]) == alias(xyz, "loop")
    assert json.loads(server.get("/v1/models/stories")[2]) == stories_card
    status, _, raw = server.get("/v1/models/gpt-4")
    assert status == 404
    assert json.loads(raw)["error"]["message"] == (
        "The model 'gpt-4' does not exist; this server serves 'bigram', 'xyz', 'stories'."
    )


def test_each_model_has_its_own_slots_and_queue(server):
    # The file's max_slots and max_queue for xyz; the family's defaults for the others.
    assert server.state()["models"] == {
        "bigram": {"slots": {"busy": 0, "total": 1024}, "queue": {"waiting": 0, "max": 1024}},
        "xyz": {"slots": {"busy": 0, "total": 2}, "queue": {"waiting": 0, "max": 3}},
        "stories": {"slots": {"busy": 0, "total": 64}, "queue": {"waiting": 0, "max": 256}},
    }


def test_ready_with_every_engine_good(server):
    assert server.get("/ready")[:3:2] == (200, READY)


# -- the file, checked before the server starts ---------------------------------------------------


def refused(tmp_path: Path, text: str, name: str = "models.toml", **env: str) -> str:
    """Start with a models file holding ``text``; return the one line the start printed."""
    path = tmp_path / name
    path.write_text(text)
    _, plain = failed_start(tmp_path, {"MODELS_FILE": str(path), **env})
    assert len(plain) == 1, plain
    prefix = f"greenserve: cannot start: MODELS_FILE ({path}): "
    if "MEMORY_BUDGET_MB" in env:
        prefix = f"greenserve: cannot start: MEMORY_BUDGET_MB ({env['MEMORY_BUDGET_MB']}): "
    assert plain[0].startswith(prefix), plain
    return plain[0][len(prefix) :]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            'default = "a"\n[models.a]\nsource = "bigram"\naliases = ["b"]\n'
            '[models.b]\nsource = "bigram"\n',
            "models.b: the name 'b' is already models.a's",
        ),
        (
            '[models.a]\nsource = "bigram"\nslots = 3\n',
            "models.a: unknown key 'slots' (known: source, aliases, max_slots, max_queue, "
            "variants)",
        ),
        (
            '[models.a]\nsource = "bigram"\nmax_slots = 0\n',
            "models.a.max_slots: must be an integer in [1, 100000], got 0",
        ),
        (
            '[models.a]\nsource = "bigram"\naliases = "b"\n',
            "models.a.aliases: must be a list of non-empty strings, no outer spaces",
        ),
        (
            '[models.a]\nsource = "bigram"\naliases = [" b"]\n',
            "models.a.aliases: must be a list of non-empty strings, no outer spaces",
        ),
        (
            '[models.a]\nsource = "bigram"\n[models.b]\nsource = "bigram"\n',
            "'default' must name one of the 2 models",
        ),
        (
            'default = "c"\n[models.a]\nsource = "bigram"\n',
            "default 'c' is not a model of the file",
        ),
        ("models = 3\n", "'models' must be a table of at least one model"),
        (
            "[models.a\n",
            "cannot read: Expected ']' at the end of a table declaration (at line 1, column 10)",
        ),
    ],
)
def test_a_bad_models_file_is_one_line(tmp_path, text, why):
    assert refused(tmp_path, text) == why


def test_a_missing_source_names_the_entry(tmp_path):
    why = refused(tmp_path, '[models.a]\nsource = "nowhere"\n')
    assert why == (
        f"models.a.source: '{tmp_path / 'nowhere'}' does not exist (a path, 'bigram' or one of "
        "the fetch names smollm2)"
    )


def check_models(path: Path, **env: str) -> subprocess.CompletedProcess:
    """``greenserve --check-models PATH`` (the command's own code, from this checkout)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "MODELS_FILE")}
    return subprocess.run(
        [sys.executable, "-m", "wsgi_app.cli", "--check-models", str(path)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_models_says_whether_a_reload_would_apply_a_file(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('default = "a"\n[models.a]\nsource = "bigram"\n[models.b]\nsource = "bigram"\n')
    out = check_models(good)
    assert (out.returncode, out.stdout, out.stderr) == (
        0,
        f"greenserve: {good}: ok, 2 models (a, b)\n",
        "",
    )
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.a]\nsource = "nowhere"\n')
    out = check_models(bad)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        f"greenserve: not applied: MODELS_FILE ({bad}): models.a.source: "
        f"'{tmp_path / 'nowhere'}' does not exist (a path, 'bigram' or one of the fetch names "
        "smollm2)\n"
    )
    # Every model is loaded, as at start: a source that exists but holds no model is refused.
    (tmp_path / "empty").mkdir()
    loads = tmp_path / "loads.toml"
    loads.write_text('default = "a"\n[models.a]\nsource = "bigram"\n[models.e]\nsource = "empty"\n')
    out = check_models(loads)
    assert out.returncode == 1 and out.stderr.startswith(
        f"greenserve: not applied: MODELS_FILE ({loads}): models.e: "
    ), out.stderr


def test_a_model_that_does_not_load_names_the_entry(tmp_path):
    (tmp_path / "empty").mkdir()
    text = 'default = "a"\n[models.a]\nsource = "bigram"\n[models.e]\nsource = "empty"\n'
    assert refused(tmp_path, text) == (
        f"models.e: {tmp_path / 'empty'}: is an empty directory: no config.json and no .gguf "
        "file: not a model directory"
    )


def test_a_json_models_file_reads_as_toml_does(tmp_path):
    write_xyz(tmp_path / "xyz")
    path = tmp_path / "models.json"
    path.write_text(
        json.dumps({"default": "xyz", "models": {"xyz": {"source": "xyz", "aliases": ["l"]}}})
    )
    assert read_models_file(str(path)).entries == (
        ModelEntry("xyz", str(tmp_path / "xyz"), aliases=("l",)),
    )
    why = refused(tmp_path, '{"models": {"a": {"source": 1}}}', "bad.json")
    assert why == "models.a.source: must be a path, 'bigram' or a fetch name"
    # A key given twice is refused, as TOML refuses it (JSON would keep the last silently).
    twice = tmp_path / "twice.json"
    twice.write_text('{"default": "zz", "default": "a", "models": {"a": {"source": "bigram"}}}')
    with pytest.raises(ValueError) as info:
        read_models_file(str(twice))
    assert str(info.value) == (
        f"MODELS_FILE ({twice}): cannot read: the key 'default' is given twice in one object"
    )


def test_model_dir_and_models_file_together_are_refused(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[models.a]\nsource = "bigram"\n')
    _, plain = failed_start(
        tmp_path, {"MODELS_FILE": str(path), "MODEL_DIR": str(default_model_dir())}
    )
    assert plain == [
        f"greenserve: cannot start: MODELS_FILE ({path}): set MODEL_DIR or MODELS_FILE, not both "
        "(name MODEL_DIR's model in the models file)"
    ]


def test_models_over_the_memory_budget_are_refused(tmp_path):
    tiny = load_model(write_tiny_llama(tmp_path / "tiny"))
    text = 'default = "a"\n[models.a]\nsource = "bigram"\n[models.t]\nsource = "tiny"\n'
    why = refused(tmp_path, text, MEMORY_BUDGET_MB="10", KV_CACHE_BUDGET_MB="10")
    need = (262_144 + tiny.weights_bytes + (10 << 20)) / (1 << 20)
    assert why == (
        f"the models need {need:.2f} MiB a worker (weights + KV budget: a 0.25 + KV 0; "
        f"t {tiny.weights_bytes / (1 << 20):.2f} + KV 10); raise it, lower KV_CACHE_BUDGET_MB or "
        "serve fewer models"
    )


def test_model_dir_alone_is_counted_too(tmp_path):
    _, plain = failed_start(
        tmp_path,
        {"MODEL_DIR": str(write_tiny_llama(tmp_path / "tiny")), "MEMORY_BUDGET_MB": "1"},
    )
    assert len(plain) == 1 and plain[0].startswith(
        "greenserve: cannot start: MEMORY_BUDGET_MB (1): the models need "
    ), plain


def test_fetch_names_agree_with_model_fetch():
    assert FETCH_NAMES == tuple(sorted(MODELS))


# -- readiness: every model's engine -----------------------------------------------------------


def test_ready_is_off_while_any_models_engine_fails(serve, tmp_path):
    """The tiny Llama's weights are overwritten in place with NaN under the running worker (as in
    tests/test_probes.py): its engine's step fails and ``/ready`` answers 503 ``engine_failed``
    although the default bigram still serves; once the weights are whole again it is ready."""
    model_dir = write_tiny_llama(tmp_path / "tiny")
    (tmp_path / "models.toml").write_text(
        'default = "bigram"\n[models.bigram]\nsource = "bigram"\n[models.tiny]\nsource = "tiny"\n'
    )
    srv = serve(MODELS_FILE=str(tmp_path / "models.toml"), KV_CACHE_BUDGET_MB="16")
    weights = model_dir / "model.safetensors"
    offset, good = tensor_bytes(weights, "model.norm.weight")
    nan = np.full(len(good) // 4, np.nan, "<f4").tobytes()
    tiny = {"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
    assert srv.complete(tiny)[0] == 200
    assert_ready_answers(srv, b"200 OK", READY)
    write_in_place(weights, offset, nan)
    try:
        assert srv.complete(tiny)[0] == 500
        assert_ready_answers(srv, b"503 SERVICE UNAVAILABLE", ENGINE_FAILED)
        # The other model still answers: only the load balancer's choice of worker changes.
        assert srv.complete({"model": "bigram", "prompt": "a", "max_tokens": 2})[0] == 200
    finally:
        write_in_place(weights, offset, good)
    wait_until(lambda: ready_on_both_ports(srv), 30, lambda: "ready again; log:\n" + srv.log_tail())
