"""Check an installed (non-editable) greenserve: every module of the source tree imports from it.

Run with the throwaway environment's Python, from outside the repository, given the repository:
``python check_wheel.py REPO``. A subpackage or data file missing from pyproject's package list
fails here, as it would fail a user who installs the wheel.
"""

import importlib
import sys
from pathlib import Path

PACKAGES = ("model", "wsgi_app", "telemetry")


def source_modules(repo: Path) -> list[str]:
    """Return the dotted name of every module of the packages in the source tree."""
    names = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def main(repo: Path) -> int:
    """Import every source module from the installed copy and load the packaged model."""
    site = Path(importlib.import_module("model").__file__).parent.parent
    if site == repo.resolve():
        print(f"model imports from the source tree {repo}, not from an installed wheel")
        return 1
    for name in source_modules(repo):
        module = importlib.import_module(name)
        if not Path(module.__file__).is_relative_to(site):
            print(f"{name} imports from {module.__file__}, outside {site}")
            return 1
    from model.loader import load_model

    loaded = load_model()
    print(
        f"{len(source_modules(repo))} modules import from {site}; default model {loaded.checksum}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
