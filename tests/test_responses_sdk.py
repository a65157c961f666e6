"""The Responses API through the official clients over a real gunicorn: the ``openai`` SDK's
``responses.create``, ``responses.stream`` and ``responses.parse`` (with a pydantic model), retrieve
and delete, on the bigram and on SmolLM2-135M-Instruct (GGUF); and the OpenAI Agents SDK running a
one-tool agent on SmolLM2 with its default model (the Responses one)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Literal

import openai
import pydantic
import pytest

from tests.responses import city_tool
from tests.server import ROOT, GunicornServer

MAX_TOKENS = 48


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Tokyo"]
    country: Literal["France", "Italy", "Japan"]


def client(srv: GunicornServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kw
    )


@pytest.fixture(scope="module")
def bigram(serve_module):
    return serve_module()


def test_create_stream_retrieve_and_delete_on_the_bigram(bigram):
    # The bigram ends a constrained answer; its free text runs to the token limit (incomplete,
    # which the SDK's stream helper does not take for a final response).
    ask = {"model": "m", "input": "Sure?", "max_output_tokens": 40, "extra_body": {"seed": 3}}
    with client(bigram) as sdk:
        made = sdk.responses.parse(text_format=Verdict, **ask)
        with sdk.responses.stream(text_format=Verdict, **ask) as events:
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            streamed = events.get_final_response()
        assert made.output_text == streamed.output_text == deltas
        assert made.output_parsed == streamed.output_parsed
        assert made.usage == streamed.usage
        cut = sdk.responses.create(model="m", input="Hello", max_output_tokens=4)
        assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert sdk.responses.retrieve(made.id).output_text == made.output_text
        assert sdk.responses.delete(made.id) is None
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(made.id)


def test_a_forced_function_call_on_the_bigram(bigram):
    with client(bigram) as sdk:
        called = sdk.responses.create(
            model="m",
            input="Weather in Paris?",
            tools=[city_tool()],
            tool_choice="required",
            max_output_tokens=200,
            extra_body={"seed": 2},
        )
        (call,) = called.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})


def test_smollm2_stream_is_create_and_chat_at_temperature_0(smollm2_server):
    ask = "What is the capital of France?"
    with client(smollm2_server) as sdk:
        made = sdk.responses.create(
            model="smollm2", input=ask, temperature=0, max_output_tokens=MAX_TOKENS
        )
        with sdk.responses.stream(
            model="smollm2", input=ask, temperature=0, max_output_tokens=MAX_TOKENS
        ) as events:
            streamed = events.get_final_response()
        chat = sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": ask}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
    assert made.output_text == streamed.output_text == chat.choices[0].message.content
    assert made.output_text.strip()
    assert made.usage.input_tokens == chat.usage.prompt_tokens


def test_smollm2_parse_fills_the_pydantic_model(smollm2_server):
    with client(smollm2_server) as sdk:
        parsed = sdk.responses.parse(
            model="smollm2",
            instructions="Answer in JSON.",
            input="Which city is the capital of France?",
            text_format=City,
            temperature=0,
            max_output_tokens=MAX_TOKENS,
        )
    assert isinstance(parsed.output_parsed, City)
    assert parsed.status == "completed"


def test_smollm2_tool_loop_with_previous_response_id(smollm2_server):
    """A forced call, its result sent back as the next request's input with
    ``previous_response_id``, and the model's answer."""
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    with client(smollm2_server) as sdk:
        first = sdk.responses.create(
            model="smollm2",
            input="What is the weather in Paris?",
            tools=[tool],
            tool_choice="required",
            temperature=0,
            max_output_tokens=MAX_TOKENS,
        )
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and first.status == "completed"
        assert set(json.loads(calls[0].arguments)) == {"city"}
        results = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 22 C"}
            for c in calls
        ]
        second = sdk.responses.create(
            model="smollm2",
            input=results,
            previous_response_id=first.id,
            tools=[tool],
            tool_choice="none",
            temperature=0,
            max_output_tokens=MAX_TOKENS,
        )
    assert second.output_text.strip() and "<tool_call>" not in second.output_text


def test_the_agents_sdk_runs_a_one_tool_agent_on_smollm2(smollm2_server):
    """The Agents SDK's default model is its Responses model: a run calls the tool and answers."""
    import agents

    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Return the current weather in a city.

        Args:
            city: the city's name.
        """
        asked.append(city)
        return f"Sunny and 22 C in {city}."

    sdk = openai.AsyncOpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)
    agents.set_default_openai_client(sdk, use_for_tracing=False)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=MAX_TOKENS
        ),
    )

    async def run() -> agents.RunResult:
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await sdk.close()

    result = asyncio.run(run())
    assert asked, result.new_items
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_the_readme_example_runs_as_written(bigram):
    """README "Responses API": its Python example, against the server."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Responses API") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    run = subprocess.run(
        [sys.executable, "-c", code.replace("http://localhost:8000", bigram.url)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # It printed the first answer, and its follow-up found it stored (else a 400 raised).
    assert run.stdout.strip() and "previous_response_id=first.id" in code
