"""The tokenizer a GGUF describes gives llama.cpp's ids.

``gpt2`` (byte-level BPE, pre-tokenizer ``smollm``): the SmolLM2 file against what llama.cpp
itself produced (``../shared/data/smollm2``). ``llama`` (SentencePiece): a GGUF written here from
stories260K must tokenize and generate exactly as the converted llama2.c directory.

Source: llama.cpp ``src/llama-vocab.cpp``; the GGUF specification (``tokenizer.ggml.*``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from model.llama.formats.llama2c import (
    BOS_ID,
    EOS_ID,
    SPECIAL_PIECES,
    read_checkpoint,
    read_tokenizer,
)
from model.loader import load_model
from model.tokenizer import decode_ids
from tests.decoding import greedy_by_hand
from tests.gguffiles import golden, teacher_forced, write_tiny_gguf
from tests.llamafiles import stories_or_skip


def test_ids_equal_llama_cpp(smollm2_data, smollm2):
    # One test over the reference's cases: they are read when the test runs, never at collection.
    cases = golden()["tokenize"] + teacher_forced()["tokenize"]
    tok = smollm2.tokenizer
    wrong = [(c["text"], tok.encode(c["text"])) for c in cases if tok.encode(c["text"]) != c["ids"]]
    wrong += [
        (c["ids"], decode_ids(tok, c["ids"]))
        for c in cases
        if decode_ids(tok, c["ids"]) != c["text"]
    ]
    assert wrong == []  # (text, our ids) or (llama.cpp's ids, our text)
    assert len(cases) == 9


def test_prompt_ids_equal_llama_cpp(smollm2_data, smollm2):
    tok = smollm2.tokenizer
    reference = golden()
    for case in reference["completions"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
    assert tok.encode(reference["logits"]["prompt"]) == reference["logits"]["prompt_ids"]
    # The chat prompt is rendered by the server: its ChatML markers are special tokens.
    chat = reference["chat"][0]
    assert tok.encode(chat["formatted_prompt"], special=True) == chat["prompt_ids"]


def test_special_tokens_only_when_allowed(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>user", special=True) == [1, 4093]
    typed = tok.encode("<|im_start|>user")  # a user typing the marker gets plain text
    assert 1 not in typed and decode_ids(tok, typed) == "<|im_start|>user"
    assert tok.token_bytes[1] == tok.token_bytes[2] == b""  # control tokens are never text
    assert tok.token_str(2) == "<|im_end|>"
    assert tok.bos_id is None  # tokenizer.ggml.add_bos_token is false for SmolLM2


def test_end_of_generation_ids_as_llama_cpp_computes_them(smollm2):
    # eos 2 <|im_end|>; <|endoftext|> (0) by its text; <reponame> (4) as the fill-in-the-middle
    # repository token llama.cpp recognises by text (Granite's spelling).
    assert smollm2.tokenizer.eos_ids == frozenset({0, 2, 4})


def random_text(rng: random.Random) -> str:
    """Return text mixing emoji, combining marks, CJK, control bytes, digits, spaces."""
    pools = [
        "abc XYZ 0123456789 .,;:!?'\"-_",
        "\U0001f600\U0001f680\U0001f468\u200d\U0001f469\u2764\ufe0f",
        "e\u0301a\u0308o\u0327\u0300",
        "\u4e2d\u6587\u5b57\u65e5\u672c\u8a9e\ud55c\uad6d\uc5b4",
        "\x00\x01\x07\x1b\x7f\t\r\n\x0b\x0c",
        "     \u00a0\u2003",
        "\u00e9\u00df\u0416\u05d0\u0627\u0e01",
    ]
    parts = []
    for _ in range(rng.randint(1, 12)):
        pool = rng.choice(pools)
        parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
    text = "".join(parts)
    return " " * rng.randint(0, 3) + text


def test_round_trip_of_random_unicode(smollm2):
    tok = smollm2.tokenizer
    rng = random.Random(16)
    for _ in range(300):
        text = random_text(rng)
        assert decode_ids(tok, tok.encode(text)) == text, repr(text)


# --- SentencePiece ("llama") from stories260K ----------------------------------------------------


def interleave_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the rotate-half permutation: rows ``i`` and ``i + hd/2`` of a head become ``2i, 2i+1``."""
    out_dim, in_dim = w.shape
    half = out_dim // n_heads // 2
    # (n_heads, 2, half, in) -> (n_heads, half, 2, in)
    return w.reshape(n_heads, 2, half, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)


