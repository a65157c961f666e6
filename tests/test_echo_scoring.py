"""Scoring a prompt for ``echo`` with ``logprobs``: in chunks, under the request's deadline and client.

A Llama prompt is scored :data:`~model.llama.serving.scheduler.SCORE_CHUNK` tokens a pass, on the engine's
scoring thread, and between chunks the request's greenlet looks at its deadline and its client: a
7,000-token SmolLM2 prompt was one pass of ~2.5 minutes that held 1.4 GB of logits and ignored both
(a 200 after 147 s with a 5 s deadline; a slot held 8 minutes after its client left). The chunks'
logits are the bits of one pass (the forward pass is batch- and chunk-invariant).
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np

from model.llama.serving.scheduler import SCORE_CHUNK, BatchScheduler
from model.loader import load_model
from model.sampling import logprobs_of
from tests.server import GunicornServer, raw_request, wait_until


def test_chunked_scoring_is_the_bits_of_one_pass(stories_dir):
    stories = load_model(stories_dir)
    model = stories.model
    rng = np.random.default_rng(5)
    prompt = [1, *(int(t) for t in rng.integers(3, model.vocab_size, SCORE_CHUNK + 150))]
    steps = BatchScheduler(model, stories.tokenizer.eos_ids, 1).score(prompt, 2)
    logits = model.prompt_logits(prompt, model.new_cache(len(prompt)))  # one pass, every row
    assert len(steps) == len(prompt) and steps[0].logprob is None
    for t in (1, SCORE_CHUNK - 1, SCORE_CHUNK, SCORE_CHUNK + 1, len(prompt) - 1):
        want = logprobs_of(logits[t - 1])[prompt[t]]
        assert steps[t].token_id == prompt[t] and steps[t].logprob == want, t


LONG = "The history of the world is long and full of wonder. " * 250  # ~2,750 SmolLM2 tokens


def test_a_long_echo_ends_at_its_deadline_and_a_leaver_frees_its_slot(
    smollm2_gguf, gguf_cache_dir, tmp_path
):
    env = {
        "MODEL_DIR": str(smollm2_gguf),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
        "REQUEST_TIMEOUT_S": "3",
    }
    body = {"model": "s", "prompt": LONG, "max_tokens": 0, "echo": True, "logprobs": 1}
    srv = GunicornServer(tmp_path, env).start(timeout_s=180)
    try:
        t0 = time.monotonic()
        status, _, raw = srv.complete(body)
        elapsed = time.monotonic() - t0
        # the deadline, give or take one chunk of scoring (~2 s here on a busy core)
        assert status == 504, raw
        assert json.loads(raw)["error"]["code"] == "timeout"
        assert 3.0 <= elapsed < 3.0 + 6.0, elapsed
    finally:
        srv.stop()
    # A client that leaves mid-scoring (a 30 s deadline now) frees its slot within a chunk.
    env["REQUEST_TIMEOUT_S"] = "30"
    srv = GunicornServer(tmp_path / "leaver", env).start(timeout_s=180)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(raw_request(body, "leaver-1"))
        wait_until(lambda: srv.in_flight("leaver-1"), 10, "the echo to be running")
        sock.close()
        t0 = time.monotonic()
        srv.wait_idle(timeout_s=30)
        # halfway to the 30 s deadline that would free it otherwise (a chunk is ~1 s idle, several
        # on a loaded machine)
        assert time.monotonic() - t0 < 15
        line = wait_until(lambda: leaver_line(srv), 10, "the leaver's log line")
        assert line["end_reason"] == "client_left"
    finally:
        srv.stop()


def leaver_line(srv: GunicornServer) -> dict | None:
    """The JSON log line of the request ``leaver-1``, once written."""
    for text in srv.log_text().splitlines():
        if text.startswith("{") and '"leaver-1"' in text:
            line = json.loads(text)
            if line.get("message") == "request":
                return line
    return None
