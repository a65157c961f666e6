"""One request's generation: its record, admission to a slot, the completion and its choices (the token
loop), the pacer, the engine thread, fault injection (no Flask).

See docs/ARCHITECTURE.md §2, §4 and §9.
"""
