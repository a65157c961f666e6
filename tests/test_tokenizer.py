"""ByteTokenizer and HFTokenizer: encode, per-token bytes for incremental detokenization
(SentencePiece "▁" and <0xNN> pieces, GPT-2 byte-level pieces), token_str for logprobs."""

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from model.tokenizer import ByteTokenizer, HFTokenizer, bytes_display, decode_ids
from model.utf8 import Utf8Decoder
from tests.llamafiles import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return HFTokenizer.from_file(path, bos_id=1, eos_ids=frozenset({2}))


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    assert tok.encode("aé") == [0x61, 0xC3, 0xA9]
    assert tok.token_bytes[0xC3] == b"\xc3" and len(tok.token_bytes) == tok.vocab_size == 256
    assert (tok.token_str(0x61), tok.token_str(0xC3)) == ("a", "bytes:\\xc3")
    assert tok.bos_id is None and tok.eos_ids == frozenset()


def test_sentencepiece_pieces_become_bytes(tiny_tok: HFTokenizer) -> None:
    # ids: 0..2 specials, 3..258 <0x00>..<0xFF>, 259 " ", 260.. "a".."z", 286 " t", 287 "he", 288 " the"
    assert tiny_tok.vocab_size == 300 and len(tiny_tok.token_bytes) == 300
    assert tiny_tok.token_bytes[:3] == [b"", b"", b""]
    assert tiny_tok.token_bytes[3 + 0xE2] == b"\xe2"
    assert tiny_tok.token_bytes[259] == b" "
    assert tiny_tok.token_bytes[288] == b" the"
    assert [tiny_tok.token_str(i) for i in (1, 259, 288, 3 + 0xE2, 3 + 0x41)] == [
        "<s>",
        " ",
        " the",
        "bytes:\\xe2",
        "A",
    ]


def test_encode_adds_bos_and_the_dummy_prefix(tiny_tok: HFTokenizer) -> None:
    assert tiny_tok.encode("the") == [1, 288]
    assert tiny_tok.encode("") == [1]
    # "Q" is not a piece: byte fallback; "<s>" in the text is text, not BOS
    assert tiny_tok.encode("Q<s>") == [1, 259, 3 + ord("Q"), 3 + ord("<"), 278, 3 + ord(">")]


def test_incremental_detokenization_keeps_the_leading_space_and_whole_characters(
    tiny_tok: HFTokenizer,
) -> None:
    ids = tiny_tok.encode("the ☃ ok")[1:]
    decoder = Utf8Decoder()
    chunks = [decoder.feed(tiny_tok.token_bytes[i]) for i in ids]
    assert chunks == [" the", " ", "", "", "☃", " ", "o", "k"]
    assert decode_ids(tiny_tok, ids) == " the ☃ ok"


def test_byte_level_pieces_become_bytes() -> None:
    table = dict(enumerate(["Ā", "ā", "Ă"]))  # bytes 0, 1, 2 in GPT-2's printable map
    vocab = {"Ġ": 0, "h": 1, "i": 2, "Ġh": 3, "Ã": 4, "©": 5, "Ã©": 6, table[0]: 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "h"), ("Ã", "©")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<tool>", special=False)])
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    hf = HFTokenizer(tok, bos_id=None, eos_ids=frozenset({9}), vocab_size=12)
    assert hf.token_bytes == [b" ", b"h", b"i", b" h", b"\xc3", b"\xa9", b"\xc3\xa9", b"\x00",
                              b"<tool>", b"", b"", b""]  # fmt: skip
    assert hf.encode(" hié") == [3, 2, 6]  # no post-processor: no BOS
    assert hf.token_str(9) == "<|end|>" and hf.token_str(4) == "bytes:\\xc3"


def test_unsupported_decoder_is_refused() -> None:
    tok = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match=r"unsupported decoder types \['WordPiece'\]"):
        HFTokenizer(tok, bos_id=None, eos_ids=frozenset())


def test_bytes_display() -> None:
    assert bytes_display(b" caf\xc3\xa9") == " café"
    assert bytes_display(b"\xe2\x98") == "bytes:\\xe2\\x98"


def test_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json", None, frozenset())
