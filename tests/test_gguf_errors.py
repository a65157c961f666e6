"""A bad GGUF stops the load with one line naming the file, the tensor (or key) and the problem;
a server started on it (``MODEL_DIR`` = the file) exits 1 with that line, no traceback.

Source: the GGUF specification (architecture key, tensor types, tensor data layout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType

from model.files import file_sha256
from model.llama.formats.gguf_cache import FORMAT_VERSION, cache_path
from model.loader import load_model
from tests.gguffiles import TINY, tiny_vocab, write_tiny_gguf
from tests.server import failed_start


def wrong_shape(path: Path) -> Path:
    return write_tiny_gguf(path, {"blk.0.ffn_up.weight": np.zeros((TINY["dim"], 64), np.float32)})


def unknown_type(path: Path) -> Path:
    # Q8_1 (40-byte blocks of 32) is a ggml type gguf.quants cannot dequantize.
    raw = np.zeros((TINY["hidden_dim"], TINY["dim"] // 32 * 40), np.uint8)
    return write_tiny_gguf(path, {"blk.0.ffn_gate.weight": (raw, Q.Q8_1)})


def truncated(path: Path) -> Path:
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


def other_arch(path: Path) -> Path:
    return write_tiny_gguf(path, arch="gpt2")


def missing_tensor(path: Path) -> Path:
    return write_tiny_gguf(path, {"blk.0.attn_v.weight": None})


def unknown_pre(path: Path) -> Path:
    return write_tiny_gguf(path, pre="klingon")


def edited(path: Path, key: str, part: int, value: int) -> Path:
    """Write the tiny GGUF, then overwrite one part of a metadata field in place (the reader's
    writable map): ``part`` -1 is a scalar's value; 3 and 4 an array's element type and length."""
    write_tiny_gguf(path)
    reader = GGUFReader(path, "r+")
    reader.fields[key].parts[part][0] = value
    reader.data.flush()
    del reader
    return path


def huge_block_count(path: Path) -> Path:
    return edited(path, "llama.block_count", -1, 10**9)


def nested_array(path: Path) -> Path:
    return edited(path, "tokenizer.ggml.tokens", 3, int(GGUFValueType.ARRAY))


def huge_array(path: Path) -> Path:
    return edited(path, "tokenizer.ggml.tokens", 4, 10**9)


def huge_context(path: Path) -> Path:
    write_tiny_gguf(path)
    reader = GGUFReader(path, "r+")
    field = reader.fields["llama.context_length"]
    field.parts[-1][0] = 2**32 - 1  # a u32 key: the largest value it can hold
    reader.data.flush()
    del reader
    return path


def many_merges(path: Path) -> Path:
    tokens, types, _ = tiny_vocab()

    def tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(["\u0120 t"] * (4 * len(tokens) + 1))

    return write_tiny_gguf(path, tokenizer=tokenizer)


def moved_offset(path: Path, name: str, offset_of: str | int) -> Path:
    """Write the tiny GGUF, then point tensor ``name``'s data offset elsewhere (in place)."""
    write_tiny_gguf(path)
    reader = GGUFReader(path, "r+")
    fields = {t.name: t.field for t in reader.tensors}
    if isinstance(offset_of, str):
        offset_of = int(fields[offset_of].parts[-1][0])
    fields[name].parts[-1][0] = offset_of
    reader.data.flush()
    del reader
    return path


def overlapping(path: Path) -> Path:
    return moved_offset(path, "blk.0.attn_q.weight", "token_embd.weight")


def misaligned(path: Path) -> Path:
    return moved_offset(path, "blk.0.attn_q.weight", 3)


def nan_weights(path: Path) -> Path:
    return write_tiny_gguf(path, {"blk.0.attn_q.weight": np.full((256, 256), np.nan, np.float32)})


def inf_embedding(path: Path) -> Path:
    return write_tiny_gguf(path, {"token_embd.weight": np.full((258, 256), np.inf, np.float32)})


