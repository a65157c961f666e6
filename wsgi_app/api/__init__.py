"""OpenAI wire types and validation: one module per endpoint plus the fields they share (no Flask).

``completions`` (``/v1/completions``), ``chat`` (``/v1/chat/completions``), ``messages`` (a chat
request's messages, as the template sees them), ``table`` (each endpoint's one list of fields: known,
refused, carried by a GET query; unknown ones ignored and named), ``fields`` (strict JSON, the typed
readers, the model, sampling, seed and stream fields both share), ``errors`` (``ApiError`` and the
OpenAI error envelope). See docs/ARCHITECTURE.md §2 and §8.
"""
