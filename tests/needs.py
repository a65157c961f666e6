"""What a test needs from the machine or the shared data, and what happens without it: a skip on a
developer's machine, so that a newcomer's first run is green, and a failure under CI (``CI`` set),
where ``.ci/run`` installs every package and the shared data is laid out."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test for ``reason``; under CI, fail it instead.

    Raises:
        pytest.fail.Exception: under CI.
        pytest.skip.Exception: elsewhere.
    """
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def binary(name: str, package: str) -> str:
    """Return the path of program ``name`` on ``PATH``; without it, ``unavailable`` (install the
    Debian package ``package``)."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} not found: install the Debian package {package} (.ci/run does)")
    return path
