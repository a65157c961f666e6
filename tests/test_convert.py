"""`python -m model.convert llama2c`: synthetic llama2.c checkpoints converted and run against a
line-by-line numpy port of run.c's forward pass (adjacent-pair RoPE), plus every input error."""

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from model.llama.formats.convert import main
from model.llama.formats.llama2c import permute_rotary, read_checkpoint
from model.loader import load_model

DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ_LEN = 16, 24, 2, 4, 2, 8
HS = DIM // HEADS
PIECES = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
PIECES += [b" ", b"a", b" a"]
VOCAB = len(PIECES)  # 262


def make_weights(seed: int, shared: bool) -> dict[str, np.ndarray]:
    """llama2.c's arrays, in file order, drawn from an explicit generator."""
    rng = np.random.default_rng(seed)
    kv_dim = KV_HEADS * HS
    shapes = {
        "token_embedding": (VOCAB, DIM),
        "rms_att": (LAYERS, DIM),
        "wq": (LAYERS, DIM, DIM),
        "wk": (LAYERS, kv_dim, DIM),
        "wv": (LAYERS, kv_dim, DIM),
        "wo": (LAYERS, DIM, DIM),
        "rms_ffn": (LAYERS, DIM),
        "w1": (LAYERS, HIDDEN, DIM),
        "w2": (LAYERS, DIM, HIDDEN),
        "w3": (LAYERS, HIDDEN, DIM),
        "rms_final": (DIM,),
        "freq_cis_real": (SEQ_LEN, HS // 2),
        "freq_cis_imag": (SEQ_LEN, HS // 2),
    }
    if not shared:
        shapes["wcls"] = (VOCAB, DIM)
    out = {}
    for name, shape in shapes.items():
        scale = 0.2 if name.startswith("rms") else 1.0 / math.sqrt(shape[-1])
        base = 1.0 if name.startswith("rms") else 0.0
        out[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_llama2c(
    directory: Path, weights: dict[str, np.ndarray], shared: bool
) -> tuple[Path, Path]:
    vocab_field = VOCAB if shared else -VOCAB
    header = struct.pack("<7i", DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, vocab_field, SEQ_LEN)
    ckpt = directory / "model.bin"
    ckpt.write_bytes(header + b"".join(w.astype("<f4").tobytes() for w in weights.values()))
    tok = directory / "tok.bin"
    tok.write_bytes(tokenizer_bin(PIECES, [0.0] * 259 + [-1.0, -2.0, 5.0]))
    return ckpt, tok


def tokenizer_bin(pieces: list[bytes], scores: list[float]) -> bytes:
    body = b"".join(struct.pack("<fI", s, len(p)) + p for p, s in zip(pieces, scores, strict=True))
    return struct.pack("<I", max(map(len, pieces))) + body


def runc_logits(w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """run.c `forward`, one position at a time, in float64: the independent reference."""
    kv_dim, kv_mul = KV_HEADS * HS, HEADS // KV_HEADS
    wcls = w.get("wcls", w["token_embedding"]).astype(np.float64)

    def rmsnorm(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x) + 1e-5))

    k_cache = np.zeros((LAYERS, SEQ_LEN, kv_dim))
    v_cache = np.zeros((LAYERS, SEQ_LEN, kv_dim))
    out = []
    for pos, token in enumerate(tokens):
        x = w["token_embedding"][token].astype(np.float64)
        for layer in range(LAYERS):
            xb = rmsnorm(x, w["rms_att"][layer])
            q, k, v = w["wq"][layer] @ xb, w["wk"][layer] @ xb, w["wv"][layer] @ xb
            for i in range(0, DIM, 2):  # adjacent pairs (x[i], x[i+1]) within each head
                freq = 1.0 / 10000.0 ** ((i % HS) / HS)
                fcr, fci = math.cos(pos * freq), math.sin(pos * freq)
                for vec in (q, k) if i < kv_dim else (q,):
                    v0, v1 = vec[i], vec[i + 1]
                    vec[i], vec[i + 1] = v0 * fcr - v1 * fci, v0 * fci + v1 * fcr
            k_cache[layer, pos], v_cache[layer, pos] = k, v
            att_out = np.zeros(DIM)
            for h in range(HEADS):
                kv = (h // kv_mul) * HS
                qh = q[h * HS : (h + 1) * HS]
                scores = k_cache[layer, : pos + 1, kv : kv + HS] @ qh / math.sqrt(HS)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                att_out[h * HS : (h + 1) * HS] = p @ v_cache[layer, : pos + 1, kv : kv + HS]
            x = x + w["wo"][layer] @ att_out
            xb = rmsnorm(x, w["rms_ffn"][layer])
            hb = w["w1"][layer] @ xb
            x = x + w["w2"][layer] @ (hb / (1 + np.exp(-hb)) * (w["w3"][layer] @ xb))
        out.append(wcls @ rmsnorm(x, w["rms_final"]))
    return np.array(out)


@pytest.mark.parametrize("shared", [True, False])
def test_converted_model_matches_runc_forward(tmp_path: Path, shared: bool, capsys) -> None:
    weights = make_weights(seed=3, shared=shared)
    ckpt, tok = write_llama2c(tmp_path, weights, shared)
    out = tmp_path / "hf"
    assert (
        main(["llama2c", "--checkpoint", str(ckpt), "--tokenizer", str(tok), "--out", str(out)])
        == 0
    )
    assert capsys.readouterr().out == f"wrote {out}\n"
    lm = load_model(out)
    tokens = [1, 261, 4, 200, 259, 260, 7, 1]
    got = lm.model.prompt_logits(tokens, lm.model.new_cache())
    np.testing.assert_allclose(got, runc_logits(weights, tokens), rtol=0, atol=1e-4)
    assert lm.model.config.tie_embeddings is shared
    assert lm.tokenizer.eos_ids == frozenset({1, 2}) and lm.tokenizer.bos_id == 1
    assert lm.tokenizer.encode("a a") == [1, 261, 261]  # " a" (score 5) merges first
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (
        16,
        2,
        262,
    )
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": [2, 1]}


def test_permute_rotary_moves_pair_members_to_the_two_halves() -> None:
    w = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of head_dim 4
    assert permute_rotary(w, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def convert_error(tmp_path: Path, ckpt: bytes, tok: bytes, capsys) -> str:
    (tmp_path / "c.bin").write_bytes(ckpt)
    (tmp_path / "t.bin").write_bytes(tok)
    argv = [
        "llama2c",
        "--checkpoint",
        str(tmp_path / "c.bin"),
        "--tokenizer",
        str(tmp_path / "t.bin"),
    ]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_checkpoint_errors(tmp_path: Path, capsys) -> None:
    ckpt, tok = write_llama2c(tmp_path, make_weights(1, True), True)
    good, tok_bytes = ckpt.read_bytes(), tok.read_bytes()
    err = convert_error(tmp_path, good[:-4], tok_bytes, capsys)
    assert (
        err
        == f"convert: checkpoint: the header implies {len(good)} bytes, the file has {len(good) - 4}\n"
    )
    err = convert_error(tmp_path, struct.pack("<I", 0x616B3432) + good[4:], tok_bytes, capsys)
    assert "versioned llama2.c format (magic 'ak42') is not supported" in err
    err = convert_error(tmp_path, struct.pack("<7i", 16, 24, 2, 4, 3, 262, 8), tok_bytes, capsys)
    assert "do not give an even head size shared by whole groups of heads" in err
    err = convert_error(tmp_path, struct.pack("<7i", 16, 0, 2, 4, 2, 262, 8), tok_bytes, capsys)
    assert "header field hidden_dim must be positive, got 0" in err
    with pytest.raises(ValueError, match="shorter than the 28-byte header"):
        read_checkpoint(b"\x00" * 27)


def test_tokenizer_errors(tmp_path: Path, capsys) -> None:
    ckpt, _ = write_llama2c(tmp_path, make_weights(1, True), True)
    good = ckpt.read_bytes()
    scores = [0.0] * VOCAB
    err = convert_error(tmp_path, good, tokenizer_bin(PIECES[:-1], scores[:-1]), capsys)
    assert "tokenizer: holds 261 tokens, the checkpoint has 262" in err
    err = convert_error(tmp_path, good, tokenizer_bin(PIECES, scores)[:-1], capsys)
    assert "tokenizer: token 261 runs past the end of the file" in err
    bad = [PIECES[0], b"<s>", *PIECES[2:]]
    err = convert_error(tmp_path, good, tokenizer_bin(bad, scores), capsys)
    assert "tokenizer: token 1 must be b'\\n<s>\\n', got b'<s>'" in err
    bad = [*PIECES[:-1], b"\xff"]
    err = convert_error(tmp_path, good, tokenizer_bin(bad, scores), capsys)
    assert "tokenizer: token 261 is not UTF-8" in err
    bad = [*PIECES[:-1], b"a"]
    err = convert_error(tmp_path, good, tokenizer_bin(bad, scores), capsys)
    assert "tokenizer: token 261 repeats token 260 ('a')" in err
