"""The packed-weights cache file of a GGUF: reused, keyed by the GGUF's SHA-256, written atomically.

Source: POSIX ``rename(2)``; the XDG Base Directory Specification.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from model.llama.formats.gguf import GGUFModel
from model.llama.formats.gguf_cache import FORMAT_VERSION, cache_path, default_cache_dir
from model.loader import load_model
from tests.gguffiles import write_tiny_gguf
from tests.server import ROOT


@pytest.fixture
def count_dequantize(monkeypatch):
    """Count builds of the cache (``GGUFModel.pack``: once per build, never when mapped)."""
    calls = []
    real = GGUFModel.pack

    def counting(self):
        calls.append(self.path)
        return real(self)

    monkeypatch.setattr(GGUFModel, "pack", counting)
    return calls


def test_second_load_maps_the_cache_without_dequantizing(tmp_path, count_dequantize):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    first = load_model(path, cache_dir=tmp_path / "cache")
    built = len(count_dequantize)
    assert built == 1  # packed once
    cached = cache_path(tmp_path / "cache", first.checksum)
    assert cached.name == f"{first.checksum}.v{FORMAT_VERSION}.safetensors"
    before = cached.stat()
    second = load_model(path, cache_dir=tmp_path / "cache")
    assert len(count_dequantize) == built  # nothing dequantized again
    after = cached.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    np.testing.assert_array_equal(
        second.model.layers[0].wq.dequantize(), first.model.layers[0].wq.dequantize()
    )


def test_a_changed_gguf_gets_its_own_cache_file(tmp_path, count_dequantize):
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=1)
    old = load_model(path, cache_dir=tmp_path / "cache")
    write_tiny_gguf(path, seed=2)  # same name, other weights
    new = load_model(path, cache_dir=tmp_path / "cache")
    assert new.checksum != old.checksum
    assert len(count_dequantize) == 2  # built twice
    assert not np.array_equal(
        new.model.layers[0].wq.dequantize(), old.model.layers[0].wq.dequantize()
    )
    files = sorted(p.name for p in (tmp_path / "cache" / "gguf").glob("*.safetensors"))
    assert files == sorted(f"{m.checksum}.v{FORMAT_VERSION}.safetensors" for m in (old, new))


def test_partial_files_are_never_loaded(tmp_path, count_dequantize):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    sha = load_model(path, cache_dir=tmp_path / "first").checksum
    final = cache_path(tmp_path / "cache", sha)
    final.parent.mkdir(parents=True)
    # What a crash mid-write leaves: a temporary file beside the final name, never renamed.
    good = cache_path(tmp_path / "first", sha).read_bytes()
    leftover = final.with_name(f".{final.name}.crash.tmp")
    leftover.write_bytes(good[: len(good) // 2])
    load_model(path, cache_dir=tmp_path / "cache")
    assert len(count_dequantize) == 2  # rebuilt, the leftover ignored
    assert_same_tensors(final, cache_path(tmp_path / "first", sha))
    # A damaged file under the final name (e.g. written by hand) is rebuilt, not served.
    final.write_bytes(good[: len(good) // 2])
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    assert len(count_dequantize) == 3
    assert_same_tensors(final, cache_path(tmp_path / "first", sha))
    assert loaded.model.layers[0].wq.shape == (256, 256)


def assert_same_tensors(a: Path, b: Path) -> None:
    """Assert two safetensors files hold the same tensors (headers may order keys differently)."""
    ta, tb = safetensors.numpy.load_file(a), safetensors.numpy.load_file(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name])


def test_no_temporary_file_is_left_behind(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    sha = load_model(path, cache_dir=tmp_path / "cache").checksum
    names = sorted(os.listdir(tmp_path / "cache" / "gguf"))
    final = cache_path(tmp_path / "cache", sha).name
    assert names == [final, final + ".lock"]


def test_cache_dir_defaults(tmp_path):
    assert default_cache_dir({"GREENSERVE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/greenserve")
    home = Path.home() / ".cache" / "greenserve"
    assert default_cache_dir({"XDG_CACHE_HOME": "relative"}) == home  # the spec ignores it
    assert default_cache_dir({}) == home


CRASH_MID_WRITE = """
import os, sys
import safetensors.numpy
from model.loader import load_model

def dies(tensors, filename, metadata=None):
    with open(os.path.join(os.path.dirname(filename), ".tmpAbC123"), "wb") as f:
        f.write(b"half a file")  # where safetensors keeps its own temporary file
    os._exit(3)  # killed mid-write: no finally runs

safetensors.numpy.save_file = dies
load_model(sys.argv[1], cache_dir=sys.argv[2])
"""


def test_a_build_killed_mid_write_leaves_garbage_the_next_build_removes(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_MID_WRITE, str(path), str(cache)], cwd=ROOT, timeout=60
    )
    assert crashed.returncode == 3
    gguf_dir = cache / "gguf"
    legacy = gguf_dir / ".x.v1.safetensors.k2j3.tmp"  # the older builder's temporary name
    legacy.write_bytes(b"")
    left = sorted(p.relative_to(gguf_dir).as_posix() for p in gguf_dir.rglob("*"))
    assert len(left) == 4 and left[0].startswith(".build-") and left[1].endswith("/.tmpAbC123")
    model = load_model(path, cache_dir=cache)
    final = cache_path(cache, model.checksum)
    assert sorted(gguf_dir.iterdir()) == [final, final.with_name(final.name + ".lock")]
