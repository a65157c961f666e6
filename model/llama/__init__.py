"""The Llama family, cut by concern into three sub-packages whose imports point one way:

- :mod:`model.llama.forward`: the model and its forward pass (config, tensors, safetensors weights,
  numpy ops, attention, KV cache);
- :mod:`model.llama.serving`: generating with it (the batching scheduler, the owner of the sequence
  rules; its sequences, prefix cache, speculation, and the sequential engine), on top of ``forward``;
- :mod:`model.llama.formats`: the other containers read into ``forward``'s tensors and config (GGUF
  and its weights cache and tokenizer, llama2.c and its converter, SentencePiece vocabularies).

``serving`` and ``formats`` import ``forward``, never each other, and ``forward`` neither
(tests/test_layering.py); :mod:`model.loader` puts them together.
"""
