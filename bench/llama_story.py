"""Generate one story with a Llama model directory, streamed the way the server will stream it.

Loads ``$MODEL_DIR`` (or ``--model-dir``) with ``model.loader.load_model``, runs the simple
``LlamaEngine`` (PCG32 seed, temperature, top-p) and prints each token's bytes through the
incremental UTF-8 decoder as it arrives, then the finish reason and the speed.

Run, for example::

    python -m model.convert llama2c --checkpoint ../shared/data/stories260K/stories260K.bin \\
        --tokenizer ../shared/data/stories260K/tok512.bin --out /tmp/stories260K
    MODEL_DIR=/tmp/stories260K python -m bench.llama_story --seed 133742
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from model.engine import GenerationRequest  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.utf8 import Utf8Decoder  # noqa: E402


def main() -> int:
    """Parse arguments, generate, print; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.environ.get("MODEL_DIR"))
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=133742)
    args = parser.parse_args()
    if not args.model_dir:
        parser.error("set MODEL_DIR or pass --model-dir")
    loaded = load_model(args.model_dir)
    tok = loaded.tokenizer
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    prompt_ids = tuple(tok.encode(args.prompt))
    req = GenerationRequest(prompt_ids, args.max_tokens, params, args.seed)
    decoder = Utf8Decoder()
    sys.stdout.write(args.prompt)
    finish, n, t0 = "length", 0, time.perf_counter()
    for step in loaded.make_engine().stream(req):
        n += 1
        if step.finish_reason is not None:
            finish = step.finish_reason
        if step.finish_reason == "stop":
            break  # the EOS token's text is not part of the completion
        sys.stdout.write(decoder.feed(tok.token_bytes[step.token_id]))
        sys.stdout.flush()
    sys.stdout.write(decoder.finish())
    elapsed = time.perf_counter() - t0
    print(f"\n\n[{len(prompt_ids)} prompt tokens, {n} generated, finish_reason={finish}, "
          f"{n / elapsed:.0f} tokens/s]")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
