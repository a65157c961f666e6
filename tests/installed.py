"""greenserve as an operator installs it: a wheel built from the checkout, in a virtualenv of its own.

The wheel is built non-editable (``pip wheel --no-deps .``) and installed without dependencies into a
fresh virtualenv; the dependencies are the test environment's own, reached through a ``.pth`` line
placed after the new environment's site-packages (so the wheel's ``wsgi_app``, ``model`` and
``telemetry`` come first and the checkout is never on the path). gunicorn is installed there too, for
its ``bin/gunicorn`` script, which ``greenserve`` execs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    # Without PYTHONPATH: a checkout on it (a worktree's PYTHONPATH=$PWD) holds the greenserve.egg-info
    # that building the wheel leaves there, and pip would take the wheel as installed already.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def build_wheel(out: Path) -> Path:
    """Build the project's wheel into ``out`` and return its path."""
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (wheel,) = out.glob("greenserve-*.whl")
    return wheel


def make_venv(where: Path, wheel: Path) -> Path:
    """Create a virtualenv at ``where`` with ``wheel`` (and gunicorn's script); return its ``bin``.

    Raises:
        AssertionError: a step failed, with its output.
    """
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)])
    python = where / "bin" / "python"
    _run(
        [
            sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
            str(wheel), f"gunicorn=={version('gunicorn')}",
        ]
    )  # fmt: skip
    deps = sysconfig.get_paths()["purelib"]  # this test environment's site-packages
    (installed_site(where / "bin") / "zz_test_dependencies.pth").write_text(deps + "\n")
    return where / "bin"


def installed_site(bin_dir: Path) -> Path:
    """The ``site-packages`` folder of the virtualenv whose ``bin`` is ``bin_dir``."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run([str(bin_dir / "python"), "-c", code]).strip())


def import_paths(bin_dir: Path, cwd: Path) -> dict[str, str]:
    """Where the venv's Python, started in ``cwd``, imports the three packages from."""
    code = "import model, telemetry, wsgi_app; print(model.__file__, telemetry.__file__, wsgi_app.__file__)"
    paths = _run([str(bin_dir / "python"), "-c", code], cwd=cwd).split()
    return dict(zip(("model", "telemetry", "wsgi_app"), paths, strict=True))
