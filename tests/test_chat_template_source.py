"""Where a model's chat template comes from: a Hugging Face directory's ``tokenizer_config.json``
(a string, or the list of named templates whose ``default`` is taken) or ``chat_template.jinja``, with
BOS/EOS text; a GGUF's ``tokenizer.chat_template``; none -> the default template; ``CHAT_TEMPLATE``
overrides all of them.

Source: Hugging Face transformers, "Chat templates" (``chat_template.jinja``, named templates).
"""

from __future__ import annotations

import json

import pytest

from model.chat_template import DEFAULT_STOP
from model.loader import load_model
from tests.gguffiles import write_tiny_gguf
from tests.llamafiles import write_tiny_llama
from wsgi_app.http.chat import check_chat_template, serving_template
from wsgi_app.settings import Settings

USER = [{"role": "user", "content": "hi"}]
NAMED = "{{ bos_token }}[{{ messages[0]['content'] }}]{{ eos_token }}"


def settings(**env: str) -> Settings:
    return Settings.from_env(env)


def test_tokenizer_config_string_and_token_objects(tmp_path):
    d = write_tiny_llama(tmp_path / "m")
    config = {"chat_template": NAMED, "bos_token": {"content": "<B>"}, "eos_token": "<E>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text("ignored: tokenizer_config.json comes first")
    model = load_model(d)
    assert (model.chat_template_source, model.bos_token, model.eos_token) == (NAMED, "<B>", "<E>")
    assert model.chat_template().render(USER) == "<B>[hi]<E>"


def test_named_templates_take_default_and_jinja_file(tmp_path):
    d = write_tiny_llama(tmp_path / "m")
    named = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": NAMED}]
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    model = load_model(d)
    assert model.chat_template_source == NAMED
    # Without tokenizer_config.json, BOS/EOS text comes from the tokenizer's ids.
    assert model.chat_template().render(USER) == "<s>[hi]</s>"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ValueError, match="lists no template named 'default'"):
        load_model(d)
    (d / "tokenizer_config.json").unlink()
    (d / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert load_model(d).chat_template().render(USER) == "Jhi"


def test_no_template_is_the_default_with_its_stop(tmp_path):
    model = load_model(write_tiny_llama(tmp_path / "m"))
    template = serving_template(model, settings())
    assert model.chat_template_source is None
    assert template.is_default and template.stop == (DEFAULT_STOP,)
    assert load_model(None).chat_template().render(USER) == "User: hi\nAssistant:"


def test_gguf_metadata_template_and_chat_template_override(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "t.gguf",
        metadata=lambda w: w.add_chat_template("<{{ messages[0]['content'] }}>"),
    )
    model = load_model(path, cache_dir=tmp_path / "cache")
    assert model.chat_template().render(USER) == "<hi>"
    assert (model.bos_token, model.eos_token) == ("\x0b", "<|endoftext|>")  # default bos 11
    override = tmp_path / "o.jinja"
    override.write_text("O{{ messages[-1]['content'] }}")
    s = settings(CHAT_TEMPLATE=str(override))
    assert serving_template(model, s).render(USER) == "Ohi"
    check_chat_template(model, s)  # renders on the sample conversation: no error
    override.write_text("{{ messages[5]['content'] }}")
    with pytest.raises(ValueError, match=r"^CHAT_TEMPLATE \(.*o\.jinja\): fails on a sample"):
        check_chat_template(model, s)
