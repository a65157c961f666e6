"""The Vercel AI SDK's default OpenAI provider (``createOpenAI``, which speaks the Responses API) in
Node.js against SmolLM2-135M-Instruct (GGUF) on a real gunicorn: ``generateText`` and ``streamText``
give the text the official Python client gets at temperature 0, and a two-step tool loop calls the
tool and answers.

The SDK comes from the npm registry (``tests/js/package.json`` and its lock file pin ``ai`` and
``@ai-sdk/openai``; ``.ci/run`` runs ``npm ci`` there); the script is ``tests/js/vercel_ai.mjs``.
"""

from __future__ import annotations

import json
import subprocess

import openai

from tests.needs import binary, unavailable
from tests.server import ROOT

JS_DIR = ROOT / "tests" / "js"
ASK = "What is the capital of France?"
MAX_TOKENS = 48


def test_the_vercel_ai_sdk_default_provider_generates_streams_and_calls_tools(smollm2_server):
    node = binary("node", "nodejs")
    if not (JS_DIR / "node_modules" / "ai").exists():
        unavailable("tests/js has no node_modules: run `npm ci --prefix tests/js`")
    config = {
        "baseURL": smollm2_server.url + "/v1",
        "apiKey": "unused",
        "model": "smollm2",
        "prompt": ASK,
        "maxOutputTokens": MAX_TOKENS,
    }
    run = subprocess.run(
        [node, "vercel_ai.mjs"],
        cwd=JS_DIR,
        input=json.dumps(config),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    sdk = openai.OpenAI(base_url=config["baseURL"], api_key="unused", max_retries=0, timeout=300)
    with sdk:
        python = sdk.responses.create(
            model="smollm2", input=ASK, temperature=0, max_output_tokens=MAX_TOKENS
        )
    made, streamed, loop = got["made"], got["streamed"], got["loop"]
    assert made["text"] == streamed["text"] == streamed["deltas"] == python.output_text
    assert made["finishReason"] == streamed["finishReason"] == "stop"
    assert made["id"].startswith("resp_") and streamed["id"].startswith("resp_")
    assert made["usage"]["inputTokens"] == python.usage.input_tokens
    assert made["usage"]["outputTokens"] == python.usage.output_tokens
    first, second = loop["steps"]
    assert first["finishReason"] == "tool-calls" and len(loop["asked"]) >= 1
    assert [c["name"] for c in first["toolCalls"]] == ["get_weather"] * len(loop["asked"])
    assert [c["input"]["city"] for c in first["toolCalls"]] == loop["asked"]
    assert second["toolCalls"] == [] and second["text"].strip() and loop["text"] == second["text"]
