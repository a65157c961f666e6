"""Keep a GGUF's weights, packed for our kernels, in a safetensors cache file that workers memory-map.

Repacking (:meth:`model.llama.formats.gguf.GGUFModel.pack`: the GGUF's blocks regrouped by tiles of output
rows, as many bytes as the GGUF's) would give each worker a private copy; instead the packed arrays
are written once to ``<cache dir>/gguf/<sha256 of the GGUF>.v<FORMAT_VERSION>.safetensors`` and every
worker maps that file read-only, so N workers share one copy in the page cache and a restart does not
repack again. The arrays are stored as they are (U8 nibbles, I8 quants, U16 f16 scale bits, F32).

The file is written atomically: in a build directory of its own beside the final name (never
loaded), flushed with ``fsync``, then renamed over the final name, then the directory is synced.
A crash mid-write leaves at most a build directory, which the next build removes. Builders racing
for the same file serialise on an advisory lock file; the loser finds the finished file and maps it.
The file is written read-only (mode 0444): nothing is meant to change it in place.

Its metadata carries a SHA-256 of its tensors (:func:`tensors_digest`: names, shapes and bytes), so
a file whose bytes changed after it was written (a flipped or zeroed block under a valid header) is
caught when it is mapped, not served: a damaged file (digest, truncation, header) is rebuilt from the
GGUF with one warning saying why, or, when its directory cannot be written, the weights are
packed in memory for this process with a warning. Checking costs one pass over the file
(SmolLM2-135M, 96 MB: well under 0.1 s, the tensors hashed in parallel), paid once per file per
process tree: a process that verified a file remembers its identity (device, inode, size, mtime,
ctime), and the gunicorn workers it forks inherit that, so they map without hashing again.

A running server maps the file: truncating or rewriting it in place under the server makes its
workers die of SIGBUS on the next read of a lost page (a rebuild renames a new file over the name,
which is safe: mapped pages of the old inode stay valid).

Source: the safetensors format (huggingface/safetensors README); POSIX ``rename(2)`` atomicity;
the XDG Base Directory Specification (``$XDG_CACHE_HOME``, default ``~/.cache``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from model.files import check_safetensors_header, read_safetensors_head

# Bump when the cached tensors change meaning (names, layout, permutation): old files are ignored.
# Version 2: ``build`` refuses NaN and infinite weights, so a file of this version holds only
# finite ones; a version-1 file (written unchecked) is rebuilt, and checked, instead of mapped.
# A file written before content digests (no ``content_sha256`` in its metadata) is rebuilt once.
# Version 3: the kernels' packed arrays, not float32 (a version-2 file is never read; the next
# build removes it).
FORMAT_VERSION = 3
# safetensors dtypes of the packed arrays -> numpy dtype
_DTYPES = {
    "F32": np.dtype("<f4"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
}
_DIGEST_KEY = "content_sha256"
CACHE_DIR_ENV = "GREENSERVE_CACHE_DIR"
APP_NAME = "greenserve"
_SUBDIR = "gguf"
# Each build writes in a directory of this prefix; one left behind is a crashed build's.
BUILD_PREFIX = ".build-"
# Threads hashing tensors while a file is checked (hashlib releases the GIL on large buffers).
_HASH_THREADS = 4
# Cache files this process (or the master it was forked from) checked: path -> file identity.
# A process-wide memo, not app state: it is what lets the workers skip the master's hashing.
_verified: dict[str, tuple[int, ...]] = {}
_log = logging.getLogger("greenserve.model")


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
    """Map the cached tensors of a GGUF, building the cache file first when it is missing or damaged.

    A file that is present but damaged (truncated, bad header, other metadata, or tensors whose
    digest is not the one recorded when it was written) is rebuilt with one warning naming why;
    when the directory cannot be written, the tensors are built in memory (private to this
    process) with a warning instead.

    Args:
        cache_dir: The cache directory (created when missing).
        sha256: Lower-case hex SHA-256 of the GGUF file: the cache key.
        build: Returns the arrays to cache (called only when no valid cache file exists): F32,
            uint8, int8 or uint16, any shape.

    Returns:
        ``(tensors, path)``: name -> read-only array mapped from the cache file (or built in
        memory, see above), and that file.

    Raises:
        ValueError: If no cache file exists and none can be written, or the file just written
            cannot be read back (names the file and why).
    """
    path = cache_path(cache_dir, sha256)
    tensors, damage = _try_map(path, sha256)
    if tensors is not None:
        return tensors, path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            tensors, _ = _try_map(path, sha256)  # another process may have rebuilt it meanwhile
            if tensors is None:
                _remove_stale_builds(path.parent)
                _log.info(
                    "packing the GGUF's weights into %s (once per GGUF)",
                    path,
                    extra={"weights_cache": str(path)},
                )
                _write_atomically(path, build(), sha256)
                if damage is not None:  # one line, once the outcome is known
                    _log.warning(
                        "%s: weights cache damaged (%s); rebuilt it from the GGUF",
                        path,
                        damage,
                        extra={"weights_cache": str(path), "damage": damage},
                    )
                tensors, damage = _try_map(path, sha256)
    except OSError as exc:
        if damage is None:
            hint = (
                "free space there or set GREENSERVE_CACHE_DIR to another directory"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else "set GREENSERVE_CACHE_DIR to a writable directory"
            )
            raise ValueError(
                f"{path}: cannot write the weights cache in {path.parent}: "
                f"{exc.strerror or exc} ({hint})"
            ) from None
        # A damaged file that cannot be replaced is never mapped: this process packs in memory.
        _log.warning(
            "%s: weights cache damaged (%s) and cannot be rebuilt (%s: %s); "
            "packing in memory, each worker its own copy",
            path,
            damage,
            path.parent,
            exc.strerror or exc,
            extra={"weights_cache": str(path), "damage": damage},
        )
        return _read_only(build()), path
    if tensors is None:
        raise ValueError(
            f"{path}: the weights cache file just written cannot be read back ({damage})"
        )
    return tensors, path


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """Return the SHA-256 (lower-case hex) of tensors: names, dtypes, shapes and bytes.

    Each tensor is hashed on its own (in parallel threads), then the per-tensor digests in name
    order, so the result does not depend on how a file lays the tensors out.

    Args:
        tensors: Name -> C-contiguous array (any dtype, any shape).

    Returns:
        64 lower-case hex digits.
    """

    def one(name: str) -> bytes:
        array = tensors[name]
        h = hashlib.sha256(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        return h.digest()

    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        digests = list(pool.map(one, names))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _read_only(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Mark in-memory tensors read-only, as mapped ones are."""
    for array in tensors.values():
        array.flags.writeable = False
    return tensors


