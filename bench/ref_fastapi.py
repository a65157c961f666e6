"""What many users would write instead: a straightforward FastAPI + uvicorn server of the same contract.

Same model package as greenserve (``Bigram``, ``BigramEngine``, ``Utf8Decoder``), same wire format for
the fields the benchmark sends (``model``, ``prompt``, ``max_tokens``, ``temperature``, ``seed``,
``stream``): a pydantic body, one ``json.dumps`` per chunk, a ``StreamingResponse`` over an async
generator that awaits ``asyncio.sleep(0)`` after every token so one stream does not starve the others.

Run: ``python -m uvicorn bench.ref_fastapi:app --port PORT --no-access-log`` (uvloop and httptools
when installed, as ``uvicorn[standard]`` does).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from model.bigram import Bigram
from model.generate import BigramEngine, GenerationRequest
from model.sampling import SamplingParams
from model.utf8 import Utf8Decoder

app = FastAPI()
engine = BigramEngine(Bigram.load(os.environ.get("MODEL_DIR") or None))


class CompletionBody(BaseModel):
    """The request fields this reference understands."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False


@app.exception_handler(RequestValidationError)
async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Answer a bad body with the OpenAI error envelope (400), not FastAPI's 422."""
    loc = exc.errors()[0].get("loc", ())
    error = {
        "message": str(exc.errors()[0].get("msg")),
        "type": "invalid_request_error",
        "param": loc[-1] if len(loc) > 1 else None,
        "code": None,
    }
    return JSONResponse({"error": error}, status_code=400)


@app.get("/healthz")
async def healthz() -> Response:
    """Liveness."""
    return Response(b'{"status":"ok"}', media_type="application/json")


def _chunk(cid: str, created: int, model: str, text: str, finish: str | None) -> bytes:
    chunk = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return (
        b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def _events(gen: GenerationRequest, cid: str, created: int, model: str):
    yield b": ok\n\n"
    decoder = Utf8Decoder()
    for i, step in enumerate(engine.stream(gen)):
        last = i == gen.max_tokens - 1
        text = decoder.feed(bytes([step.token_id]))
        if last:
            text += decoder.finish()
        yield _chunk(cid, created, model, text, "length" if last else None)
        await asyncio.sleep(0)
    yield b"data: [DONE]\n\n"


@app.post("/v1/completions")
async def completions(body: CompletionBody):
    """Generate a completion, streamed as Server-Sent Events or as one JSON body."""
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little")
    prompt_ids = tuple(body.prompt.encode())
    gen = GenerationRequest(
        prompt_ids, body.max_tokens, SamplingParams(temperature=body.temperature), seed
    )
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    if body.stream:
        return StreamingResponse(
            _events(gen, cid, created, body.model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    decoder = Utf8Decoder()
    text = "".join(decoder.feed(bytes([s.token_id])) for s in engine.stream(gen)) + decoder.finish()
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": body.max_tokens,
                "total_tokens": len(prompt_ids) + body.max_tokens,
            },
        }
    )
