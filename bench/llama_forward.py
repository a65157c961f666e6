"""Micro-benchmark: tokens/s of the bare Llama forward pass (no sampling, no HTTP) at several batches.

Decode: ``batch`` sequences, each prefilled with a ``--prompt-len`` prompt, then ``--steps``
calls of ``Llama.decode`` (one new token per sequence per call, the argmax fed back);
tokens/s = batch * steps / seconds. Prefill: one ``--prefill-len`` prompt in one pass.
The best of ``--repeats`` runs is reported. OpenBLAS is pinned to one thread (as in a worker).

Run: ``python -m bench.llama_forward [--model-dir DIR | --synthetic 288,6,6,6,768,32000]``;
without either it converts ``../shared/data/stories260K`` into a temporary directory first.
``--synthetic dim,n_layers,n_heads,n_kv_heads,hidden_dim,vocab_size[,rope_theta,max_seq_len]`` writes a
model of that shape with seeded random weights (stories15M's shape above) to time a bigger network;
SmolLM2-135M is ``576,30,9,3,1536,49152,100000,8192``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import safetensors.numpy  # noqa: E402

from model.kernels.packed import PackedWeight  # noqa: E402
from model.llama.formats.convert import convert_llama2c  # noqa: E402
from model.llama.forward.config import LlamaConfig  # noqa: E402
from model.llama.forward.model import Llama, tensor_shapes  # noqa: E402

STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "stories260K"


def write_synthetic(directory: str, shape: str, seed: int = 0) -> str:
    """Write a Llama directory of the given shape with random weights; return its path."""
    fields = shape.split(",")
    dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size = map(int, fields[:6])
    rope_theta = float(fields[6]) if len(fields) > 6 else 10000.0
    max_seq_len = int(fields[7]) if len(fields) > 7 else 1024
    config = {
        "model_type": "llama",
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "intermediate_size": hidden_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_seq_len,
        "rope_theta": rope_theta,
        "tie_word_embeddings": True,
    }
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(LlamaConfig.from_hf(config))
    tensors = {
        name: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
        for name, s in shapes.items()
    }
    Path(directory, "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, Path(directory, "model.safetensors"))
    return directory


def decode_tokens_per_s(
    model: Llama, batch: int, prompt_len: int, steps: int, batch_invariant: bool = True
) -> float:
    """Return decode tokens/s for ``batch`` sequences advanced ``steps`` times together."""
    vocab = model.vocab_size
    caches = [model.new_cache(prompt_len + steps) for _ in range(batch)]
    # Distinct prompts (ids spread over the vocabulary) so the sequences really differ.
    ids = []
    for b, cache in enumerate(caches):
        prompt = [(1 + 37 * b + 11 * t) % vocab for t in range(prompt_len)]
        ids.append(int(np.argmax(model.prefill(prompt, cache))))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(ids, caches, batch_invariant)
        ids = [int(i) for i in np.argmax(logits, axis=1)]
    return batch * steps / (time.perf_counter() - t0)


def prefill_tokens_per_s(model: Llama, prompt_len: int) -> float:
    """Return prefill tokens/s for one prompt of ``prompt_len`` tokens."""
    prompt = [(1 + 11 * t) % model.vocab_size for t in range(prompt_len)]
    cache = model.new_cache(prompt_len)
    t0 = time.perf_counter()
    model.prefill(prompt, cache)
    return prompt_len / (time.perf_counter() - t0)


def _weights(model: Llama) -> list[np.ndarray | PackedWeight]:
    """Return every distinct weight array of the model."""
    arrays = [model.tok_embeddings, model.rms_final]
    if model.wcls is not model.tok_embeddings:
        arrays.append(model.wcls)
    for layer in model.layers:
        arrays += [getattr(layer, f) for f in layer.__slots__]
    return arrays


def _size(w: np.ndarray | PackedWeight) -> int:
    """Return a weight's parameters: a vector's size, a packed matrix's ``out * in``."""
    return w.out * w.in_ if isinstance(w, PackedWeight) else w.size


def main() -> None:
    """Parse arguments, run the measurements, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="Hugging Face Llama directory (default: stories260K)")
    parser.add_argument(
        "--synthetic", help="dim,n_layers,n_heads,n_kv_heads,hidden_dim,vocab[,rope_theta,context]"
    )
    parser.add_argument("--batches", default="1,4,16,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--batch-invariant",
        choices=("1", "0", "both"),
        default="both",
        help="decode mode(s) to time (BATCH_INVARIANT); 0 is reported as decode_gemm_*",
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = args.model_dir, args.model_dir
        if args.synthetic:
            model_dir, name = write_synthetic(tmp, args.synthetic), f"synthetic {args.synthetic}"
        elif model_dir is None:
            model_dir = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp)
            name = "stories260K (converted)"
        model = Llama.load(model_dir)
        result = {"model": name, "params": sum(_size(w) for w in _weights(model))}
        result["openblas_threads"] = os.environ["OPENBLAS_NUM_THREADS"]
        modes = {"1": [True], "0": [False], "both": [True, False]}[args.batch_invariant]
        for batch in (int(b) for b in args.batches.split(",")):
            for invariant in modes:
                best = max(
                    decode_tokens_per_s(model, batch, args.prompt_len, args.steps, invariant)
                    for _ in range(args.repeats)
                )
                key = "decode" if invariant else "decode_gemm"
                result[f"{key}_batch{batch}_tokens_per_s"] = round(best, 1)
        best = max(prefill_tokens_per_s(model, args.prefill_len) for _ in range(args.repeats))
        result[f"prefill_{args.prefill_len}_tokens_per_s"] = round(best, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
