"""Load, run and train greenserve's models (numpy + safetensors, no web imports).

``engine.py`` is the contract the server depends on; ``loader.py`` picks the family a model
directory holds; each architecture is one folder (``bigram/``, ``llama/``); sampling, the PCG32
generator, tokenizers, UTF-8 decoding and stop strings are shared by all of them.

``__version__`` is greenserve's one version: ``pyproject.toml`` reads it (a dynamic version), and the
server passes it on to ``X-Model-Version``, the OTLP instrumentation scope and ``greenserve --version``.
"""

__version__ = "0.1.0"
