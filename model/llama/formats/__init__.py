"""Containers of the Llama family other than a Hugging Face directory, read into
:mod:`model.llama.forward`'s config and tensors: GGUF (reader, packing, weights cache, tokenizer),
llama2.c (reader and converter) and the SentencePiece vocabularies both carry. Imports nothing of
:mod:`model.llama.serving`."""
