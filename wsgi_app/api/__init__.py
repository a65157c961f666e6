"""OpenAI wire types and validation: one module per endpoint plus the fields they share (no Flask).

``completions`` (``/v1/completions``), ``chat`` (``/v1/chat/completions``), ``fields`` (strict JSON,
the model, sampling, seed and stream fields both share), ``errors`` (``ApiError`` and the OpenAI error
envelope). See docs/ARCHITECTURE.md §2 and §8.
"""
