"""The C heap's freed pages go back to the system when the engine goes idle (glibc malloc_trim).

Source: glibc ``malloc_trim(3)``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from wsgi_app import heap
from wsgi_app.heap import HeapTrimmer, trim_heap


def anonymous_mib() -> int:
    """Return this process's anonymous resident memory, MiB (``RssAnon`` of /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc")
def test_trim_returns_a_threads_freed_arena_to_the_system():
    kept = []

    def burst():
        # 3000 x 64 KB, below the mmap threshold: they live in this thread's malloc arena.
        arrays = [np.ones(8000) for _ in range(3000)]
        kept.append(arrays[-1])  # the last one pins the arena's top: free() alone cannot trim

    thread = threading.Thread(target=burst)
    thread.start()
    thread.join()
    before = anonymous_mib()
    assert trim_heap() is True
    assert anonymous_mib() < before - 100


def test_trimmer_runs_at_most_once_per_interval():
    now = [0.0]
    trims = []
    trimmer = HeapTrimmer(1.0, trim=lambda: trims.append(now[0]), clock=lambda: now[0])
    results = []
    for t in (0.0, 0.5, 0.99, 1.0, 1.5, 2.5):
        now[0] = t
        results.append(trimmer())
    assert results == [True, False, False, True, False, True]
    assert trims == [0.0, 1.0, 2.5] and trimmer.count == 3
