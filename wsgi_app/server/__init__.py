"""The gunicorn and gevent transport: the worker, the request head, socket tuning, hub turns,
gunicorn's own error answers, giving the heap back (no Flask, nothing of ``generation`` or ``http``).

See docs/ARCHITECTURE.md §2 and §15.
"""
