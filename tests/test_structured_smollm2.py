"""Structured outputs on SmolLM2-135M-Instruct (GGUF) through a real gunicorn: the openai SDK's
``parse()`` with a Pydantic model, a constrained request alone and in a batch of 16 giving the same
bytes, and a handful of schemas at once."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.schemas import SCHEMAS
from tests.server import GunicornServer, concurrently
from tests.sse import sse_json

PATH = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=99_999_999)
    capital: bool


@pytest.fixture(scope="module")
def server(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    # ``smollm2`` has built the cache file in gguf_cache_dir: the server maps it.
    srv = GunicornServer(
        tmp_path_factory.mktemp("smollm2-structured"),
        {
            "MODEL_DIR": str(smollm2_gguf),
            "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
            "MAX_SLOTS": "16",
            "REQUEST_TIMEOUT_S": "300",  # 16 streams on a shared 2-core machine can take minutes
        },
        health_port=False,
    ).start(timeout_s=120)
    try:
        yield srv
    finally:
        srv.stop()


def test_sdk_parse_returns_the_pydantic_object(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.parse(
        model="smollm2", messages=ASK, response_format=City, max_tokens=48, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_alone_and_in_a_batch_of_16_give_the_same_bytes(server):
    """Seeded here; greedy on stories260K and the bigram (tests/test_structured_outputs.py)."""
    schema = City.model_json_schema()
    body = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 32,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema},
        },
        "temperature": 0.9,
        "seed": 42,
    }

    def choices(_: int) -> str:
        status, _, raw = server.post(PATH, body, timeout_s=120)
        assert status == 200, raw
        return json.dumps(json.loads(raw)["choices"])

    alone = choices(0)
    batch = concurrently(choices, 16, timeout_s=300)
    assert batch == [alone] * 16
    got = json.loads(alone)[0]
    if got["finish_reason"] == "stop":
        jsonschema.validate(json.loads(got["message"]["content"]), schema)


def test_a_handful_of_schemas_at_once(server):
    names = ["enum_and_bounds", "nested", "array_bounds", "pattern", "any_of_scalar", "defs_ref"]

    def run(i: int) -> tuple[str, str, str]:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": i % 2 == 1,
            "structured_outputs": {"json": SCHEMAS[names[i]]},
        }
        status, _, raw = server.post(PATH, body, timeout_s=120)
        assert status == 200, raw
        if body["stream"]:
            payloads = sse_json(raw)  # the comments before the first token are not events
            text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
            reason = payloads[-1]["choices"][0]["finish_reason"]
        else:
            choice = json.loads(raw)["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
        return names[i], text, reason

    results = concurrently(run, len(names), timeout_s=300)
    stopped = [(n, t) for n, t, r in results if r == "stop"]
    for name, text in stopped:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len(stopped) >= len(names) - 1, results
