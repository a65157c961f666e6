"""``GET /v1/models`` and ``GET /v1/models/{model}`` in the OpenAI shape."""

from __future__ import annotations

import json
import os
from pathlib import Path

from model.bigram.model import default_model_dir
from wsgi_app.api.models import model_id

# A bigram's extensions: no context limit, the API's max_tokens cap, 256 x 256 float32 weights.
BIGRAM_EXTENSIONS = {
    "max_completion_tokens": 4096,
    "capabilities": {"chat": True, "tools": True, "structured_outputs": True, "logprobs": True},
    "parameters": 65_536,
    "resident_bytes": 262_144,
    "aliases": [],
}


def _card(model_dir: Path, name: str) -> dict:
    created = int(os.stat(Path(model_dir) / "model.safetensors").st_mtime)
    card = {"id": name, "object": "model", "created": created, "owned_by": "greenserve"}
    return {**card, **BIGRAM_EXTENSIONS}


def test_list_names_the_model_directory(succ_server, succ_dir):
    status, headers, body = succ_server.get("/v1/models")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"object": "list", "data": [_card(succ_dir, succ_dir.name)]}
    assert body.startswith(b'{"object":"list","data":[{"id":')


def test_retrieve_the_served_model(succ_server, succ_dir):
    status, _, body = succ_server.get(f"/v1/models/{succ_dir.name}")
    assert status == 200
    assert json.loads(body) == _card(succ_dir, succ_dir.name)
    assert list(json.loads(body)) == ["id", "object", "created", "owned_by", *BIGRAM_EXTENSIONS]


def test_retrieve_another_model_is_404(succ_server, succ_dir):
    for path, shown in (("/v1/models/gpt-4", "gpt-4"), ("/v1/models/org/name", "org/name")):
        status, _, body = succ_server.get(path)
        assert status == 404
        assert json.loads(body) == {
            "error": {
                "message": f"The model '{shown}' does not exist; this server serves "
                f"'{succ_dir.name}'.",
                "type": "not_found_error",
                "param": "model",
                "code": "model_not_found",
            }
        }


def test_packaged_default_model_is_bigram(default_server):
    _, _, body = default_server.get("/v1/models")
    assert json.loads(body)["data"] == [_card(Path(str(default_model_dir())), "bigram")]
    assert default_server.get("/v1/models/bigram")[0] == 200


def test_any_model_string_is_still_accepted(succ_server):
    status, _, body = succ_server.complete({"model": "not-listed", "prompt": "a", "max_tokens": 1})
    assert status == 200
    assert json.loads(body)["model"] == "not-listed"


def test_model_id_precedence(tmp_path):
    assert (
        model_id({"name": " tiny-shakespeare "}, tmp_path / "dir", packaged=True)
        == "tiny-shakespeare"
    )
    assert model_id({"name": ""}, tmp_path / "my-model", packaged=False) == "my-model"
    assert model_id({"name": 3}, tmp_path / "my-model", packaged=False) == "my-model"
    assert model_id({}, tmp_path / "default", packaged=True) == "bigram"
    assert model_id({}, Path("/"), packaged=False) == "bigram"
