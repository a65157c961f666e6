"""Generating with a Llama model: the batching scheduler (the one owner of the sequence rules), its
sequences, the prefix cache, prompt-lookup speculation and the sequential engine. Built on
:mod:`model.llama.forward`; imports nothing of :mod:`model.llama.formats`."""
