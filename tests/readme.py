"""The README's code, as written: its fenced blocks by language, one block picked by what it contains,
and a Python block run against a test server (the README's ``http://localhost:8000`` replaced by the
server's URL)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://localhost:8000"  # the address every README example uses


def blocks(language: str) -> list[str]:
    """Return the README's fenced blocks of ``language`` (```` ```sh ````...), in order, as written."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def readme_block(language: str, marker: str) -> str:
    """Return the README's one fenced ``language`` block that contains ``marker``.

    Raises:
        ValueError: no block, or more than one, contains it.
    """
    (block,) = [b for b in blocks(language) if marker in b]
    return block


def run_readme_python(marker: str, url: str) -> subprocess.CompletedProcess:
    """Run the README's Python block that contains ``marker`` against the server at ``url``; return the
    finished process (its output as text).

    Raises:
        subprocess.CalledProcessError: the block exited non-zero.
        subprocess.TimeoutExpired: it ran over 60 s.
    """
    code = readme_block("python", marker)
    return subprocess.run(
        [sys.executable, "-c", code.replace(README_URL, url)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
