"""The Llama model and its forward pass: config, tensors, safetensors weights, numpy ops, one pass's
attention and the KV cache. Imports nothing of :mod:`model.llama.serving` or
:mod:`model.llama.formats`."""