CASES = {
    "wrong shape": (
        wrong_shape,
        "tensor 'blk.0.ffn_up.weight' has shape [256, 64] (rows, columns), expected [256, 256] "
        "from the metadata",
    ),
    "unknown type": (
        unknown_type,
        "tensor 'blk.0.ffn_gate.weight' has type Q8_1, which gguf.quants cannot dequantize",
    ),
    "truncated": (truncated, "tensor 'output_norm.weight': data ends at byte "),
    "unknown architecture": (
        other_arch,
        "general.architecture is 'gpt2'; only 'llama' is supported",
    ),
    "missing tensor": (missing_tensor, "tensor 'blk.0.attn_v.weight' is missing"),
    "unknown pre-tokenizer": (unknown_pre, "tokenizer.ggml.pre 'klingon' is not supported"),
    "huge block count": (
        huge_block_count,
        "llama.block_count=1000000000 but the file holds tensors of 1 blocks",
    ),
    "nested array": (
        nested_array,
        "metadata 'tokenizer.ggml.tokens' is an array of arrays, which is not supported",
    ),
    "huge array": (
        huge_array,
        "metadata 'tokenizer.ggml.tokens' declares 1000000000 elements, more than 1048576",
    ),
    "huge context": (
        huge_context,
        "metadata llama.context_length=4294967295 is more than 16777216 tokens",
    ),
    "overlapping tensors": (
        overlapping,
        "tensor 'token_embd.weight': data at offset 0 overlaps tensor 'blk.0.attn_q.weight'",
    ),
    "misaligned tensor": (
        misaligned,
        "tensor 'blk.0.attn_q.weight': data offset 3 is not a multiple of the alignment 32",
    ),
    "too many merges": (
        many_merges,
        "tokenizer.ggml.merges holds 1033 merges, more than 4 x 258 tokens",
    ),
}


def refused(tmp_path: Path, make: Callable[[Path], Path]) -> tuple[Path, str]:
    """Write a bad GGUF with ``make`` and load it; return its path and the ``ValueError``'s text."""
    path = make(tmp_path / "bad.gguf")
    with pytest.raises(ValueError) as err:
        load_model(path, cache_dir=tmp_path / "cache")
    return path, str(err.value)


@pytest.mark.parametrize("case", CASES)
def test_load_names_file_tensor_and_problem(tmp_path, case):
    make, message = CASES[case]
    path, text = refused(tmp_path, make)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert not (tmp_path / "cache").exists()  # refused before anything is dequantized


def test_truncated_message_is_complete(tmp_path):
    path = truncated(tmp_path / "cut.gguf")
    size = path.stat().st_size
    with pytest.raises(ValueError, match=rf"the file has only {size} bytes \(truncated file\)$"):
        load_model(path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("case", CASES)
def test_server_on_a_bad_gguf_exits_with_one_line(tmp_path, case):
    make, message = CASES[case]
    path = make(tmp_path / "bad.gguf")
    env = {"MODEL_DIR": str(path), "GREENSERVE_CACHE_DIR": str(tmp_path / "cache")}
    _, lines = failed_start(tmp_path, env)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"greenserve: cannot start: MODEL_DIR ({path}): {path}: ")
    assert message in lines[0]


def test_directory_with_two_gguf_files_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); name one"):
        load_model(tmp_path, cache_dir=tmp_path / "cache")


def test_reader_running_out_of_memory_is_one_line(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "m.gguf")

    def exhausted(self, offs, count):
        raise MemoryError

    monkeypatch.setattr(GGUFReader, "_build_fields", exhausted)
    with pytest.raises(ValueError) as err:
        load_model(path, cache_dir=tmp_path / "cache")
    assert str(err.value) == (
        f"{path}: not a readable GGUF file: its header needs more memory than this host has"
    )


NON_FINITE = {
    "nan": (nan_weights, "tensor 'blk.0.attn_q.weight' holds NaN or infinite values"),
    "inf": (inf_embedding, "tensor 'token_embd.weight' holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", NON_FINITE)
def test_non_finite_weights_are_refused_at_load(tmp_path, case):
    make, message = NON_FINITE[case]
    path, text = refused(tmp_path, make)
    assert text == f"{path}: {message}"
    assert list((tmp_path / "cache" / "gguf").iterdir()) == [
        tmp_path / "cache" / "gguf" / f"{file_sha256(path)}.v{FORMAT_VERSION}.safetensors.lock"
    ]  # nothing cached


def test_a_cache_written_without_the_finite_check_is_rebuilt_and_refused(tmp_path):
    path = nan_weights(tmp_path / "bad.gguf")
    sha = file_sha256(path)
    cached = cache_path(tmp_path / "cache", sha)
    cached.parent.mkdir(parents=True)
    raw = {"model.norm.weight": np.full(256, np.nan, np.float32)}
    old_metadata = {
        "format": "greenserve-gguf-cache",
        "version": str(FORMAT_VERSION),
        "gguf_sha256": sha,
    }  # no "weights": "finite" verdict
    safetensors.numpy.save_file(raw, str(cached), metadata=old_metadata)
    with pytest.raises(ValueError, match="holds NaN or infinite values$"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_server_on_nan_weights_exits_with_one_line(tmp_path):
    path = nan_weights(tmp_path / "bad.gguf")
    env = {"MODEL_DIR": str(path), "GREENSERVE_CACHE_DIR": str(tmp_path / "cache")}
    _, lines = failed_start(tmp_path, env)
    assert lines == [
        f"greenserve: cannot start: MODEL_DIR ({path}): {path}: " + NON_FINITE["nan"][1]
    ]
