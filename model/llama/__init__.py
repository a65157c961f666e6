"""The Llama family: config, weights loaders, forward pass, KV cache, the batching scheduler (the
owner of the sequence rules) and its sequential engine, and the llama2.c converter."""
