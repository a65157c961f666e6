"""OpenAI's Codex CLI (``codex exec``, which speaks only the Responses API) against a real gunicorn, offline,
through a custom model provider (``base_url`` the server, ``wire_api = "responses"``, the API key
from an environment variable), as README "Responses API" tells a user to configure it.

Codex sends its whole agent prompt (~7,000 SmolLM2 tokens: several minutes of prefill on a busy test
machine) with tools of types this server cannot run (its freeform ``apply_patch``, web search), so the
model here is a bigram written for the test: from the end of the prompt (``Assistant:``) it writes
" Hi." and then the chat template's stop string, every time. The answer is ``completed``, Codex exits
0 with that text as its last message, and the server names the tools it left out.

The CLI comes from the npm registry (``tests/js/package.json`` and its lock file pin
``@openai/codex``; ``.ci/run`` runs ``npm ci`` there).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.modelfiles import BIGRAM_CONFIG, write_model_dir
from tests.needs import unavailable
from tests.server import ROOT, wait_until

CODEX = ROOT / "tests" / "js" / "node_modules" / ".bin" / "codex"
KEY = "codex-key"
ANSWER = " Hi."


def hi_weight() -> np.ndarray:
    """Return bigram weights that write ``" Hi.\\nUser:"`` after ``:`` (each byte of it is followed
    by one byte only; every other byte is followed by a space)."""
    text = b": Hi.\nUser:"
    weight = np.zeros((256, 256), dtype=np.float32)
    weight[:, ord(" ")] = 50.0
    for prev, nxt in zip(text, text[1:], strict=False):
        weight[prev] = 0.0
        weight[prev, nxt] = 50.0
    return weight


@pytest.fixture(scope="module")
def server(serve_module, tmp_path_factory):
    model = write_model_dir(tmp_path_factory.mktemp("hi-model"), hi_weight(), BIGRAM_CONFIG)
    # Codex's prompt is ~29,000 bytes, over the bigram's default MAX_PROMPT_TOKENS (a byte a token).
    return serve_module(MODEL_DIR=str(model), API_KEYS=KEY, MAX_PROMPT_TOKENS="1000000")


def test_codex_exec_answers_through_the_responses_api(server, tmp_path):
    if not CODEX.exists():
        unavailable("tests/js has no node_modules: run `npm ci --prefix tests/js`")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "smollm2"\n'
        'model_provider = "greenserve"\n\n'
        "[model_providers.greenserve]\n"
        'name = "greenserve"\n'
        f'base_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "GREENSERVE_API_KEY"\n'
    )
    last = tmp_path / "last.txt"
    run = subprocess.run(
        [str(CODEX), "exec", "--skip-git-repo-check", "-o", str(last), "Say hi."],
        cwd=work,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "CODEX_HOME": str(home),
            "GREENSERVE_API_KEY": KEY,
        },  # fmt: skip
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert last.read_text() == ANSWER
    assert "Say hi." in run.stdout + run.stderr

    def logged() -> list[dict]:
        lines = [
            json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")
        ]
        return [r for r in lines if r.get("path") == "/v1/responses"]

    (request,) = wait_until(logged, 10, "the log line of codex's request")
    assert (request["status"], request["finish_reason"], request["model"]) == (
        200,
        "stop",
        "smollm2",
    )
    # Codex's tools of other types (its freeform apply_patch, web search) were left out and named.
    assert any(name.startswith("tools%5B") for name in request["ignored_fields"])
