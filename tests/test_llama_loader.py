"""load_model: dispatch on config.json, Hugging Face Llama directories (single and sharded
weights), the checksum, and every malformed-directory error at start-up."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from model.bigram.engine import BigramEngine
from model.bigram.model import Bigram
from model.files import file_sha256
from model.llama.forward.model import Llama
from model.llama.serving.engine import LlamaEngine
from model.llama.serving.scheduler import BatchScheduler
from model.loader import BIGRAM, LLAMA, load_model
from model.tokenizer import ByteTokenizer, HFTokenizer
from tests.llamafiles import tiny_reference, write_tiny_llama
from tests.modelfiles import write_safetensors_raw, write_succ_model

Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "tiny")


def edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            obj.pop(key, None)
        else:
            obj[key] = value
    path.write_text(json.dumps(obj))


def edit_tensors(directory: Path, drop: str | None = None, **replace: np.ndarray) -> None:
    tensors = safetensors.numpy.load_file(directory / "model.safetensors")
    if drop:
        del tensors[drop]
    tensors.update({k.replace("__", "."): v for k, v in replace.items()})
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")


def test_bigram_directories_load_as_before(tmp_path: Path) -> None:
    default = load_model(None)
    assert default.engine_kind == "bigram" and default.context_length is None
    assert isinstance(default.model, Bigram) and isinstance(default.tokenizer, ByteTokenizer)
    assert isinstance(default.make_engine(), BigramEngine)
    succ = load_model(write_succ_model(tmp_path / "succ"))
    assert succ.checksum == file_sha256(tmp_path / "succ" / "model.safetensors")


def test_the_family_says_how_a_model_is_served(tmp_path: Path, tiny_dir: Path) -> None:
    # What the server needs of a family comes through LoadedModel (docs/ARCHITECTURE.md §5).
    default = load_model(None)
    assert default.family is BIGRAM and default.family.inline and default.packaged
    assert default.family.limits(None, None) == (1024, 1024)
    with pytest.raises(ValueError, match="the bigram family runs inline: it has no scheduler"):
        default.make_scheduler(8)
    succ = load_model(write_succ_model(tmp_path / "succ"))
    assert succ.family is BIGRAM and not succ.packaged
    lm = load_model(tiny_dir)
    assert lm.family is LLAMA and not lm.family.inline and not lm.packaged
    assert lm.family.limits(None, 7) == (64, 7)
    scheduler = lm.make_scheduler(8, batch_invariant=False)
    assert isinstance(scheduler, BatchScheduler) and scheduler.context_length == 64
    assert scheduler.max_batch == 8 and not scheduler.batch_invariant
    assert scheduler.eos_ids == lm.tokenizer.eos_ids


def test_llama_directory_loads_with_tokenizer_and_checksum(tiny_dir: Path) -> None:
    lm = load_model(tiny_dir)
    assert lm.engine_kind == "llama" and lm.context_length == 64
    assert isinstance(lm.model, Llama) and isinstance(lm.tokenizer, HFTokenizer)
    assert isinstance(lm.make_engine(), LlamaEngine)
    assert lm.tokenizer.vocab_size == 300 and lm.tokenizer.eos_ids == frozenset({2})
    names = ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]
    lines = "".join(f"{n} {file_sha256(tiny_dir / n)}\n" for n in names)
    assert lm.checksum == hashlib.sha256(lines.encode()).hexdigest()
    edit_json(tiny_dir / "generation_config.json", eos_token_id=[2, 7])
    again = load_model(tiny_dir)
    assert again.tokenizer.eos_ids == frozenset({2, 7}) and again.checksum != lm.checksum


def test_generation_config_is_optional(tiny_dir: Path) -> None:
    (tiny_dir / "generation_config.json").unlink()
    edit_json(tiny_dir / "config.json", bos_token_id=..., eos_token_id=...)
    lm = load_model(tiny_dir)
    assert lm.tokenizer.bos_id is None and lm.tokenizer.eos_ids == frozenset()


def test_sharded_weights_equal_the_single_file(tiny_dir: Path, tmp_path: Path) -> None:
    tensors = safetensors.numpy.load_file(tiny_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:20],
        "model-00002-of-00002.safetensors": names[20:],
    }
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copyfile(tiny_dir / name, sharded / name)
    weight_map = {}
    for shard, members in shards.items():
        safetensors.numpy.save_file({n: tensors[n] for n in members}, sharded / shard)
        weight_map.update(dict.fromkeys(members, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(sharded).model
    tokens, ref = tiny_reference()
    got = model.prompt_logits(tokens[0], model.new_cache())
    want = Llama.load(tiny_dir).prompt_logits(tokens[0], model.new_cache())
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, ref[0], rtol=0, atol=1e-4)


def test_f16_weights_stay_f16_for_the_kernels(tiny_dir: Path) -> None:
    tensors = safetensors.numpy.load_file(tiny_dir / "model.safetensors")
    half = tensors[Q0].astype(np.float16)
    edit_tensors(tiny_dir, **{Q0.replace(".", "__"): half})
    wq = Llama.load(tiny_dir).layers[0].wq
    assert wq.qtype == "F16" and wq.nbytes == half.nbytes  # never widened: half the bytes
    np.testing.assert_array_equal(wq.dequantize(), half.astype(np.float32))


def test_bf16_bits_become_the_top_half_of_float32(tmp_path: Path) -> None:
    from model.llama.forward.weights import map_safetensors

    # 0x3FC0 is bfloat16 1.5; 0xC020 is -2.5
    header = {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}
    write_safetensors_raw(tmp_path / "w.safetensors", header, bytes.fromhex("c03f20c0"))
    np.testing.assert_array_equal(map_safetensors(tmp_path / "w.safetensors")["w"], [1.5, -2.5])


# Each case: (what to break, expected message pattern).
CONFIG_ERRORS = [
    ({"model_type": "mistral"}, r"model_type must be 'llama', got 'mistral'"),
    ({"hidden_size": ...}, r"missing field 'hidden_size'"),
    ({"num_hidden_layers": 2.0}, r"num_hidden_layers must be a positive integer, got 2\.0"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"head_dim": 15}, r"head_dim=15 must be even"),
    ({"head_dim": ..., "hidden_size": 66}, r"hidden_size=66 is not a multiple of 4 heads"),
    ({"hidden_act": "gelu"}, r"hidden_act must be 'silu', got 'gelu'"),
    ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling .* is not supported"),
    ({"rope_parameters": {"rope_type": "yarn"}}, r"rope_type 'yarn' is not supported"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps must be a positive number"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
    ({"eos_token_id": 300}, r"token id 300 is outside vocab_size=300"),
    ({"eos_token_id": "2"}, r"eos_token_id must be a token id or a list of them"),
]


@pytest.mark.parametrize(("changes", "message"), CONFIG_ERRORS)
def test_unsupported_config_values_are_refused(tiny_dir: Path, changes: dict, message: str) -> None:
    edit_json(tiny_dir / "config.json", **changes)
    with pytest.raises(ValueError, match=message) as err:
        load_model(tiny_dir)
    assert "config.json" in str(err.value)


def test_config_json_problems(tiny_dir: Path) -> None:
    (tiny_dir / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"config\.json: must be a JSON object, got list"):
        load_model(tiny_dir)
    (tiny_dir / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_model(tiny_dir)
    (tiny_dir / "config.json").write_text('{"architectures": ["X"]}')
    with pytest.raises(
        ValueError, match=r"names no architecture: needs 'tl_arch' \(bigram\) or 'model_type'"
    ):
        load_model(tiny_dir)
    (tiny_dir / "config.json").unlink()
    with pytest.raises(ValueError, match=r"holds 3 entries but no config\.json and no \.gguf file"):
        load_model(tiny_dir)


def test_a_model_dir_that_does_not_exist_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "v2"
    with pytest.raises(ValueError) as err:
        load_model(missing)
    assert str(err.value) == f"{missing}: does not exist"
    link = tmp_path / "model"
    link.symlink_to(missing)  # an upgrade's symlink pointing at a directory not yet in place
    with pytest.raises(ValueError) as err:
        load_model(link)
    assert str(err.value) == f"{link}: does not exist (a symlink to {missing}, which is missing)"


def test_missing_tensor_is_named(tiny_dir: Path) -> None:
    edit_tensors(tiny_dir, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_model(tiny_dir)


def test_untied_model_needs_lm_head(tiny_dir: Path) -> None:
    edit_tensors(tiny_dir, drop="lm_head.weight")
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        load_model(tiny_dir)
    edit_json(tiny_dir / "config.json", tie_word_embeddings=True)
    model = load_model(tiny_dir).model
    assert model.wcls is model.tok_embeddings


def test_wrong_shape_is_named(tiny_dir: Path) -> None:
    edit_tensors(tiny_dir, **{Q0.replace(".", "__"): np.zeros((64, 32), np.float32)})
    with pytest.raises(
        ValueError, match=rf"tensor '{Q0}' has shape \[64, 32\], expected \[64, 64\]"
    ):
        load_model(tiny_dir)


def test_unexpected_tensor_is_named(tiny_dir: Path) -> None:
    edit_tensors(tiny_dir, model__layers__0__self_attn__q_proj__bias=np.zeros(64, np.float32))
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        load_model(tiny_dir)


def test_rotary_inv_freq_buffers_are_ignored(tiny_dir: Path) -> None:
    edit_tensors(tiny_dir, model__layers__0__self_attn__rotary_emb__inv_freq=np.ones(8, np.float32))
    assert load_model(tiny_dir).engine_kind == "llama"


def test_weight_file_problems(tiny_dir: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-4])
    with pytest.raises(ValueError, match=r"model\.safetensors: data buffer is .* \(short data\)"):
        load_model(tiny_dir)
    write_safetensors_raw(
        weights, {"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)
    )
    with pytest.raises(
        ValueError, match=r"tensor 'x': dtype must be one of \['BF16', 'F16', 'F32'\], got 'I64'"
    ):
        load_model(tiny_dir)
    write_safetensors_raw(weights, {}, b"", header_len=10**6)
    with pytest.raises(ValueError, match=r"header length N=1000000 runs past the end of the file"):
        load_model(tiny_dir)
    weights.unlink()
    with pytest.raises(
        ValueError, match=r"no model\.safetensors and no model\.safetensors\.index\.json"
    ):
        load_model(tiny_dir)


def test_sharded_index_problems(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").rename(tiny_dir / "part-1.safetensors")
    index = tiny_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {Q0: "part-2.safetensors"}}))
    with pytest.raises(
        ValueError, match=r"shard 'part-2\.safetensors' \(for tensor .*\) is missing"
    ):
        load_model(tiny_dir)
    index.write_text(json.dumps({"weight_map": {Q0: "../part-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"names an invalid shard '\.\./part-1\.safetensors'"):
        load_model(tiny_dir)
    index.write_text(json.dumps({"weight_map": {"nope": "part-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"tensor 'nope' is not in shard 'part-1\.safetensors'"):
        load_model(tiny_dir)
    index.write_text(json.dumps({"weight_map": {Q0: "part-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.embed_tokens\.weight'"):
        load_model(tiny_dir)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"weight_map must be a non-empty object"):
        load_model(tiny_dir)


def test_tokenizer_problems(tiny_dir: Path) -> None:
    tok = tiny_dir / "tokenizer.json"
    spec = json.loads(tok.read_text())
    spec["added_tokens"].append(
        {"id": 300, "content": "<extra>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    tok.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"tokenizer has 301 tokens but the model only 300"):
        load_model(tiny_dir)
    tok.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load tokenizer"):
        load_model(tiny_dir)
    tok.unlink()
    with pytest.raises(ValueError, match=r"missing tokenizer\.json"):
        load_model(tiny_dir)


def test_generation_config_problems(tiny_dir: Path) -> None:
    gen = tiny_dir / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [2, 999]}))
    with pytest.raises(ValueError, match=r"generation_config\.json: token id 999 is outside"):
        load_model(tiny_dir)
    gen.write_text("[]")
    with pytest.raises(ValueError, match=r"generation_config\.json: must be a JSON object"):
        load_model(tiny_dir)
