"""One server, one worker, the four kinds of model a models file names: the embedded bigram, two
versions of a bigram trained on different text, stories260K (a llama2.c checkpoint converted to a
Hugging Face folder) and SmolLM2 (a GGUF by its ``model.fetch`` name). Each is picked by its name and
by its alias, answers greedily what that model is known to answer, and names its own version; a
name the file does not know is served by the default model; ``/v1/models`` lists them all.

Known answers: a bigram's greedy text is the chain of its weight rows' argmax (computed here from
the weights); stories260K's is llama2.c's (``expected_greedy.json``); SmolLM2's is llama.cpp's up to
llama.cpp's first near-tie (``llamacpp_golden.json``, as ``tests/test_gguf_serving.py`` judges it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from model import __version__
from model.bigram.model import Bigram, default_model_dir
from model.fetch import MODELS
from model.loader import LoadedModel, load_model
from tests.gguffiles import golden, teacher_forced
from tests.llamafiles import convert_stories, expected_greedy
from tests.modelfiles import write_trained
from tests.server import GunicornServer

NEAR_TIE = 0.5  # as tests/test_gguf_serving.py: llama.cpp's top two closer than this may swap
MODELS_TOML = """
default = "bigram"

[models.bigram]
source = "bigram"
aliases = ["gpt-4o-mini"]

[models.loop-v1]
source = "xyz"
aliases = ["loop-old"]

[models.loop-v2]
source = "xzy"
aliases = ["loop"]

[models.stories]
source = "stories"
aliases = ["tiny"]

[models.smollm2]
source = "smollm2"
aliases = ["smol"]
"""
ALIASES = {
    "gpt-4o-mini": "bigram",
    "loop-old": "loop-v1",
    "loop": "loop-v2",
    "tiny": "stories",
    "smol": "smollm2",
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the models file and the models it names by relative paths."""
    root = tmp_path_factory.mktemp("kinds")
    write_trained(root / "xyz", b"xyz")
    write_trained(root / "xzy", b"xzy")
    convert_stories(root / "stories")
    (root / "models.toml").write_text(MODELS_TOML)
    return root


@pytest.fixture(scope="module")
def server(
    models_dir: Path,
    smollm2_gguf: Path,
    smollm2: LoadedModel,  # loading it first builds the weights cache that the server then maps
    gguf_cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GunicornServer]:
    """One gunicorn (1 gevent worker) serving the five models of the file."""
    # The fetch name resolves in the cache directory's models/ folder: the fetched file, linked.
    fetched = gguf_cache_dir / "models" / MODELS["smollm2"].file_name
    fetched.parent.mkdir(exist_ok=True)
    if not fetched.exists():
        fetched.symlink_to(smollm2_gguf)
    env = {
        "MODELS_FILE": str(models_dir / "models.toml"),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
        "REQUEST_TIMEOUT_S": "600",  # a loaded machine must not turn a slow answer into a 504
    }
    srv = GunicornServer(tmp_path_factory.mktemp("kinds-server"), env, health_port=False)
    srv.start(timeout_s=120)  # five models loaded by the master, then by the worker
    try:
        yield srv
    finally:
        srv.stop()


def bigram_greedy(model_dir: Path | None, prompt: bytes, n: int) -> str:
    """The bigram's greedy continuation of ``prompt``: ``n`` times the argmax of the last byte's row."""
    weight = Bigram.load(model_dir).weight
    out = [prompt[-1]]
    for _ in range(n):
        out.append(int(np.argmax(weight[out[-1]])))
    return bytes(out[1:]).decode()


def version(checksum: str) -> str:
    """``X-Model-Version`` of a model whose weights' SHA-256 is ``checksum``."""
    return f"{checksum[:16]}+greenserve-{__version__}"


@pytest.fixture(scope="module")
def known(models_dir: Path, smollm2: LoadedModel) -> dict[str, tuple[dict, str, str]]:
    """Per model: a greedy request (no ``model``), the text it must answer, its version."""
    greedy = {"temperature": 0}
    answers = {}
    for name, where, prompt in (
        ("bigram", None, "The"),
        ("loop-v1", "xyz", "x"),  # trained on "xyz" only: other bytes' rows are flat
        ("loop-v2", "xzy", "x"),
    ):
        directory = models_dir / where if where else default_model_dir()
        text = bigram_greedy(directory, prompt.encode(), 12)
        body = {**greedy, "prompt": prompt, "max_tokens": 12}
        answers[name] = (body, text, version(Bigram.load(directory).checksum))
    assert answers["loop-v1"][1] == "yzx" * 4 and answers["loop-v2"][1] == "zyx" * 4
    case = expected_greedy()["once_upon_a_time_256_steps"]
    body = {**greedy, "prompt": case["prompt"], "max_tokens": 40}
    stories = load_model(models_dir / "stories")
    text = b"".join(stories.tokenizer.token_bytes[i] for i in case["generated_tokens"][:40])
    text = text.decode()
    assert case["text"].startswith(case["prompt"] + text)
    answers["stories"] = (body, text, version(stories.checksum))
    # SmolLM2: llama.cpp's text up to its first near-tie (token 5 of "The capital of France is").
    seq = next(
        s for s in teacher_forced()["sequences"] if s["kind"] == "completions" and s["index"] == 1
    )
    stop = next(k for k, p in enumerate(seq["positions"]) if p["gap"] < NEAR_TIE)
    case = golden()["completions"][1]
    text = b"".join(smollm2.tokenizer.token_bytes[i] for i in case["ids"][:stop]).decode()
    body = {**greedy, "prompt": case["prompt"], "max_tokens": stop}
    answers["smollm2"] = (body, text, version(smollm2.checksum))
    return answers


def answer(srv: GunicornServer, body: dict) -> tuple[str, str, str]:
    """The model echoed, the text and ``X-Model-Version`` of a completion."""
    status, headers, raw = srv.complete(body)
    assert status == 200, raw
    doc = json.loads(raw)
    return doc["model"], doc["choices"][0]["text"], headers["x-model-version"]


def test_each_model_by_name_answers_its_known_greedy_text(server, known):
    for name, (body, text, served) in known.items():
        assert answer(server, {**body, "model": name}) == (name, text, served), name


def test_each_alias_picks_its_model(server, known):
    for alias, name in ALIASES.items():
        body, text, served = known[name]
        assert answer(server, {**body, "model": alias}) == (alias, text, served), alias


def test_an_unknown_name_is_served_by_the_default_model(server, known):
    body, text, served = known["bigram"]
    assert answer(server, {**body, "model": "no-such-model"}) == ("no-such-model", text, served)


def test_models_lists_every_model_and_alias_with_its_context_length(server, smollm2):
    status, _, raw = server.get("/v1/models")
    assert status == 200
    listed = {card["id"]: card for card in json.loads(raw)["data"]}
    assert list(listed) == [
        "bigram", "gpt-4o-mini", "loop-v1", "loop-old", "loop-v2", "loop", "stories", "tiny",
        "smollm2", "smol",
    ]  # fmt: skip
    lengths = {name: card.get("context_length") for name, card in listed.items()}
    assert lengths == {
        **dict.fromkeys(["bigram", "gpt-4o-mini", "loop-v1", "loop-old", "loop-v2", "loop"]),
        "stories": 512,
        "tiny": 512,
        "smollm2": 8192,
        "smol": 8192,
    }
    assert listed["smol"]["alias_of"] == "smollm2" and listed["smollm2"]["quantization"] == "Q4_1"
