"""GGUF files for tests: SmolLM2 fetched the documented way, and tiny llama GGUFs written here.

``smollm2_gguf`` runs ``python -m model.fetch smollm2`` (the README's command) into the default
cache directory, so a machine downloads the file once and every later run reuses it. Outside CI a
failed download skips the tests that need the file; under ``CI=true`` it fails them.

Other test modules import these: ``from tests.gguffiles import smollm2_gguf, write_tiny_gguf``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from model.loader import LoadedModel, load_model
from tests.llamafiles import STORIES_DIR, shared_data_or_skip
from tests.needs import unavailable
from tests.server import ROOT, GunicornServer

# llama.cpp's reference outputs for the SmolLM2 file (../shared/data/smollm2, see its SOURCE.txt).
SMOLLM2_DATA = STORIES_DIR.parent / "smollm2"
SMOLLM2_SOURCE = (
    "llama.cpp's own outputs for SmolLM2-135M-Instruct Q4_1 (llama-cpp-python 0.3.36, one thread, "
    "greedy): golden token ids and text, teacher-forced top-5 ids, a full logits row"
)
SMOLLM2_FILES = (
    "llamacpp_golden.json",
    "llamacpp_teacher_forced.json",
    "llamacpp_logits_capital_of_france.npy",
)
# Tiny model: dim 256 so one k-quant super-block (256 values) is one row.
TINY = {"dim": 256, "hidden_dim": 256, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1}


def byte_chars() -> list[str]:
    """Return GPT-2's printable character for each byte 0..255."""
    from model.tokenizer import _byte_level_chars

    table = _byte_level_chars()
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Return ``(tokens, token types, merges)`` of a 258-token byte-level BPE vocabulary."""
    tokens = [*byte_chars(), "\u0120t", "<|endoftext|>"]
    types = [1] * 257 + [3]
    return tokens, types, ["\u0120 t"]


def random_tensors(
    rng: np.random.Generator, dims: dict[str, int], vocab_size: int
) -> dict[str, np.ndarray]:
    """Return float32 GGUF-named tensors of a llama model (numpy shapes, rows first)."""
    d, h, hd = dims["dim"], dims["hidden_dim"], dims["dim"] // dims["n_heads"]
    kv = dims["n_kv_heads"] * hd
    out = {"token_embd.weight": rng.normal(0, 0.5, (vocab_size, d))}
    for i in range(dims["n_layers"]):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = 1 + rng.normal(0, 0.1, d)
        out[p + "attn_q.weight"] = rng.normal(0, 0.05, (d, d))
        out[p + "attn_k.weight"] = rng.normal(0, 0.05, (kv, d))
        out[p + "attn_v.weight"] = rng.normal(0, 0.05, (kv, d))
        out[p + "attn_output.weight"] = rng.normal(0, 0.05, (d, d))
        out[p + "ffn_norm.weight"] = 1 + rng.normal(0, 0.1, d)
        out[p + "ffn_gate.weight"] = rng.normal(0, 0.05, (h, d))
        out[p + "ffn_down.weight"] = rng.normal(0, 0.05, (d, h))
        out[p + "ffn_up.weight"] = rng.normal(0, 0.05, (h, d))
    out["output_norm.weight"] = 1 + rng.normal(0, 0.1, d)
    return {k: v.astype(np.float32) for k, v in out.items()}


RawTensor = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]


def write_tiny_gguf(
    path: Path,
    tensors: dict[str, RawTensor] | None = None,
    *,
    arch: str = "llama",
    dims: dict[str, int] | None = None,
    tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    seed: int = 0,
    pre: str = "smollm",
) -> Path:
    """Write a small llama GGUF with ``gguf.GGUFWriter``.

    Args:
        path: The file to write.
        tensors: GGUF name -> float32 array, or ``(raw bytes (rows, row_bytes) uint8 / raw
            values, type)``; None values remove a tensor. Defaults to random float32 tensors.
        arch: ``general.architecture``.
        dims: Hyper-parameters (``TINY`` by default).
        tokenizer: Writes the tokenizer keys; the tiny byte-level vocabulary by default.
        metadata: Writes extra keys last.
        seed: Seed of the random tensors.
        pre: ``tokenizer.ggml.pre`` of the default tokenizer.
    """
    dims = dims or TINY
    tokens, types, merges = tiny_vocab()
    all_tensors: dict[str, RawTensor | None] = dict(
        random_tensors(np.random.default_rng(seed), dims, len(tokens))
    )
    all_tensors.update(tensors or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(dims["n_layers"])
    writer.add_context_length(64)
    writer.add_embedding_length(dims["dim"])
    writer.add_feed_forward_length(dims["hidden_dim"])
    writer.add_head_count(dims["n_heads"])
    writer.add_head_count_kv(dims["n_kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_add_bos_token(False)
    else:
        tokenizer(writer)
    if metadata is not None:
        metadata(writer)
    for name, value in all_tensors.items():
        if value is None:
            continue
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fetch_or_skip(name: str) -> Path:
    """Return the verified model file fetched by ``python -m model.fetch`` (README's command).

    Skips the test when the download fails outside CI; fails it under CI.
    """
    done = subprocess.run(
        [sys.executable, "-m", "model.fetch", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode == 0:
        return Path(done.stdout.strip().splitlines()[-1])
    reason = f"python -m model.fetch {name} failed: {done.stderr.strip()}"
    unavailable(reason)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF, fetched (once) into the default cache directory."""
    return fetch_or_skip("smollm2")


@pytest.fixture(scope="session")
def gguf_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-private float32 weights cache directory."""
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path, gguf_cache_dir: Path) -> LoadedModel:
    """SmolLM2 loaded through ``load_model`` (its cache file built once per session)."""
    return load_model(smollm2_gguf, cache_dir=gguf_cache_dir)


def smollm2_server_unstarted(
    tmp_path_factory: pytest.TempPathFactory,
    smollm2_gguf: Path,
    gguf_cache_dir: Path,
    name: str,
    **env: str,
) -> GunicornServer:
    """Return a gunicorn (not started) serving SmolLM2 on the API port only, with ``env``'s settings
    over these: the weights cache in ``gguf_cache_dir``, and a 600 s request timeout (a loaded
    machine must not turn a slow answer into a 504)."""
    settings = {
        "MODEL_DIR": str(smollm2_gguf),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),
        "REQUEST_TIMEOUT_S": "600",
        **env,
    }
    return GunicornServer(tmp_path_factory.mktemp(name), settings, health_port=False)


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_gguf: Path,
    smollm2: LoadedModel,  # loading it first builds the weights cache that the server then maps
    gguf_cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GunicornServer]:
    """One gunicorn (1 gevent worker, API + health ports) serving SmolLM2 from its GGUF."""
    srv = GunicornServer(
        tmp_path_factory.mktemp("smollm2-server"),
        {"MODEL_DIR": str(smollm2_gguf), "GREENSERVE_CACHE_DIR": str(gguf_cache_dir)},
    )
    srv.start(timeout_s=120)  # mapping a 0.5 GB float32 cache takes a while on a busy machine
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smollm2_data() -> Path:
    """The shared llama.cpp reference folder; skips (fails under CI) when it is absent.

    Listed before ``smollm2`` in a test's arguments, it skips before the model is loaded.
    """
    return smollm2_data_or_skip()


def smollm2_data_or_skip() -> Path:
    """Return the shared ``smollm2`` folder, or skip the test (fail it under CI) when it is absent."""
    return shared_data_or_skip(SMOLLM2_DATA, SMOLLM2_FILES, SMOLLM2_SOURCE)


def golden() -> dict:
    """Return ``llamacpp_golden.json``: what llama.cpp produced for the SmolLM2 file."""
    return json.loads((smollm2_data_or_skip() / "llamacpp_golden.json").read_text())


def teacher_forced() -> dict:
    """Return ``llamacpp_teacher_forced.json``: llama.cpp's per-position top ids and gaps."""
    return json.loads((smollm2_data_or_skip() / "llamacpp_teacher_forced.json").read_text())


def golden_logits() -> np.ndarray:
    """Return llama.cpp's ``(49152,)`` float32 logits after "The capital of France is"."""
    return np.load(smollm2_data_or_skip() / "llamacpp_logits_capital_of_france.npy")
