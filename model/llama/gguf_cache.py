"""Keep dequantized GGUF weights in a float32 safetensors cache file that workers memory-map.

Dequantizing takes a second or more and gives each worker a private copy; instead the float32
tensors are written once to ``<cache dir>/gguf/<sha256 of the GGUF>.v<FORMAT_VERSION>.safetensors``
and every worker maps that file read-only, so N workers share one copy in the page cache and a
restart does not dequantize again.

The file is written atomically: in a build directory of its own beside the final name (never
loaded), flushed with ``fsync``, then renamed over the final name, then the directory is synced.
A crash mid-write leaves at most a build directory, which the next build removes. Builders racing
for the same file serialise on an advisory lock file; the loser finds the finished file and maps it.

Source: the safetensors format (huggingface/safetensors README); POSIX ``rename(2)`` atomicity;
the XDG Base Directory Specification (``$XDG_CACHE_HOME``, default ``~/.cache``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import safetensors.numpy

from model.llama.weights import map_safetensors

# Bump when the cached tensors change meaning (names, layout, permutation): old files are ignored.
# Version 2: ``build`` refuses NaN and infinite weights, so a file of this version holds only
# finite ones; a version-1 file (written unchecked) is rebuilt, and checked, instead of mapped.
FORMAT_VERSION = 2
CACHE_DIR_ENV = "GREENSERVE_CACHE_DIR"
APP_NAME = "greenserve"
_SUBDIR = "gguf"
# Each build writes in a directory of this prefix; one left behind is a crashed build's.
BUILD_PREFIX = ".build-"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Return the cache directory: ``$GREENSERVE_CACHE_DIR``, else the XDG cache dir.

    Args:
        environ: The environment; ``os.environ`` when None.

    Returns:
        ``$GREENSERVE_CACHE_DIR`` if set and non-empty, else ``$XDG_CACHE_HOME/greenserve`` if
        ``XDG_CACHE_HOME`` is an absolute path, else ``~/.cache/greenserve``.

    Source: XDG Base Directory Specification 0.8 (relative ``XDG_CACHE_HOME`` is ignored).
    """
    env = os.environ if environ is None else environ
    explicit = env.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / APP_NAME
    return Path.home() / ".cache" / APP_NAME


def cache_path(cache_dir: Path, sha256: str) -> Path:
    """Return the cache file for a GGUF of this SHA-256 (lower-case hex)."""
    return cache_dir / _SUBDIR / f"{sha256}.v{FORMAT_VERSION}.safetensors"


def load_or_build(
    cache_dir: Path,
    sha256: str,
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], Path]:
    """Map the cached tensors of a GGUF, building the cache file first when it is missing.

    Args:
        cache_dir: The cache directory (created when missing).
        sha256: Lower-case hex SHA-256 of the GGUF file: the cache key.
        build: Returns the float32 tensors (called only when no valid cache file exists).

    Returns:
        ``(tensors, path)``: name -> read-only float32 array mapped from the cache file, and
        that file.

    Raises:
        ValueError: If the cache file cannot be written or read back (names the file).
    """
    path = cache_path(cache_dir, sha256)
    tensors = _try_map(path, sha256)
    if tensors is not None:
        return tensors, path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            tensors = _try_map(path, sha256)  # another process may have built it meanwhile
            if tensors is None:
                _remove_stale_builds(path.parent)
                _write_atomically(path, build(), sha256)
                tensors = _try_map(path, sha256)
    except OSError as exc:
        raise ValueError(f"{path}: cannot write the weights cache: {exc}") from exc
    if tensors is None:
        raise ValueError(f"{path}: the weights cache file just written cannot be read back")
    return tensors, path


def _try_map(path: Path, sha256: str) -> dict[str, np.ndarray] | None:
    """Map the cache file, or return None when it is absent or not a complete, matching file."""
    if not path.is_file():
        return None
    try:
        tensors = map_safetensors(path)
    except (ValueError, OSError):
        return None  # a damaged file is rebuilt, never served
    if _metadata(path) != _expected_metadata(sha256):
        return None
    return tensors


def _metadata(path: Path) -> dict[str, str] | None:
    """Return the ``__metadata__`` of a safetensors file, or None when it cannot be read."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return f.metadata()
    except Exception:  # safetensors raises its own error types for a damaged header
        return None


def _expected_metadata(sha256: str) -> dict[str, str]:
    """Return the metadata a cache file for this GGUF carries."""
    return {
        "format": "greenserve-gguf-cache",
        "version": str(FORMAT_VERSION),
        "gguf_sha256": sha256,
        "weights": "finite",
    }


def _write_atomically(path: Path, tensors: dict[str, np.ndarray], sha256: str) -> None:
    """Write the tensors in a build directory beside ``path``, fsync, then rename into place.

    safetensors writes through a temporary file of its own beside its target (``.tmpXXXXXX``),
    so the target is in a directory only this build uses: whatever a crash leaves is in it,
    and the next build (holding the lock, so no other builder is alive) removes it.
    """
    build_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{BUILD_PREFIX}{path.name}."))
    tmp = build_dir / path.name
    try:
        safetensors.numpy.save_file(tensors, str(tmp), metadata=_expected_metadata(sha256))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # workers may run as another user than the builder
        os.replace(tmp, path)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _remove_stale_builds(directory: Path) -> None:
    """Remove the build directories of builders that died (call with the lock held)."""
    for stale in directory.glob(f"{BUILD_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in directory.glob(".*.safetensors.*.tmp"):  # left by builds before build dirs
        stale.unlink(missing_ok=True)
