"""A damaged packed-weights cache of a GGUF is never served.

The cache records a digest of its tensors when it is written; the master checks it when it maps the
file. A file whose tensor bytes changed under a valid header, a truncated one and one with a bad header
are each rebuilt from the GGUF with one warning naming why; in a directory that cannot be written, the
weights are dequantized in memory instead, with a warning. Each case is a real gunicorn whose answer
must equal the answer of an undamaged start.

Source: docs/ARCHITECTURE.md §13; the safetensors format (8-byte header length, JSON header, data).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest

from model.files import file_sha256
from model.llama.formats.gguf_cache import cache_path
from tests.gguffiles import write_tiny_gguf
from tests.server import GunicornServer

BODY = {"model": "m", "prompt": "tt t", "max_tokens": 8, "temperature": 0}


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Return the file offsets ``(begin, end)`` of one tensor's bytes in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, end = header[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Change bytes of a (read-only) file in place, as a disk or a stray tool would."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def damage_warnings(srv: GunicornServer) -> list[dict]:
    """Return the JSON log lines that report a damaged weights cache."""
    out = []
    for line in srv.log_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "weights cache damaged" in obj.get("message", ""):
            out.append(obj)
    return out


def answer(srv: GunicornServer) -> str:
    status, _, body = srv.complete(BODY)
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Path, str]:
    """A tiny GGUF, its cache directory and the text it answers ``BODY`` with, undamaged."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    with start(tmp_path / "clean", path, cache) as srv:
        text = answer(srv)
        assert damage_warnings(srv) == []
    return path, cache, text


def start(workdir: Path, model: Path, cache: Path) -> GunicornServer:
    return GunicornServer(workdir, {"MODEL_DIR": str(model), "GREENSERVE_CACHE_DIR": str(cache)})


def cached_file(model: Path, cache: Path) -> Path:
    return cache_path(cache, file_sha256(model))


def test_the_cache_file_is_written_read_only(tiny):
    path, cache, _ = tiny
    mode = stat.S_IMODE(cached_file(path, cache).stat().st_mode)
    assert mode == 0o444


DAMAGE = {
    # A zeroed tensor under a valid header: on the old code the answer silently changes.
    "zeroed tensor": ("zero", "content digest"),
    "flipped byte": ("flip", "content digest"),
    "truncated": ("truncate", "unreadable"),
    "bad header": ("header", "unreadable"),
}


def damage(file: Path, how: str) -> None:
    if how == "zero":
        begin, end = tensor_span(file, "model.layers.0.self_attn.q_proj.weight.qs")
        overwrite(file, begin, bytes(end - begin))
    elif how == "flip":
        begin, _ = tensor_span(file, "model.norm.weight")
        with open(file, "rb") as f:
            f.seek(begin + 5)
            byte = f.read(1)[0]
        overwrite(file, begin + 5, bytes([byte ^ 0x40]))
    elif how == "truncate":
        os.chmod(file, 0o644)
        os.truncate(file, file.stat().st_size - 4096)
    else:
        overwrite(file, 8, b"\x00\x01")


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_cache_is_rebuilt_with_one_warning(tmp_path, tiny, case):
    path, cache, text = tiny
    file = cached_file(path, cache)
    how, why = DAMAGE[case]
    damage(file, how)
    with start(tmp_path / "damaged", path, cache) as srv:
        assert answer(srv) == text
        warnings = damage_warnings(srv)
    assert len(warnings) == 1, warnings  # the master's; the workers map the rebuilt file
    assert warnings[0]["level"] == "WARNING"
    assert warnings[0]["message"].startswith(f"{file}: weights cache damaged ({why}")
    assert warnings[0]["message"].endswith("rebuilt it from the GGUF")
    assert stat.S_IMODE(file.stat().st_mode) == 0o444
    with start(tmp_path / "again", path, cache) as srv:  # the rebuilt file is good for good
        assert answer(srv) == text
        assert damage_warnings(srv) == []


def read_only(srv: GunicornServer, directory: Path) -> None:
    """Make ``directory`` unwritable for the server, even when the tests run as root."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare(1): cannot make a directory read-only")
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
    srv.cmd = ["unshare", "-m", "sh", "-c", script, str(directory), *srv.cmd]


def test_a_damaged_cache_in_a_read_only_directory_is_dequantized_in_memory(tmp_path, tiny):
    path, cache, text = tiny
    file = cached_file(path, cache)
    damage(file, "zero")
    before = file.read_bytes()
    srv = start(tmp_path / "read-only", path, cache)
    read_only(srv, cache / "gguf")
    with srv:
        assert answer(srv) == text
        warnings = damage_warnings(srv)
    assert file.read_bytes() == before  # left as it was, never served
    assert warnings, srv.log_tail()
    for w in warnings:  # the master's, then each worker's: each dequantizes for itself
        assert w["level"] == "WARNING"
        assert w["message"].startswith(f"{file}: weights cache damaged (content digest ")
        assert f"cannot be rebuilt ({cache / 'gguf'}: Read-only file system" in w["message"] or (
            "Permission denied" in w["message"]
        )
        assert w["message"].endswith("packing in memory, each worker its own copy")
