"""Give the C heap's free memory back to the operating system (glibc ``malloc_trim``).

numpy's temporaries of a batch of sequences are freed when the batch ends, but glibc keeps the
freed pages of the engine thread's malloc arena for later: an idle worker that served 16 streams
kept ~300 MB more anonymous memory than before them. ``malloc_trim(0)`` returns the free pages at
the top of every arena and the free whole pages inside them (``MADV_DONTNEED``).

Two moments trim: the engine thread going idle (:class:`HeapTrimmer` as ``ThreadedEngine``'s
``on_idle``), and the worker's generations being over (:class:`AfterAnswers`): a big answer's bytes
are freed only once written, after the engine went idle, and the bigram has no engine thread.

Source: glibc manual, "Memory Allocation Tunables" and ``malloc_trim(3)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable
from typing import Any


def _load_trim() -> Callable[[int], int] | None:
    """Return glibc's ``malloc_trim``, or None where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None


_TRIM = _load_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the operating system.

    Returns:
        True if glibc released memory, False if it had none to release or is not the C library.
    """
    return bool(_TRIM(0)) if _TRIM is not None else False


class HeapTrimmer:
    """Call :func:`trim_heap` at most once per ``min_interval_s`` seconds.

    Args:
        min_interval_s: Shortest time between two trims, seconds (a trim walks every arena: a
            few milliseconds, not worth doing between back-to-back requests).
        trim: The trimming function (:func:`trim_heap`).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        min_interval_s: float = 1.0,
        trim: Callable[[], bool] = trim_heap,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_interval_s = min_interval_s
        self._trim = trim
        self._clock = clock
        self._last = -float("inf")
        self.count = 0

    def __call__(self) -> bool:
        """Trim unless the last trim is more recent than ``min_interval_s``; return whether it ran."""
        now = self._clock()
        if now - self._last < self.min_interval_s:
            return False
        self._last = now
        self.count += 1
        self._trim()
        return True


class AfterAnswers:
    """Trim the heap once a worker's generation requests are over.

    Every finished generation request notes its time; one timer on the gevent hub, armed by the
    first of them after a quiet spell, fires ``delay_s`` after the last one (re-arming itself for
    what is left while requests keep finishing). Then, with no generation running or queued, the
    heap is trimmed (through a :class:`HeapTrimmer`; a trim refused for being too soon is retried a
    delay later). Waiting until the request's greenlet is done lets its answer's bytes be freed
    first. A request's own cost is one clock read.

    Args:
        idle: True when the worker has no generation running or queued.
        delay_s: quiet time after the last finished request before trimming, seconds.
        trimmer: the rate-limited trim (:class:`HeapTrimmer`).
        loop: the gevent loop whose timer is used; the current hub's, made on first use.
    """

    def __init__(
        self,
        idle: Callable[[], bool],
        delay_s: float = 0.25,
        trimmer: Callable[[], bool] | None = None,
        loop: Any = None,
    ) -> None:
        self._idle = idle
        self.delay_s = delay_s
        self._trimmer = HeapTrimmer() if trimmer is None else trimmer
        self._loop = loop
        self._timer: Any = None
        self._last = 0.0  # perf_counter of the last finished request

    def request_done(self) -> None:
        """A generation request's answer is written: trim ``delay_s`` from now, if idle then."""
        self._last = time.perf_counter()
        if self._timer is None or not self._timer.active:
            self._arm(self.delay_s)

    def _arm(self, after_s: float) -> None:
        if self._loop is None:
            import gevent  # only in a worker: the app factory may run without a hub

            self._loop = gevent.get_hub().loop
        if self._timer is not None:
            self._timer.close()  # a stopped libev timer restarted keeps its first deadline
        # The loop's clock is the time of its last iteration: a greenlet that ran long since (a big
        # answer's encoding) would make the timer due at once.
        self._loop.update_now()
        # ref=False: a pending trim never keeps a stopping worker's loop alive.
        self._timer = self._loop.timer(after_s, 0.0, ref=False)
        self._timer.start(self._fire)

    def _fire(self) -> None:
        left = self._last + self.delay_s - time.perf_counter()
        if left > 0:  # requests finished meanwhile: wait out the last one's delay
            self._arm(left)
        elif self._idle() and self._trimmer() is False:  # trimmed too recently: retry later
            self._arm(self.delay_s)
