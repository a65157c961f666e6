"""Build Llama models for tests: the committed tiny fixture, converted stories260K, and a
SmolLM2-shaped model of seeded random weights.

Other test modules import these: ``from tests.llamafiles import write_tiny_llama``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from model.llama.formats.convert import convert_llama2c
from model.llama.formats.llama2c import build_hf_tokenizer
from model.llama.forward.config import LlamaConfig
from model.llama.forward.model import Llama, tensor_shapes
from tests.needs import unavailable

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_DIR = FIXTURES / "tiny_llama"
# The shared data folder sits next to the repository (../shared/data from the repo root);
# GREENSERVE_SHARED_DATA points elsewhere (a folder holding stories260K/).
STORIES_DIR = (
    Path(
        os.environ.get("GREENSERVE_SHARED_DATA", "")
        or Path(__file__).resolve().parents[2] / "shared" / "data"
    )
    / "stories260K"
)
STORIES_FILES = ("stories260K.bin", "tok512.bin", "expected_greedy.json")
STORIES_SOURCE = (
    "Karpathy's stories260K llama2.c checkpoint and tok512 tokenizer (the tinyllamas release, MIT), "
    "with expected_greedy.json from llama2.c's run.c at temperature 0"
)


def tiny_reference() -> tuple[list[list[int]], np.ndarray]:
    """Return the fixture's two token sequences and HF's ``(2, 16, 300)`` float32 logits."""
    tokens = json.loads((FIXTURES / "tiny_llama_tokens.json").read_text())
    return tokens, np.load(FIXTURES / "tiny_llama_logits.npy")


def tiny_pieces() -> list[bytes]:
    """Return 300 llama2.c-style pieces: specials, 256 byte tokens, letters, space, merges."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    pieces += [bytes((c,)) for c in b" abcdefghijklmnopqrstuvwxyz"]
    pieces += [b" t", b"he", b" the", b" a", b"in", b"er", b"on", b" s", b"an", b"re"]
    pieces += [b"at", b"en", b"ed", b" w"]
    assert len(pieces) == 300
    return pieces


def write_tiny_tokenizer(directory: Path) -> Path:
    """Write a 300-token ``tokenizer.json``; earlier merges score higher, as in sentencepiece."""
    pieces = tiny_pieces()
    first_merge = 259 + 27
    scores = [0.0] * first_merge + [-float(i) for i in range(len(pieces) - first_merge)]
    path = directory / "tokenizer.json"
    build_hf_tokenizer(pieces, scores).save(str(path))
    return path


def write_tiny_llama(directory: Path) -> Path:
    """Copy the committed tiny Llama fixture into ``directory`` and add a tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(TINY_DIR / name, directory / name)
    write_tiny_tokenizer(directory)
    return directory


def shared_data_or_skip(folder: Path, names: tuple[str, ...], source: str) -> Path:
    """Return ``folder`` when it holds every file in ``names``; else skip the test, saying where the
    data comes from (``source``) and where it is looked for.

    Under ``CI`` the test fails instead: CI lays ``shared/`` beside the clone, so a skip there
    would hide a gap.
    """
    missing = [name for name in names if not (folder / name).is_file()]
    if not missing:
        return folder
    reason = (
        f"shared data {folder} is absent (missing {', '.join(missing)}): {source}; it is looked "
        "for in ../shared/data beside the checkout, or in $GREENSERVE_SHARED_DATA (the folder "
        "holding stories260K/ and smollm2/); its SOURCE.txt says how each file was made"
    )
    unavailable(reason)


def stories_or_skip() -> Path:
    """Return the shared stories260K folder, or skip the test when it is not there."""
    return shared_data_or_skip(STORIES_DIR, STORIES_FILES, STORIES_SOURCE)


def convert_stories(out: Path) -> Path:
    """Convert the shared stories260K checkpoint and tokenizer into ``out``."""
    src = stories_or_skip()
    return convert_llama2c(src / "stories260K.bin", src / "tok512.bin", out)


def expected_greedy() -> dict:
    """Return the ``cases`` of the shared ``expected_greedy.json``."""
    return json.loads((stories_or_skip() / "expected_greedy.json").read_text())["cases"]


def random_llama(n_layers: int, seed: int = 0) -> Llama:
    """Return a SmolLM2-135M-shaped model (all but the depth) with seeded random weights."""
    config = LlamaConfig.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 576,
            "num_hidden_layers": n_layers,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        }
    )
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        scale = 1.0 if len(shape) == 1 else 1.0 / np.sqrt(shape[-1])
        tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    return Llama.from_tensors(config, tensors, "random SmolLM2-135M shape")
