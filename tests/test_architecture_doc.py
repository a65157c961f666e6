"""docs/ARCHITECTURE.md checks itself against the code: §2's module map names every module of
``wsgi_app``, ``model`` and ``telemetry`` and nothing that does not exist, and every citation of a
section (``docs/ARCHITECTURE.md §N``, ``ARCHITECTURE §N``) anywhere in the repository names one that
exists.

The map's convention, which these tests read: a bold package path on its own line (``**`wsgi_app/http/`**``)
heads the table after it; the first cell of each row names that package's modules in backticks
(``record.py``; ``llama/forward/config.py`` below ``model/``; several in one cell), or a folder
(``templates/``) or a data file (``openapi.json``); the second cell is the module's one job.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("wsgi_app", "model", "telemetry")
# Not scanned for citations: tool and dependency folders, and bench/results/, which keeps recorded
# runs as they were recorded (their citations are of their day).
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".ruff_cache", ".pytest_cache"}
SKIP_UNDER = (ROOT / "bench" / "results",)

_HEADING = re.compile(r"^## §(\d+) ", re.M)
_PACKAGE = re.compile(r"^\*\*`([\w/]+/)`\*\*")
_CITATION = re.compile(r"ARCHITECTURE(?:\.md)?\b")
# The section numbers right after a citation: "§6", "§2, §3 and §8", "§3–§5", also across a line
# break inside a comment ("#", "//", "*") or a docstring.
_CITED = re.compile(r"(?:[\s#*/]|,|and|to|–|-)*§(\d+)")


def sections(text: str) -> dict[int, str]:
    """Return each ``## §N`` section's text (heading line included) by its number."""
    starts = [(int(m.group(1)), m.start()) for m in _HEADING.finditer(text)]
    ends = [s for _, s in starts[1:]] + [len(text)]
    return {n: text[s:e] for (n, s), e in zip(starts, ends, strict=True)}


def module_map(section: str) -> dict[str, str]:
    """Return ``{path under the root: its job}`` for every row of §2's tables (see the module docstring).

    Raises:
        AssertionError: a table row comes before any package heading, or names nothing in backticks.
    """
    rows: dict[str, str] = {}
    package: str | None = None
    for line in section.splitlines():
        if heading := _PACKAGE.match(line):
            package = heading.group(1)
            continue
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("module", "routes") or cells[1] in ("job", "routes"):
            continue  # the header row
        assert package is not None, f"a §2 table row before any **`package/`** heading: {line}"
        names = re.findall(r"`([^`]+)`", cells[0])
        assert names, f"a §2 row names no module in backticks: {line}"
        for name in names:
            rows[package + name] = cells[1]
    return rows


def code_modules() -> set[str]:
    """Every module of the three packages, as a path under the root (``__init__.py`` files left out:
    the map may give a package's entry point but need not)."""
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def scanned_files() -> list[Path]:
    """Every text file of the repository that may cite the document (itself included)."""
    out = []
    for p in ROOT.rglob("*"):
        if not p.is_file() or SKIP_DIRS & set(p.relative_to(ROOT).parts):
            continue
        if any(p.is_relative_to(under) for under in SKIP_UNDER) or p.stat().st_size > 2_000_000:
            continue
        data = p.read_bytes()
        if b"\0" not in data:
            out.append(p)
    return out


def citations(text: str) -> list[tuple[int, int]]:
    """Return ``(line number, section number)`` for every section cited after ``ARCHITECTURE``."""
    found = []
    for m in _CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        pos = m.end()
        while cited := _CITED.match(text, pos):
            found.append((line, int(cited.group(1))))
            pos = cited.end()
    return found


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_sections_are_numbered_one_to_n(doc):
    assert list(sections(doc)) == list(range(1, len(sections(doc)) + 1))


def test_every_module_is_in_the_module_map(doc):
    mapped = module_map(sections(doc)[2])
    missing = sorted(code_modules() - set(mapped))
    assert not missing, f"modules missing from docs/ARCHITECTURE.md §2: {missing}"


def test_the_module_map_names_only_what_exists(doc):
    mapped = module_map(sections(doc)[2])
    gone = sorted(path for path in mapped if not (ROOT / path).exists())
    assert not gone, f"docs/ARCHITECTURE.md §2 names what does not exist: {gone}"
    # Paths in §2's prose (``wsgi_app/server/worker.py``) are held to the same rule.
    prose = re.findall(r"`((?:wsgi_app|model|telemetry|tests|bench)/[\w/.]+)`", sections(doc)[2])
    assert not [p for p in prose if not (ROOT / p).exists()]


def test_every_module_has_a_job(doc):
    empty = [path for path, job in module_map(sections(doc)[2]).items() if not job]
    assert not empty


def test_every_cited_section_exists(doc):
    exists = set(sections(doc))
    cited = [
        (f"{p.relative_to(ROOT)}:{line}", n)
        for p in scanned_files()
        for line, n in citations(p.read_text(encoding="utf-8", errors="replace"))
    ]
    # The document's own cross references ("(§5, §15)", "§3–§10") name its sections too; "§3.2"
    # is another document's numbering.
    cited += [("docs/ARCHITECTURE.md", int(n)) for n in re.findall(r"§(\d+)(?![.\d])", doc)]
    bad = [f"{where}: §{n}" for where, n in cited if n not in exists]
    assert not bad, f"citations of sections docs/ARCHITECTURE.md does not have: {bad}"


def test_the_checks_see_what_they_check():
    """The parsers find what they look for: a citation across a comment's line break, a list of
    sections, and a map row under its package (so an empty result is never a silent pass)."""
    text = "see docs/ARCHITECTURE.md\n# §14 and ARCHITECTURE §2, §3 and §8; ARCHITECTURE.md alone"
    assert citations(text) == [(1, 14), (2, 2), (2, 3), (2, 8)]
    section = "**`wsgi_app/http/`** (x)\n\n| module | job |\n|---|---|\n| `a.py`, `b.py` | both |\n"
    assert module_map(section) == {"wsgi_app/http/a.py": "both", "wsgi_app/http/b.py": "both"}
    assert len(code_modules()) > 50 and len(scanned_files()) > 200
