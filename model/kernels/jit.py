"""numba, set up for greenserve's kernels: imported first by every kernel module.

numba reads its environment once, when it is imported, so this module sets it and then imports
numba:

- ``NUMBA_DISABLE_INTEL_SVML=1``: SVML's vector ``exp`` rounds differently from the scalar one, so a
  result would depend on whether a loop vectorised (and on the CPU); our kernels call no libm
  function on the token path anyway (:mod:`model.kernels.mathf`).
- ``NUMBA_CACHE_DIR``: compiled kernels are cached on disk (``cache=True``) in a directory of their
  own, ``GREENSERVE_NUMBA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/greenserve/numba`` (``~/.cache``
  by default): not site-packages, which a hardened unit makes read-only, and not the model cache
  directory, which tests point at a fresh temporary directory each. A directory that cannot be
  written is replaced by a temporary one of this process, with a warning naming the setting (numba
  itself would refuse to compile a cached kernel there); the process that made it removes it when it
  exits.

Source: numba's environment variables reference (``NUMBA_CACHE_DIR``, ``NUMBA_DISABLE_INTEL_SVML``).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

_log = logging.getLogger("greenserve.model")


def numba_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """Return the directory numba caches compiled kernels in (created by numba when it writes).

    Args:
        environ: The environment to read (``os.environ`` by default).
    """
    env = os.environ if environ is None else environ
    own = env.get("GREENSERVE_NUMBA_CACHE_DIR", "").strip()
    if own:
        return Path(own)
    base = env.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "greenserve" / "numba"


def _remove_if_owner(path: Path, owner: int) -> None:
    """Remove a fallback cache directory, in the process that made it only."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _writable_cache_dir() -> Path:
    """Return :func:`numba_cache_dir`, created, or a new temporary directory when it cannot be."""
    wanted = numba_cache_dir()
    try:
        wanted.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=wanted):
            return wanted
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="greenserve-numba-"))
        # removed when the process that made it exits (a gunicorn master: its forked workers
        # inherit the handler, and must not remove what their siblings still use)
        atexit.register(_remove_if_owner, fallback, os.getpid())
        _log.warning(
            "%s: cannot write compiled kernels there (%s); using %s for this process "
            "(set GREENSERVE_NUMBA_CACHE_DIR to a writable directory)",
            wanted,
            exc.strerror or exc,
            fallback,
        )
        return fallback


os.environ["NUMBA_DISABLE_INTEL_SVML"] = "1"
os.environ["NUMBA_CACHE_DIR"] = str(_writable_cache_dir())
# Compiling takes 10-20 s of CPU the first time (the process is silent meanwhile), loading the
# cached kernels well under a second: say which directory before either.
_log.info(
    "loading greenserve's kernels from %s (compiled there first when missing: 10-20 s of CPU)",
    os.environ["NUMBA_CACHE_DIR"],
)

import numba  # noqa: E402  (after the environment it reads)

__all__ = ["numba", "numba_cache_dir"]
