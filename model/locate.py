"""Where a model is: the GGUF file ``MODEL_DIR`` names, or that it names a model directory, and a
clear one-line reason when it names neither (a missing path, a dangling symlink, a symlink loop, a
FIFO or device, an empty directory, several ``.gguf`` files).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from model.files import CONFIG_NAME, file_kind
from model.llama.formats.gguf import GGUF_SUFFIX


def gguf_file(model_dir: str | os.PathLike) -> Path | None:
    """Return the GGUF file ``model_dir`` names: itself, or the one ``.gguf`` of a directory.

    Args:
        model_dir: What ``MODEL_DIR`` names: a model directory or a ``.gguf`` file.

    Returns:
        The ``.gguf`` file, or None when ``model_dir`` is a model directory (``config.json``).

    Raises:
        ValueError: If ``model_dir`` does not exist (a dangling symlink says where it points, a
            symlink loop shows the loop), is neither a directory nor a regular file (a FIFO, a
            device), is a file not named ``.gguf``, or a directory without ``config.json`` holds
            several ``.gguf`` files or none.
    """
    path = Path(model_dir)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(_missing(path, exc)) from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        # Reading a FIFO or a device would wait for ever (or read garbage): refused at once.
        raise ValueError(
            f"{path}: is {file_kind(mode)}, not a model directory or a {GGUF_SUFFIX} file"
        )
    if stat.S_ISREG(mode):
        if path.suffix.lower() == GGUF_SUFFIX:
            return path
        raise ValueError(
            f"{path}: is a file but not a {GGUF_SUFFIX} file; "
            f"name a model directory (with {CONFIG_NAME}) or a {GGUF_SUFFIX} file"
        )
    if (path / CONFIG_NAME).exists():
        return None
    entries = list(path.iterdir())
    found = sorted(p for p in entries if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path}: holds {len(found)} .gguf files ({names}); name one of them")
    if not found:
        what = "is an empty directory:" if not entries else f"holds {len(entries)} entries but"
        raise ValueError(
            f"{path}: {what} no {CONFIG_NAME} and no {GGUF_SUFFIX} file: not a model directory"
        )
    return found[0]


def _missing(path: Path, exc: OSError) -> str:
    """Say why ``path`` cannot be found: missing, a dangling symlink, a symlink loop, no access."""
    if exc.errno == errno.ELOOP:
        return f"{path}: is a symlink loop ({_symlink_chain(path)}): it never reaches a file"
    if path.is_symlink():
        target = os.readlink(path)
        return f"{path}: does not exist (a symlink to {target}, which is missing)"
    if isinstance(exc, FileNotFoundError):
        return f"{path}: does not exist"
    return f"{path}: cannot be read: {exc.strerror or exc}"


def _symlink_chain(path: Path, most: int = 8) -> str:
    """Return ``a -> b -> a``: the first links of a symlink chain, for a loop's message."""
    chain, seen, current = [str(path)], {str(path)}, path
    while current.is_symlink() and len(chain) <= most:
        current = current.parent / os.readlink(current)
        chain.append(str(current))
        if str(current) in seen:
            break
        seen.add(str(current))
    return " -> ".join(chain)
