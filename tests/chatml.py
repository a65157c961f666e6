"""ChatML for chat template tests: SmolLM2-135M-Instruct's template, and a byte-level tokenizer whose
ids are the bytes plus the template's two control tokens.

Source: SmolLM2-135M-Instruct's ``tokenizer.chat_template`` (Apache-2.0), as its GGUF file carries it.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from model.tokenizer import HFTokenizer, _byte_level_chars

# The template's source, byte for byte.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def chatml_tokenizer() -> HFTokenizer:
    """Byte-level BPE without merges: byte b is id b; <|im_start|> 256, <|im_end|> 257 (special)."""
    chars = _byte_level_chars()
    tok = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    return HFTokenizer(tok, bos_id=None, eos_ids=frozenset({257}))


def text_ids(text: str) -> list[int]:
    """Return the ids :func:`chatml_tokenizer` gives plain ``text``: its UTF-8 bytes."""
    return list(text.encode())
