"""A stop signal sent to a worker before gunicorn installs the worker's handlers: kept for them.

gunicorn's worker installs its signal handlers in ``Worker.init_signals``, late in its start (after
gevent's monkey-patching, ~0.1 s after the fork). Until then the forked child still runs the master's
handler, ``Arbiter.signal``, which puts the signal on the master's queue, of which the child holds a
copy that nothing reads. A SIGTERM in that window (the master stopping just after a start, a reload or
a respawn) was lost: the worker served on until the master killed it at the end of
``graceful_timeout``, its exit hooks (``worker_exit``) never ran and its streams ended without
``[DONE]``. And ``init_signals`` first resets every handler to ``SIG_DFL``: a SIGTERM between that
reset and the new handler would end the worker at once, without its hooks either.

So the child blocks the stop signals first thing (:func:`hold`, from the ``post_fork`` hook), puts
back on itself those the master's handler took since the fork, and unblocks them once its own
handlers are in place (:func:`release`, from ``GeventWorker.init_signals``). The kernel keeps a
blocked signal pending and delivers it at the unblock, once, to the handler installed then: an early
SIGTERM gets the same graceful stop as a late one. Blocking, rather than a handler of our own that
records the signal for later, leaves nothing to run in the window (imports, monkey-patching) and no
window at gunicorn's reset to ``SIG_DFL``.

This module is imported by the worker: the stdlib only.

Source: POSIX ``pthread_sigmask`` and pending signals (signal(7)); gunicorn's ``Arbiter.spawn_worker``
and ``Worker.init_signals``.
"""

from __future__ import annotations

import queue
import signal
from typing import Any

# The signals gunicorn stops a worker with: SIGTERM (graceful), SIGQUIT and SIGINT (quick).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGQUIT, signal.SIGINT})


def hold(arbiter: Any) -> frozenset[int]:
    """Block the stop signals in this (the forked worker's main) thread, then raise on it again each
    stop signal the master's inherited handler queued since the fork: both stay pending until
    :func:`release`.

    A stop signal the master had queued for itself when it forked is in the copy too: the master then
    stops this worker with it anyway, so raising it here only stops the worker a little sooner.

    Args:
        arbiter: gunicorn's ``Arbiter`` (the ``post_fork`` hook's ``server``) as this child copied it;
            its ``SIG_QUEUE`` is a ``queue.SimpleQueue`` (a list in older gunicorn), or absent.

    Returns:
        The signals this blocked (one blocked already stays so), for :func:`release`.
    """
    held = frozenset(STOP_SIGNALS - signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS))
    for sig in _taken(getattr(arbiter, "SIG_QUEUE", None)):
        signal.raise_signal(sig)
    return held


def release(held: frozenset[int]) -> None:
    """Unblock ``held`` (what :func:`hold` blocked): a stop signal that came meanwhile is delivered
    now, to the handlers installed by then."""
    if held:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _taken(signals: Any) -> list[int]:
    """Empty this child's copy of the master's signal queue; return the stop signals it held."""
    taken: list[int] = []
    if isinstance(signals, list):
        taken, signals[:] = list(signals), []
    elif isinstance(signals, queue.SimpleQueue):
        while True:
            try:
                taken.append(signals.get_nowait())
            except queue.Empty:
                break
    return [sig for sig in dict.fromkeys(taken) if sig in STOP_SIGNALS]
