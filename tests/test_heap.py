"""The C heap's freed pages go back to the system when the engine goes idle and after the worker's
answers are written (glibc malloc_trim).

Source: glibc ``malloc_trim(3)``.
"""

from __future__ import annotations

import threading
import time

import gevent
import numpy as np
import pytest

from wsgi_app.server import heap
from wsgi_app.server.heap import AfterAnswers, HeapTrimmer, trim_heap


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


class FakeTrimmer:
    """Records trims; refuses (returns False, as a rate-limited HeapTrimmer does) ``refuse`` times."""

    def __init__(self, refuse: int = 0) -> None:
        self.calls: list[float] = []
        self.refuse = refuse

    def __call__(self) -> bool:
        self.calls.append(time.perf_counter())
        if self.refuse:
            self.refuse -= 1
            return False
        return True


def test_after_answers_trims_once_the_quiet_delay_after_the_last_answer():
    trimmer = FakeTrimmer()
    after = AfterAnswers(lambda: True, delay_s=0.5, trimmer=trimmer)
    gevent.sleep(0.05)
    time.sleep(0.6)  # the hub's loop has not run meanwhile: its clock is 0.6 s old
    after.request_done()
    gevent.sleep(0.2)
    restarted = time.perf_counter()
    after.request_done()  # restarts the delay
    gevent.sleep(0.2)
    assert trimmer.calls == []  # 0.4 s after the first answer, 0.2 s after the last
    gevent.sleep(0.6)
    assert len(trimmer.calls) == 1 and trimmer.calls[0] - restarted >= 0.5


def test_after_answers_waits_for_idle_and_retries_a_refused_trim():
    busy = [True]
    trimmer = FakeTrimmer(refuse=1)
    after = AfterAnswers(lambda: not busy[0], delay_s=0.05, trimmer=trimmer)
    after.request_done()
    gevent.sleep(0.15)
    assert trimmer.calls == []  # still generating: nothing, until the next answer is done
    busy[0] = False
    after.request_done()
    gevent.sleep(0.2)
    assert len(trimmer.calls) == 2  # refused once (too soon), then trimmed a delay later
    gevent.sleep(0.15)
    assert len(trimmer.calls) == 2