def _identity(path: Path) -> tuple[int, ...]:
    """Return what names one version of a file: device, inode, size, mtime and ctime (ns)."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _try_map(path: Path, sha256: str) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """Map the cache file if it is complete and matches; else say why not.

    Returns:
        ``(tensors, None)`` for a good file; ``(None, None)`` when there is no file;
        ``(None, why)`` for a damaged one (``why`` in a few words, for the log).
    """
    if not path.exists():
        return None, None
    if not path.is_file():
        return None, "not a regular file"
    try:
        identity = _identity(path)
        tensors = _map(path)
    except (ValueError, OSError) as exc:
        return None, f"unreadable: {exc}"  # truncated or a bad header: rebuilt, never served
    metadata = _metadata(path) or {}
    expected = _expected_metadata(sha256)
    recorded = metadata.pop(_DIGEST_KEY, None)
    if metadata != expected:
        return None, f"metadata {metadata} is not {expected}"
    if recorded is None:
        return None, "no content digest recorded"
    if _verified.get(str(path)) != identity:
        actual = tensors_digest(tensors)
        if actual != recorded:
            return None, f"content digest {actual[:16]}… is not the recorded {recorded[:16]}…"
        _verified[str(path)] = identity
    return tensors, None


def _map(path: Path) -> dict[str, np.ndarray]:
    """Check a cache file's header and return its arrays as read-only views of one memory map.

    Raises:
        ValueError: If the header breaks a rule of the safetensors format or names a dtype other
            than the packed arrays' (see :func:`model.files.check_safetensors_header`).
        OSError: If the file cannot be read.
    """
    head, size = read_safetensors_head(path)
    widths = {name: dtype.itemsize for name, dtype in _DTYPES.items()}
    entries, data_start = check_safetensors_header(head, path, size, widths)
    raw = np.asarray(np.memmap(path, dtype=np.uint8, mode="r")) if entries else None
    return {
        e.name: raw[data_start + e.begin : data_start + e.end]
        .view(_DTYPES[e.dtype])
        .reshape(e.shape)
        for e in entries
    }


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
    metadata = {**_expected_metadata(sha256), _DIGEST_KEY: tensors_digest(tensors)}
    try:
        try:
            safetensors.numpy.save_file(tensors, str(tmp), metadata=metadata)
        except safetensors.SafetensorError as exc:  # its I/O errors (a full disk) are not OSErrors
            raise _os_error(exc, sum(a.nbytes for a in tensors.values())) from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # Read-only for everyone (workers may run as another user than the builder): the file
        # is mapped by running servers and must never be changed in place.
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _os_error(exc: Exception, nbytes: int) -> OSError:
    """Return safetensors' write error as the ``OSError`` it wraps (its ``os error N``), naming
    the bytes the file needs, so a full disk is one line like an unwritable directory."""
    found = re.search(r"os error (\d+)", str(exc))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, f"{os.strerror(code)}; the file needs {nbytes / 1e6:.0f} MB")


def _remove_stale_builds(directory: Path) -> None:
    """Remove the build directories of builders that died (call with the lock held)."""
    for stale in directory.glob(f"{BUILD_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in directory.glob(".*.safetensors.*.tmp"):  # left by builds before build dirs
        stale.unlink(missing_ok=True)
    # files of other format versions are never read again (a running server that maps one keeps
    # its pages: unlinking removes only the name); version 2's float32 were 5.6x the GGUF
    for old in directory.glob("*.v*.safetensors"):
        if not old.name.endswith(f".v{FORMAT_VERSION}.safetensors"):
            old.unlink(missing_ok=True)
