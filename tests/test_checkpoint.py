"""Checkpoint loading: the "succ" model's worked example, every rejection rule, the packaged model."""

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest

from model.bigram.checkpoint import load_bigram_weight, load_config
from model.bigram.model import Bigram, default_model_dir
from model.files import file_sha256
from tests.modelfiles import (
    BIGRAM_CONFIG,
    succ_weight,
    write_model_dir,
    write_safetensors_raw,
    write_succ_model,
)

REPO = Path(__file__).resolve().parent.parent
W_BYTES = 256 * 256 * 4
SUCC_HEADER = (
    b'{"__metadata__":{"format":"tinyllm"},'
    b'"bigram.weight":{"dtype":"F32","shape":[256,256],"data_offsets":[0,262144]}}'
)


def entry(dtype="F32", shape=(256, 256), begin=0, end=W_BYTES) -> dict:
    """Build one tensor entry of a safetensors header."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


# --- the worked example -------------------------------------------------------------------------


def test_succ_file_matches_the_worked_example(tmp_path):
    raw = (write_succ_model(tmp_path) / "model.safetensors").read_bytes()
    assert len(SUCC_HEADER) == 113
    assert struct.unpack("<Q", raw[:8]) == (120,)
    assert raw[8:121] == SUCC_HEADER
    assert raw[121:128] == b" " * 7
    assert len(raw) == 128 + W_BYTES
    assert 256 * 97 + 98 == 24930 and 24930 * 4 == 99720
    assert raw[99848:99852] == bytes.fromhex("00000040")
    # The classic bug reads at the data offset as if it were a file offset: a zero there.
    assert raw[99720:99724] == bytes(4)


def test_raw_writer_reproduces_the_safetensors_writer(tmp_path):
    write_succ_model(tmp_path / "lib")
    header = {"__metadata__": {"format": "tinyllm"}, "bigram.weight": entry()}
    write_safetensors_raw(
        tmp_path / "raw.safetensors", header, succ_weight().astype("<f4").tobytes()
    )
    lib = (tmp_path / "lib" / "model.safetensors").read_bytes()
    assert (tmp_path / "raw.safetensors").read_bytes() == lib


def test_succ_model_loads_with_the_right_values(tmp_path):
    model_dir = write_succ_model(tmp_path)
    model = Bigram.load(model_dir)
    assert model.weight[97][98] == np.float32(2.0)
    assert model.weight.shape == (256, 256) and model.weight.dtype == np.float32
    assert model.weight.flags["C_CONTIGUOUS"]
    assert np.count_nonzero(model.weight) == 256
    assert model.vocab_size == 256
    assert model.config == dict(BIGRAM_CONFIG)
    assert model.model_dir == model_dir
    raw = (model_dir / "model.safetensors").read_bytes()
    assert model.checksum == hashlib.sha256(raw).hexdigest()
    assert model.checksum == file_sha256(model_dir / "model.safetensors")


def test_logits_is_the_row_and_the_one_hot_product_bit_for_bit(tmp_path):
    model = Bigram.load(write_succ_model(tmp_path))
    row = model.logits(97)
    assert row.shape == (256,) and row.dtype == np.float32
    assert np.shares_memory(row, model.weight)
    one_hot = np.zeros((1, 256), dtype=np.float32)
    one_hot[0, 97] = 1.0
    assert row.tobytes() == model.weight[97].tobytes()
    assert row.tobytes() == (one_hot @ model.weight)[0].tobytes()
    assert int(np.argmax(row)) == 98
    assert int(np.argmax(model.logits(255))) == 0
    assert int(np.argmax(model.logits(np.uint8(97)))) == 98


@pytest.mark.parametrize("prev", [-1, 256, 1000])
def test_logits_refuses_ids_outside_the_vocabulary(tmp_path, prev):
    model = Bigram.load(write_succ_model(tmp_path))
    with pytest.raises(IndexError, match=f"token id {prev} is outside 0..255"):
        model.logits(prev)


def test_weights_are_read_only(tmp_path):
    model = Bigram.load(write_succ_model(tmp_path))
    with pytest.raises(ValueError, match="read-only"):
        model.logits(97)[0] = 1.0


# --- rejected safetensors files -----------------------------------------------------------------

DUPLICATE = (
    '{"bigram.weight":{"dtype":"F32","shape":[256,256],"data_offsets":[0,262144]},'
    '"bigram.weight":{"dtype":"F32","shape":[256,256],"data_offsets":[0,262144]}}'
)
FULL = bytes(W_BYTES)
BAD_FILES = [
    pytest.param(
        {"bigram.weight": entry("F16", end=W_BYTES // 2)},
        FULL[: W_BYTES // 2],
        {},
        ["'bigram.weight'", "dtype must be 'F32', got 'F16'"],
        id="f16",
    ),
    pytest.param(
        {"bigram.weight": entry(shape=(256, 255), end=256 * 255 * 4)},
        FULL[: 256 * 255 * 4],
        {},
        ["'bigram.weight'", "shape must be [256, 256], got [256, 255]"],
        id="wrong_shape",
    ),
    pytest.param(
        {"bigram.weight": entry(shape=(65536,))},
        FULL,
        {},
        ["'bigram.weight'", "shape must be [256, 256], got [65536]"],
        id="rank_1_shape",
    ),
    pytest.param(
        {"bigram.weight": entry(shape=(256.0, 256))},
        FULL,
        {},
        ["'bigram.weight'", "shape must be a list of non-negative integers"],
        id="float_shape",
    ),
    pytest.param(
        {"bigram.weight": entry()},
        FULL[:-4],
        {},
        ["'bigram.weight' ends at 262144", "data buffer is 262140 bytes", "short data"],
        id="short_data",
    ),
    pytest.param(
        {"bigram.weight": entry()},
        FULL + bytes(4),
        {},
        ["4 trailing bytes after tensor 'bigram.weight'"],
        id="trailing_data",
    ),
    pytest.param(
        {"bigram.weight": entry(), "extra": entry(shape=(1,), begin=W_BYTES + 4, end=W_BYTES + 8)},
        FULL + bytes(8),
        {},
        ["gap of 4 bytes", "after tensor 'bigram.weight'", "before tensor 'extra'"],
        id="gap",
    ),
    pytest.param(
        {"bigram.weight": entry(begin=8, end=W_BYTES + 8)},
        bytes(W_BYTES + 8),
        {},
        ["gap of 8 bytes", "at the start", "before tensor 'bigram.weight'"],
        id="gap_at_start",
    ),
    pytest.param(
        {"bigram.weight": entry(), "extra": entry(shape=(1,), begin=W_BYTES - 4, end=W_BYTES)},
        FULL,
        {},
        ["tensor 'extra' at data offset 262140 overlaps tensor 'bigram.weight'"],
        id="overlap",
    ),
    pytest.param(DUPLICATE, FULL, {}, ["duplicate name 'bigram.weight'"], id="duplicate_name"),
    pytest.param(
        {"bigram.weight": entry()},
        FULL,
        {"header_len": 120 + W_BYTES},
        ["header length N=262264 runs past the end of the file"],
        id="header_past_eof",
    ),
    pytest.param(
        {"bigram.weight": entry()},
        FULL,
        {"header_len": 2**64 - 1},
        [f"header length N={2**64 - 1} runs past the end"],
        id="header_len_huge",
    ),
    pytest.param(
        {"bigram.weight": entry()},
        FULL,
        {"header_len": 1},
        ["header length N=1 is too small"],
        id="header_len_too_small",
    ),
    pytest.param(
        {"other.weight": entry()}, FULL, {}, ["missing tensor 'bigram.weight'"], id="missing_tensor"
    ),
    pytest.param(
        {"__metadata__": {"format": 1}, "bigram.weight": entry()},
        FULL,
        {},
        ["__metadata__['format'] must be a string, got int"],
        id="metadata_not_str",
    ),
    pytest.param(
        {"__metadata__": ["format"], "bigram.weight": entry()},
        FULL,
        {},
        ["__metadata__ must be an object, got list"],
        id="metadata_not_map",
    ),
    pytest.param(
        {"bigram.weight": entry(begin=W_BYTES, end=0)},
        FULL,
        {},
        ["'bigram.weight'", "data_offsets must be [begin, end]"],
        id="offsets_reversed",
    ),
    pytest.param(
        {"bigram.weight": entry(begin=False)},
        FULL,
        {},
        ["'bigram.weight'", "data_offsets must be [begin, end]"],
        id="offsets_bool",
    ),
    pytest.param(
        {"bigram.weight": entry(end=W_BYTES - 4)},
        FULL[:-4],
        {},
        ["'bigram.weight'", "span 262140 bytes but F32 shape [256, 256] needs 262144"],
        id="offsets_size",
    ),
    pytest.param(
        {"bigram.weight": {"dtype": "F32", "shape": [256, 256]}},
        FULL,
        {},
        ["'bigram.weight'", "missing field 'data_offsets'"],
        id="missing_field",
    ),
    pytest.param(
        {"bigram.weight": [0, 262144]},
        FULL,
        {},
        ["'bigram.weight'", "entry must be an object, got list"],
        id="entry_not_object",
    ),
    pytest.param("{not json", FULL, {}, ["header is not valid UTF-8 JSON"], id="header_not_json"),
    pytest.param(b'{"\xff":1}', FULL, {}, ["header is not valid UTF-8 JSON"], id="header_not_utf8"),
    pytest.param(
        "[]", FULL, {}, ["header must be a JSON object, got list"], id="header_not_object"
    ),
    pytest.param(
        "[" * 100_000 + "]" * 100_000, FULL, {}, ["nested too deeply"], id="header_too_deep"
    ),
]


@pytest.mark.parametrize(("header", "data", "kwargs", "fragments"), BAD_FILES)
def test_malformed_safetensors_is_refused_naming_the_file_and_field(
    tmp_path, header, data, kwargs, fragments
):
    path = tmp_path / "model.safetensors"
    write_safetensors_raw(path, header, data, **kwargs)
    with pytest.raises(ValueError) as info:
        load_bigram_weight(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message


def test_file_shorter_than_the_length_prefix_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x02\x00\x00")
    with pytest.raises(ValueError, match="header length: file is only 3 bytes"):
        load_bigram_weight(path)


def test_extra_well_formed_tensor_is_allowed(tmp_path):
    path = tmp_path / "model.safetensors"
    header = {"bigram.weight": entry(), "extra": entry(shape=(2,), begin=W_BYTES, end=W_BYTES + 8)}
    write_safetensors_raw(path, header, succ_weight().tobytes() + bytes(8), pad_to=None)
    assert load_bigram_weight(path).tobytes() == succ_weight().tobytes()


def test_missing_weights_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read weights"):
        load_bigram_weight(tmp_path / "model.safetensors")


# --- config.json --------------------------------------------------------------------------------


def bad_config(**changes) -> dict:
    """Return the valid bigram config with fields changed (None removes the field)."""
    config = dict(BIGRAM_CONFIG)
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    return config


BAD_CONFIGS = {
    "llama": (bad_config(tl_arch="llama"), "tl_arch must be 'bigram', got 'llama'"),
    "no_tokenizer": (bad_config(tl_tokenizer=None), "tl_tokenizer must be 'bytes', got None"),
    "vocab_512": (bad_config(vocab_size=512), "vocab_size must be 256, got 512"),
    "vocab_float": (bad_config(vocab_size=256.0), "vocab_size must be 256, got 256.0"),
    "vocab_str": (bad_config(vocab_size="256"), "vocab_size must be 256, got '256'"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_bad_config_is_refused_naming_the_field(tmp_path, case):
    config, fragment = BAD_CONFIGS[case]
    model_dir = write_model_dir(tmp_path, succ_weight(), config=config)
    for load in (load_config, Bigram.load):
        with pytest.raises(ValueError) as info:
            load(model_dir)
        assert str(info.value) == f"{model_dir / 'config.json'}: {fragment}"


def test_config_keeps_extra_keys(tmp_path):
    config = {**BIGRAM_CONFIG, "trained_on": ["a.txt"], "smoothing_k": 0.5}
    assert load_config(write_model_dir(tmp_path, succ_weight(), config=config)) == config


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{", "not valid JSON"), ("[1]", "must be a JSON object, got list"), (None, "cannot read")],
)
def test_unreadable_config_is_a_value_error(tmp_path, text, fragment):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=fragment) as info:
        load_config(tmp_path)
    assert "config.json" in str(info.value)


def test_bigram_load_names_the_weights_file(tmp_path):
    model_dir = write_model_dir(tmp_path, np.zeros((256, 255), dtype=np.float32))
    with pytest.raises(ValueError) as info:
        Bigram.load(model_dir)
    assert str(info.value).startswith(f"{model_dir / 'model.safetensors'}: tensor 'bigram.weight'")


# --- the packaged default model -----------------------------------------------------------------


def test_default_model_loads_with_its_checksum():
    model = Bigram.load()
    weights = default_model_dir() / "model.safetensors"
    assert model.model_dir == default_model_dir() == REPO / "model" / "bigram" / "default"
    assert model.checksum == file_sha256(weights)
    assert model.checksum in (default_model_dir() / "README.md").read_text()
    assert weights.stat().st_size == 262280
    assert model.config["tl_arch"] == "bigram" and model.config["smoothing_k"] == 0.5
    assert len(model.config["trained_on"]) == 38


def test_default_model_rows_are_log_probabilities_and_the_one_hot_product():
    weight = Bigram.load().weight
    assert np.allclose(np.exp(weight.astype(np.float64)).sum(axis=1), 1.0, atol=1e-6)
    identity = np.eye(256, dtype=np.float32)
    assert (identity @ weight).tobytes() == weight.tobytes()


def test_default_model_greedy_from_T():
    model = Bigram.load()
    out = [ord("T")]
    for _ in range(6):
        out.append(int(np.argmax(model.logits(out[-1]))))
    assert bytes(out) == b"The \n\n\n"
