"""Bytes only: the chunk and answer encoders, logprobs JSON and SSE framing (no Flask, no generation).

See docs/ARCHITECTURE.md §2 and §4.
"""
