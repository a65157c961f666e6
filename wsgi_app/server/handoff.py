"""A reload's hand-off from the old workers to the new: the old ones keep accepting until a new one
has loaded its models, and a new one starts accepting only once every old one has stopped.

gunicorn's ``SIGHUP`` forks the new workers and sends the old ones ``SIGTERM`` right away, before the
new ones have loaded anything (``Arbiter.reload``: ``spawn_worker`` for each, then
``manage_workers``). Left at that, the old workers close their listeners within milliseconds and
every connection made meanwhile waits in the listen backlog until a new worker has loaded its
models: 0.5 s for a bigram, seconds for a GGUF. With the hand-off a connection waits only for the
switch itself (a few polls of :data:`POLL_S`), and the version flips once: no connection is
accepted by an old worker after a new one has accepted any.

**Generations.** The master numbers its workers' generations: 0 from the start, one more at each
reload (:func:`next_generation`, from the ``on_reload`` hook, before the new workers are forked;
they inherit it as ``GREENSERVE_GENERATION``, and the running ones read it from the file
:data:`GENERATION_FILE`). Every file lives in the master's own directory (its metrics directory),
removed with it.

**Locks.** A worker holds a shared ``flock`` on its generation's file :data:`ACCEPTING` from the
moment its models are loaded until it has closed its listeners, and marks its generation
:data:`READY` when it takes it. So:

- a worker told to stop while it accepts, by a reload (a newer generation exists), goes on serving
  until some newer generation is marked ready (:meth:`Handoff.newer_ready`), then stops as usual;
- a new worker starts accepting once no older generation's file is locked
  (:meth:`Handoff.older_accepting`): each old worker has closed its listeners, or died (the kernel
  drops a dead process's locks).

Each wait is bounded by the caller (gunicorn's ``timeout``): a worker that never gets there is not
waited for beyond it. A stop that is not a reload (the master stopping, ``TTOU``, a worker replaced)
finds no newer generation and stops at once, as before.

This module is imported by the worker: the stdlib only.

Source: flock(2) (locks belong to the open file description, dropped when its last descriptor
closes); gunicorn's ``Arbiter.reload``.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re

POLL_S = 0.005  # seconds between two looks at the other generation's locks
GENERATION_FILE = "greenserve-generation"  # the newest generation's number, written by the master
ACCEPTING = "greenserve-accepting-{}.lock"  # locked shared by each of a generation's workers
READY = "greenserve-ready-{}"  # made by a generation's first worker to have loaded its models
_ACCEPTING_NUMBER = re.compile(r"greenserve-accepting-(\d+)\.lock$")


def next_generation(directory: str, current: int) -> int:
    """In the master, before a reload forks the new workers: write ``current + 1`` to the
    generation file of ``directory`` (atomically) and return it; the caller passes it on to the
    new workers (``GREENSERVE_GENERATION``).

    Raises:
        OSError: the file cannot be written.
    """
    generation = current + 1
    partial = os.path.join(directory, GENERATION_FILE + ".tmp")
    with open(partial, "w") as f:
        f.write(str(generation))
    os.replace(partial, os.path.join(directory, GENERATION_FILE))
    return generation


class Handoff:
    """One worker's side of the hand-off (see the module docstring).

    Args:
        directory: the master's own directory, where the generation's files are.
        generation: this worker's generation (0 from the start, one more per reload).
    """

    def __init__(self, directory: str, generation: int) -> None:
        self.directory = directory
        self.generation = generation
        self._lock_fd: int | None = None

    @property
    def accepting(self) -> bool:
        """True from :meth:`ready` to :meth:`stopped_accepting`."""
        return self._lock_fd is not None

    def ready(self) -> None:
        """Say that this worker can serve (its models are loaded): lock its generation's file
        shared and mark the generation ready. Held until :meth:`stopped_accepting`.

        Raises:
            OSError: a file of the directory cannot be made.
        """
        fd = os.open(self._path(ACCEPTING.format(self.generation)), os.O_RDWR | os.O_CREAT, 0o600)
        # A blocking wait only while another generation's look (:func:`_locked`) holds it, briefly.
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._lock_fd = fd
        os.close(
            os.open(self._path(READY.format(self.generation)), os.O_WRONLY | os.O_CREAT, 0o600)
        )

    def stopped_accepting(self) -> None:
        """Say that this worker's listeners are closed: let the lock go."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def newest(self) -> int:
        """The newest generation the master has started (this one's when it never reloaded)."""
        try:
            with open(self._path(GENERATION_FILE)) as f:
                return max(self.generation, int(f.read()))
        except (OSError, ValueError):
            return self.generation

    def reloading(self) -> bool:
        """True when a stop is a reload's: this worker accepts and a newer generation exists."""
        return self.accepting and self.newest() > self.generation

    def newer_ready(self) -> bool:
        """True once a worker of a newer generation has loaded its models (:meth:`ready`)."""
        return any(
            os.path.exists(self._path(READY.format(g)))
            for g in range(self.generation + 1, self.newest() + 1)
        )

    def older_accepting(self) -> bool:
        """True while some worker of an older generation may still accept (holds its lock)."""
        for path in glob.glob(self._path(ACCEPTING.format("*"))):
            number = _ACCEPTING_NUMBER.search(path)
            if number and int(number.group(1)) < self.generation and _locked(path):
                return True
        return False

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)


def _locked(path: str) -> bool:
    """True when some process holds a lock on ``path``: an exclusive lock cannot be had at once.

    Two workers looking at once may each see the other's look as a lock: the caller looks again
    after :data:`POLL_S`, so that only delays it.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also lets go of the lock just taken
    return False
