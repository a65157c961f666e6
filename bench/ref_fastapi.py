"""What many users would write instead: a straightforward FastAPI + uvicorn server of the same contract.

A pydantic body; the model loaded once with ``Bigram.load``; per token the straightforward numpy
softmax and inverse-CDF draw of ``bench.straightforward`` (exact per docs/ARCHITECTURE.md §6: a seed gives the
same text as greenserve), CPython's incremental UTF-8 decoder and one ``json.dumps`` of the chunk dict;
a ``StreamingResponse`` over an async generator that awaits ``asyncio.sleep(0)`` after every token so
one stream does not starve the others. Fields the benchmark sends: ``model``, ``prompt``,
``max_tokens``, ``temperature``, ``seed``, ``stream``.

Run: ``python -m uvicorn bench.ref_fastapi:app --port PORT --no-access-log`` (uvloop and httptools
when installed, as ``uvicorn[standard]`` does).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from bench.straightforward import chunk_event, token_texts
from model.bigram.model import Bigram

app = FastAPI()
weight = np.asarray(Bigram.load(os.environ.get("MODEL_DIR") or None).weight)


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
    first = exc.errors()[0]
    loc = first.get("loc", ())
    error = {
        "message": str(first.get("msg")),
        "type": "invalid_request_error",
        "param": loc[-1] if len(loc) > 1 else None,
        "code": None,
    }
    return JSONResponse({"error": error}, status_code=400)


@app.get("/healthz")
async def healthz() -> Response:
    """Liveness."""
    return Response(b'{"status":"ok"}', media_type="application/json")


async def _events(body: CompletionBody, seed: int, cid: str, created: int):
    yield b": ok\n\n"
    texts = token_texts(weight, body.prompt.encode(), body.max_tokens, body.temperature, seed)
    for i, text in enumerate(texts):
        finish = "length" if i == body.max_tokens - 1 else None
        yield chunk_event(cid, created, body.model, text, finish)
        await asyncio.sleep(0)
    yield b"data: [DONE]\n\n"


@app.post("/v1/completions")
async def completions(body: CompletionBody):
    """Generate a completion, streamed as Server-Sent Events or as one JSON body."""
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little")
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    if body.stream:
        return StreamingResponse(
            _events(body, seed, cid, created),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    prompt = body.prompt.encode()
    text = "".join(token_texts(weight, prompt, body.max_tokens, body.temperature, seed))
    answer = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": body.max_tokens,
            "total_tokens": len(prompt) + body.max_tokens,
        },
    }
    return Response(
        json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode(),
        media_type="application/json",
    )
