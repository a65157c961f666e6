"""Structured outputs: constraints compiled by llguidance into per-choice token matchers and masks.

``tokens`` bridges the served tokenizer to llguidance, ``compile`` turns a :class:`Constraint` into a
cached :class:`Grammar`, ``matcher`` is the per-choice state and the token masks sampling applies
(docs/ARCHITECTURE.md §6).
"""
