"""Karpathy's stories260K, converted from the shared llama2.c files into a temp dir, against
llama2.c's own outputs: the tokenizer, 200+ greedy steps, the text, EOS on BOS, batching."""

from pathlib import Path

import pytest

from model.engine import GenerationRequest
from model.llama.formats.llama2c import read_tokenizer
from model.loader import LoadedModel, load_model
from model.sampling import SamplingParams, greedy
from model.tokenizer import decode_ids
from model.utf8 import Utf8Decoder
from tests.llamafiles import expected_greedy, stories_or_skip

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> LoadedModel:
    return load_model(stories_dir)


def runc_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """llama2.c run.c `encode` (BOS, dummy prefix, byte fallback, best-score merges), in Python."""
    lookup = {p: i for i, p in enumerate(pieces)}
    tokens = [1]
    if text:
        tokens.append(lookup[b" "])
    for ch in text:
        raw = ch.encode("utf-8")
        tokens += [lookup[raw]] if raw in lookup else [b + 3 for b in raw]
    while True:
        best, best_at, best_id = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            j = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if j is not None and scores[j] > best:
                best, best_at, best_id = scores[j], i, j
        if best_at < 0:
            return tokens
        tokens[best_at : best_at + 2] = [best_id]


def test_once_upon_a_time_encodes_like_llama2c(stories: LoadedModel) -> None:
    assert stories.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert stories.tokenizer.encode("") == [1]
    assert stories.tokenizer.bos_id == 1
    assert stories.tokenizer.eos_ids == frozenset({1, 2})


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, there was a little girl named Lily.",
        "Lily's mom said, \"Let's go to the park.\"\nThe end.",
        "  two leading spaces and  double  spaces ",
        "naïve café — “quotes” … 3.14 ☃ 中文 🙂",
        "\t\n",
        "<s> is not a control token here </s>",
    ],
)
def test_hf_tokenizer_equals_runc_encoder(stories: LoadedModel, text: str) -> None:
    src = stories_or_skip()
    pieces, scores = read_tokenizer((src / "tok512.bin").read_bytes(), 512)
    assert stories.tokenizer.encode(text) == runc_encode(text, pieces, scores)


@pytest.mark.parametrize("case", ["bos_only_200_steps", "once_upon_a_time_256_steps"])
def test_greedy_ids_and_text_equal_llama2c(stories: LoadedModel, case: str) -> None:
    want = expected_greedy()[case]
    prompt = stories.tokenizer.encode(want["prompt"])
    assert prompt == want["prompt_tokens"]
    req = GenerationRequest(tuple(prompt), len(want["generated_tokens"]), GREEDY, seed=0)
    steps = list(stories.make_engine().stream(req))
    assert [s.token_id for s in steps] == want["generated_tokens"]
    assert all(s.finish_reason is None for s in steps)  # no BOS within these steps
    text = decode_ids(stories.tokenizer, want["generated_tokens"])
    if want["prompt"]:
        assert want["prompt"] + text == want["text"]
    else:  # run.c strips the dummy-prefix space after BOS; the stream keeps it
        assert text == " " + want["text"]


def test_streamed_chunks_never_split_a_character(stories: LoadedModel) -> None:
    tok = stories.tokenizer
    ids = tok.encode("Tom saw a ☃ and 🙂!")[1:]
    decoder = Utf8Decoder()
    chunks = [decoder.feed(tok.token_bytes[i]) for i in ids] + [decoder.finish()]
    assert "".join(chunks) == " Tom saw a ☃ and 🙂!"
    assert all("\ufffd" not in c for c in chunks)
    assert "☃" in chunks and "🙂" in chunks  # each arrives whole, from 3 and 4 byte tokens


def test_story_ends_on_bos_with_finish_reason_stop(stories: LoadedModel) -> None:
    engine = stories.make_engine()
    prompt = tuple(stories.tokenizer.encode("Once upon a time"))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    steps = list(engine.stream(GenerationRequest(prompt, 500, params, seed=0)))
    assert len(steps) < 500
    assert steps[-1].token_id == 1 and steps[-1].finish_reason == "stop"
    assert all(s.finish_reason is None and s.token_id != 1 for s in steps[:-1])
    text = decode_ids(stories.tokenizer, [s.token_id for s in steps[:-1]])
    assert text.startswith(",") and text.endswith(".")
    # ignore_eos: the same draws up to the BOS, which is then an ordinary token
    more = list(engine.stream(GenerationRequest(prompt, 500, params, seed=0, ignore_eos=True)))
    assert [s.token_id for s in more[: len(steps)]] == [s.token_id for s in steps]
    assert more[len(steps) - 1].finish_reason is None and len(more) == 500


def test_batch_of_8_decodes_like_8_single_sequences(stories: LoadedModel) -> None:
    model, tok = stories.model, stories.tokenizer
    prompts = ["Once upon a time", "Tom had a dog", "The sun", "Lily", "A big red ball"]
    prompts += ["Mom said", "One day, a little bird", "Ben"]
    engine = stories.make_engine()
    requests = [
        GenerationRequest(tuple(tok.encode(p)), 40, GREEDY, 0, ignore_eos=True) for p in prompts
    ]
    solo = [[s.token_id for s in engine.stream(r)] for r in requests]
    caches = [model.new_cache() for _ in prompts]
    ids = [greedy(model.prefill(tok.encode(p), c)) for p, c in zip(prompts, caches, strict=True)]
    batched = [[i] for i in ids]
    for _ in range(39):
        logits = model.decode(ids, caches)
        ids = [greedy(row) for row in logits]
        for out, i in zip(batched, ids, strict=True):
            out.append(i)
    assert batched == solo


def test_converted_directory_layout(stories: LoadedModel) -> None:
    d: Path = stories.model_dir
    assert sorted(p.name for p in d.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    c = stories.model.config
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (
        64,
        172,
        5,
        8,
        4,
        512,
    )
    assert (c.max_seq_len, c.norm_eps, c.rope_theta, c.tie_embeddings) == (512, 1e-5, 1e4, True)
    assert stories.model.wcls is stories.model.tok_embeddings
    assert stories.context_length == 512 and stories.engine_kind == "llama"
    assert stories.model.tok_embeddings.qtype == "F32"  # llama2.c stores float32
