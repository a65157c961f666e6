"""Convert other checkpoint formats into a Hugging Face Llama model directory.

Usage::

    python -m model.convert llama2c --checkpoint stories260K.bin --tokenizer tok512.bin --out DIR

writes ``DIR/config.json``, ``DIR/generation_config.json``, ``DIR/model.safetensors`` (float32,
q/k rows permuted to the rotate-half RoPE layout) and ``DIR/tokenizer.json``. llama2.c models end
a story by emitting BOS (run.c stops on it), so BOS (1) is recorded as an end-of-sequence id
next to ``</s>`` (2) in ``generation_config.json``.

Source: llama2.c `run.c` and `export.py`; the Hugging Face Llama directory layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import safetensors.numpy

from model.llama.formats.llama2c import (
    BOS_ID,
    EOS_ID,
    build_hf_tokenizer,
    read_checkpoint,
    read_tokenizer,
)

RMS_NORM_EPS = 1e-5  # llama2.c's rmsnorm
ROPE_THETA = 10000.0  # llama2.c's RoPE base


def convert_llama2c(
    checkpoint: str | os.PathLike, tokenizer: str | os.PathLike, out: str | os.PathLike
) -> Path:
    """Write a Hugging Face Llama directory from a llama2.c checkpoint and ``tokenizer.bin``.

    Args:
        checkpoint: The legacy llama2.c ``.bin`` checkpoint.
        tokenizer: The llama2.c ``tokenizer.bin`` (score-ordered pieces) for it.
        out: Output directory (created if missing; existing files of the same names are replaced).

    Returns:
        The output directory.

    Raises:
        ValueError: If either file is malformed or they disagree on the vocabulary size.
        OSError: If a file cannot be read or written.

    Source: llama2.c `run.c` (`read_checkpoint`, `build_tokenizer`); transformers
    `convert_llama_weights_to_hf.py` (names, RoPE permutation).
    """
    ckpt = read_checkpoint(Path(checkpoint).read_bytes())
    pieces, scores = read_tokenizer(Path(tokenizer).read_bytes(), ckpt.vocab_size)
    hf_tokenizer = build_hf_tokenizer(pieces, scores)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(ckpt.tensors, out / "model.safetensors", metadata={"format": "pt"})
    # The writer creates the file 0600; the model is read by the serving user, like its config.
    os.chmod(out / "model.safetensors", 0o644)
    hf_tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", _config(ckpt))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID]},
    )
    return out


def _config(ckpt) -> dict:
    """Return the ``config.json`` object of a converted llama2.c checkpoint."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": ckpt.dim,
        "intermediate_size": ckpt.hidden_dim,
        "num_hidden_layers": ckpt.n_layers,
        "num_attention_heads": ckpt.n_heads,
        "num_key_value_heads": ckpt.n_kv_heads,
        "vocab_size": ckpt.vocab_size,
        "max_position_embeddings": ckpt.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "tie_word_embeddings": ckpt.shared_classifier,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the converter command line; return the exit status.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        0 on success, 1 when an input is malformed or unreadable (the message goes to stderr).
    """
    parser = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__)
    sub = parser.add_subparsers(dest="format", required=True)
    l2c = sub.add_parser("llama2c", help="a llama2.c checkpoint and tokenizer.bin")
    l2c.add_argument("--checkpoint", required=True, help="legacy llama2.c .bin checkpoint")
    l2c.add_argument("--tokenizer", required=True, help="llama2.c tokenizer .bin")
    l2c.add_argument("--out", required=True, help="output model directory")
    args = parser.parse_args(argv)
    try:
        out = convert_llama2c(args.checkpoint, args.tokenizer, args.out)
    except (ValueError, OSError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
