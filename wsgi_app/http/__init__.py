"""The Flask side: the per-worker runtime, request hooks, auth, CORS, rate limits, client identity,
error handlers, bodies, the answer path, the stream body, chat rendering and the thin views in
``routes``.

See docs/ARCHITECTURE.md §2, §3 and §8.
"""
