"""MODEL_DIR faults stop the start with one line saying what is wrong and where.

A FIFO or a device never hangs the start; a symlink loop is a loop, not "missing"; an empty directory
says it is empty; a tensor shape whose size overflows 64 bits is named; a request number too large for
a double (``1e400``) says so. Each start is a real gunicorn that must exit 1 with that one line.

Source: POSIX ``stat(2)`` file types, ``ELOOP``; the GGUF specification (``gguf_tensor_info_t``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.gguffiles import write_tiny_gguf
from tests.server import failed_start


def fifo(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def start_fails_with(tmp_path: Path, model: Path | str, message: str) -> None:
    env = {"MODEL_DIR": str(model), "GREENSERVE_CACHE_DIR": str(tmp_path / "cache")}
    _, lines = failed_start(tmp_path, env)
    assert lines == [f"greenserve: cannot start: MODEL_DIR ({model}): {message}"]


@pytest.mark.parametrize("name", ["model", "model.gguf"])
def test_a_fifo_is_refused_at_once(tmp_path, name):
    path = fifo(tmp_path, name)
    start_fails_with(tmp_path, path, f"{path}: is a FIFO, not a model directory or a .gguf file")


def test_a_device_is_refused(tmp_path):
    start_fails_with(
        tmp_path,
        "/dev/null",
        "/dev/null: is a character device, not a model directory or a .gguf file",
    )


def test_a_fifo_inside_the_directory_is_refused(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    config = fifo(model, "config.json")
    start_fails_with(tmp_path, model, f"{config}: not a regular file (a FIFO)")


def test_a_symlink_loop_is_named_a_loop(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    start_fails_with(
        tmp_path, a, f"{a}: is a symlink loop ({a} -> {b} -> {a}): it never reaches a file"
    )


def test_an_empty_directory_says_it_is_empty(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    start_fails_with(
        tmp_path,
        empty,
        f"{empty}: is an empty directory: no config.json and no .gguf file: not a model directory",
    )


def test_a_tensor_shape_overflowing_64_bits_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    reader = GGUFReader(path, "r+")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding.field.parts[3][:] = [2**32, 2**32]  # 2**64 elements: numpy's product wraps to 0
    reader.data.flush()
    del reader, embedding
    start_fails_with(
        tmp_path,
        path,
        f"{path}: tensor 'token_embd.weight': shape [4294967296, 4294967296] holds "
        "18446744073709551616 elements, which overflows a 64-bit size (a corrupt or forged header)",
    )


@pytest.mark.parametrize(
    ("field", "wanted"), [("temperature", "a number in 0..2"), ("max_tokens", "an integer in 0..")]
)
def test_a_number_too_large_for_a_double_says_so(default_server, field, wanted):
    body = '{"model": "bigram", "prompt": "x", "' + field + '": 1e400}'
    status, _, raw = default_server.post("/v1/completions", body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"'{field}' must be {wanted}")
    assert error["message"].endswith(
        "got a number too large to represent (it overflows a 64-bit float)."
    )


@pytest.mark.parametrize("value", ["", "  "])
def test_model_dir_set_but_empty_is_refused_not_the_default_model(tmp_path, value):
    # MODEL_DIR=$(python -m model.fetch smollm2) leaves it empty when the fetch fails; that served
    # the packaged bigram without a word.
    _, lines = failed_start(tmp_path, {"MODEL_DIR": value})
    assert lines == [
        "greenserve: cannot start: MODEL_DIR is set but empty (did the command that was to print "
        "the model's path fail?); unset it to serve the packaged default model"
    ]