def write_stories_gguf(path: Path) -> Path:
    """Write stories260K (weights and tok512 vocabulary) as a llama GGUF, as llama.cpp would."""
    src = stories_or_skip()
    ckpt = read_checkpoint((src / "stories260K.bin").read_bytes())
    pieces, scores = read_tokenizer((src / "tok512.bin").read_bytes(), ckpt.vocab_size)
    tokens, types = [], []
    for i, piece in enumerate(pieces):
        if i in SPECIAL_PIECES:
            tokens.append(SPECIAL_PIECES[i][1])
            types.append(2 if i == 0 else 3)  # UNKNOWN, CONTROL
        elif piece.startswith(b"<0x") and len(piece) == 6:
            tokens.append(piece.decode())
            types.append(6)  # BYTE
        else:
            tokens.append(piece.decode("utf-8").replace(" ", "\u2581"))
            types.append(1)
    t = ckpt.tensors
    tensors = {"token_embd.weight": t["model.embed_tokens.weight"]}
    for i in range(ckpt.n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        tensors[p + "attn_norm.weight"] = t[h + "input_layernorm.weight"]
        tensors[p + "attn_q.weight"] = interleave_rotary(
            t[h + "self_attn.q_proj.weight"], ckpt.n_heads
        )
        tensors[p + "attn_k.weight"] = interleave_rotary(
            t[h + "self_attn.k_proj.weight"], ckpt.n_kv_heads
        )
        tensors[p + "attn_v.weight"] = t[h + "self_attn.v_proj.weight"]
        tensors[p + "attn_output.weight"] = t[h + "self_attn.o_proj.weight"]
        tensors[p + "ffn_norm.weight"] = t[h + "post_attention_layernorm.weight"]
        tensors[p + "ffn_gate.weight"] = t[h + "mlp.gate_proj.weight"]
        tensors[p + "ffn_down.weight"] = t[h + "mlp.down_proj.weight"]
        tensors[p + "ffn_up.weight"] = t[h + "mlp.up_proj.weight"]
    tensors["output_norm.weight"] = t["model.norm.weight"]

    def tokenizer(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)

    dims = {
        "dim": ckpt.dim,
        "hidden_dim": ckpt.hidden_dim,
        "n_layers": ckpt.n_layers,
        "n_heads": ckpt.n_heads,
        "n_kv_heads": ckpt.n_kv_heads,
    }
    return write_tiny_gguf(path, tensors, dims=dims, tokenizer=tokenizer, metadata=None)


@pytest.fixture(scope="module")
def stories_pair(stories_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stories-gguf")
    from_gguf = load_model(write_stories_gguf(tmp / "stories260K.gguf"), cache_dir=tmp / "cache")
    return from_gguf, load_model(stories_dir)


SPM_TEXTS = [
    "Once upon a time",
    "",
    " two  spaces and\nnewlines\n\n",
    'Lily\'s dog said: "Hi!" 123',
    "h\u00e9llo w\u00f6rld \U0001f600 \u4e2d\u6587",
    "<s> and </s> typed as text",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_tokenizes_as_llama2c(stories_pair, text):
    from_gguf, llama2c = stories_pair
    assert from_gguf.tokenizer.encode(text) == llama2c.tokenizer.encode(text)
    assert from_gguf.tokenizer.token_bytes == llama2c.tokenizer.token_bytes


def test_sentencepiece_gguf_generates_as_llama2c(stories_pair):
    from_gguf, llama2c = stories_pair
    ids = from_gguf.tokenizer.encode("Once upon a time")
    runs = [greedy_by_hand(loaded.model, ids, 48) for loaded in (from_gguf, llama2c)]
    assert runs[0] == runs[1]
    np.testing.assert_array_equal(
        from_gguf.model.layers[0].wq.dequantize(), llama2c.model.layers[0].wq.dequantize()
    )  # the rotary permutation undone exactly
