"""docs/ARCHITECTURE.md checks itself against the code: §2's module map names every module of
``wsgi_app``, ``model`` and ``telemetry`` and nothing that does not exist, and every citation of a
section (``docs/ARCHITECTURE.md §N``, ``ARCHITECTURE §N``) anywhere in the repository names one that
exists. The prose of the code is held to the code too: a dotted name of the project
(``wsgi_app.server.stream_socket.StreamSocket.end_reason``) in a docstring, a comment or a Markdown
document names a module, and in it a name, that exist; and no file cites a ticket number, which no
reader can follow, where the reason belongs.

The map's convention, which these tests read: a bold package path on its own line (``**`wsgi_app/http/`**``)
heads the table after it; the first cell of each row names that package's modules in backticks
(``record.py``; ``llama/forward/config.py`` below ``model/``; several in one cell), or a folder
(``templates/``) or a data file (``openapi.json``); the second cell is the module's one job.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("wsgi_app", "model", "telemetry")
# Not scanned for citations: tool and dependency folders, and bench/results/, which keeps recorded
# runs as they were recorded (their citations are of their day).
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".ruff_cache", ".pytest_cache"}
# and what building and installing leave in the checkout: build/ (the wheel, .ci/run) holds a copy of
# the packages, the egg-info one of the README
SKIP_DIRS |= {"build", "greenserve.egg-info"}
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


# The packages a dotted reference may start with. ``model`` is also the name of many a parameter
# (``model.prefill``) and the prefix of Hugging Face tensor names (``model.layers.3.``), so a name
# under it is read as a reference only when its second part is a module of ``model`` or a name its
# ``__init__`` defines; under the others every dotted name is one.
REFERENCE_ROOTS = ("model", "wsgi_app", "telemetry", "tests", "bench")
_REFERENCE = re.compile(rf"(?<![\w./-])(?:{'|'.join(REFERENCE_ROOTS)})(?:\.[A-Za-z_]\w*)+")
# The same as a path to the module (``server/stream_socket.StreamSocket``, under one of the packages
# or from the root); a path to no module of theirs is a file elsewhere (``deploy/nginx/greenserve.conf``).
_PATH_REFERENCE = re.compile(
    r"(?<![\w./-])((?:[a-z_]\w*/)+[a-z_]\w*)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)
PATH_ROOTS = ("", "wsgi_app.", "model.", "telemetry.")
# A part that is a file suffix makes a file name (``model.safetensors``, ``model.py``), not a reference.
FILE_SUFFIXES = {"py", "json", "md", "safetensors", "gguf", "jinja", "txt", "bin", "toml", "html"}


@cache
def modules_by_name() -> dict[str, Path]:
    """Every module of the packages references may name, by dotted name (a package by its ``__init__``)."""
    out = {}
    for package in REFERENCE_ROOTS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@cache
def _tree(module: str) -> ast.Module:
    path = modules_by_name()[module]
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds (in ``if``/``try``/``with`` blocks too), each to its node."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    for leaf in ast.walk(node.value):
                        if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                            names[leaf.value] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(node, block, []):
                    names.update(
                        _top_level(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])
                    )
    return names


def _class_names(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's own names: its body's, and the attributes its methods set on ``self``."""
    names = _top_level(cls.body)
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                names[target.attr] = node
    return names


def _resolve_in(module: str, parts: list[str]) -> bool:
    """Whether ``parts`` name something in ``module``: a name it binds, a project name it imports
    (followed), or an attribute of a class it defines (its own, or a project base class's).
    What lies outside the project, and names below a class's attributes, are taken as they are."""
    if not parts:
        return True
    names = _top_level(_tree(module).body)
    node = names.get(parts[0])
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom | ast.Import):
        # a name a module only uses is not its to name: the reference names where it is defined,
        # or a module that passes it on (``__all__``, ``import x as x``, a package's ``__init__``)
        return parts[0] in _passed_on(module) and _resolve_import(module, node, parts)
    if isinstance(node, ast.ClassDef) and len(parts) > 1:
        return _resolve_attribute(module, node, parts[1])
    return True


def _passed_on(module: str) -> set[str]:
    """The imported names a module offers as its own: its ``__all__``, the names it imports under
    their own name (``from m import x as x``), and every import of a package's ``__init__``."""
    tree = _tree(module)
    names = _top_level(tree.body)
    offered = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    if isinstance(all_ := names.get("__all__"), ast.Assign):
        offered |= {c.value for c in ast.walk(all_.value) if isinstance(c, ast.Constant)}
    if modules_by_name()[module].name == "__init__.py":
        offered |= {k for k, v in names.items() if isinstance(v, ast.Import | ast.ImportFrom)}
    return offered


def _resolve_import(module: str, node: ast.Import | ast.ImportFrom, parts: list[str]) -> bool:
    """Whether ``parts`` resolve where ``module``'s import of ``parts[0]`` comes from (always, when
    it comes from outside the project, or is ``import x.y``: a module, checked where it is named)."""
    if isinstance(node, ast.Import) or node.level:  # the project imports absolutely
        return True
    if node.module not in modules_by_name():
        return True
    alias = next(a for a in node.names if (a.asname or a.name) == parts[0])
    return resolves(".".join([node.module, alias.name, *parts[1:]]))


def _resolve_attribute(module: str, cls: ast.ClassDef, attribute: str) -> bool:
    if attribute in _class_names(cls):
        return True
    names = _top_level(_tree(module).body)
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            return True  # ``typing.NamedTuple``, ``Generic[T]``...: not followed
        found = names.get(base.id)
        if isinstance(found, ast.ClassDef):
            if _resolve_attribute(module, found, attribute):
                return True
        elif isinstance(found, ast.ImportFrom) and _resolve_import(
            module, found, [base.id, attribute]
        ):
            return True
        elif not isinstance(found, ast.ImportFrom):
            return True  # a builtin base (``Exception``, ``str``): not followed
    return False


def resolves(reference: str) -> bool:
    """Whether a dotted name of the project names a module, or a name in one, that exists."""
    parts = reference.split(".")
    modules = modules_by_name()
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return _resolve_in(".".join(parts[:i]), parts[i:])
    return False


def is_reference(name: str) -> bool:
    """Whether a dotted name found in prose is meant as one of the project's (see REFERENCE_ROOTS)."""
    parts = name.split(".")
    if FILE_SUFFIXES & set(parts[1:]):
        return False
    if parts[0] != "model":
        return True
    return ".".join(parts[:2]) in modules_by_name() or parts[1] in _top_level(_tree("model").body)


def prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and string statement (docstrings) of a Python file, or of
    every line of any other text file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                found.append((node.lineno, node.value.value))
    return sorted(found)


def prose_files() -> list[Path]:
    """The Python files and Markdown documents whose prose may name the project's modules."""
    return [p for p in scanned_files() if p.suffix in (".py", ".md")]


def references(text: str) -> list[tuple[str, list[str]]]:
    """Every reference to the project in a text: ``(as written, the dotted names it may mean)``;
    it resolves when one of them does."""
    found = [(name, [name]) for name in _REFERENCE.findall(text) if is_reference(name)]
    for path, rest in _PATH_REFERENCE.findall(text):
        if FILE_SUFFIXES & set(rest.split(".")):
            continue
        modules = [m for r in PATH_ROOTS if (m := r + path.replace("/", ".")) in modules_by_name()]
        if modules:
            found.append((f"{path}.{rest}", [f"{m}.{rest}" for m in modules]))
    return found


def broken_references(path: Path) -> list[str]:
    """``path:line: name`` for every reference to the project in a file's prose that does not resolve."""
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {written}"
        for line, text in prose(path)
        for written, meanings in references(text)
        if not any(resolves(name) for name in meanings)
    ]


# The number of an issue, task or ticket ("issue", "tasks", "ticket #", then the number): a reader
# cannot follow it (the tracker is not part of the repository); the reason belongs in its place. An
# upstream project's issue named with its project (``cpython#106905``) can be followed and is not
# matched; nor is "issue" as a verb before a count, which reads better as "send 8 requests" anyway.
_TICKET = re.compile(r"\b(?:issue|task|ticket)s?\s+#?\d+", re.IGNORECASE)


def ticket_citations(text: str) -> list[tuple[int, str]]:
    """``(line number, citation)`` of every ticket number cited in a text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in _TICKET.finditer(text)]


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


def test_dotted_references_in_the_code_and_documents_resolve():
    broken = [b for p in prose_files() for b in broken_references(p)]
    assert not broken, f"dotted names of modules or attributes that do not exist: {broken}"


def test_the_reference_check_sees_what_it_checks(tmp_path):
    """A moved class, a gone attribute and a module that never was are caught; a class's attribute set
    in a method, a name imported from another module, a base class's method and the ``model``
    parameter are not."""
    assert resolves("wsgi_app.server.stream_socket.StreamSocket.end_reason")
    assert not resolves("wsgi_app.server.worker.StreamSocket")
    assert not resolves("wsgi_app.api.fields.no_such_name")
    assert not resolves("wsgi_app.no_such_module.thing")
    assert resolves("wsgi_app.app.create_app") and resolves("model.__version__")
    assert resolves("model.loader.can_ever_fit")  # imported there from the KV cache's module
    assert resolves("model.llama.serving.scheduler.BatchScheduler.step")
    assert not resolves("model.llama.serving.scheduler.BatchScheduler.no_such_method")
    assert is_reference("model.llama.scheduler") and not is_reference("model.prefill")
    assert not is_reference("model.safetensors.index.json") and not is_reference("model.layers")
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""See :class:`wsgi_app.server.worker.StreamSocket`."""\n'
        "x = 1  # as model.llama.scheduler.BatchScheduler does, and model.decode\n"
        'y = "wsgi_app.not_a_reference_in_code"\n'
    )
    found = [(line, name) for line, text in prose(sample) for name, _ in references(text)]
    assert sorted(found) == [
        (1, "wsgi_app.server.worker.StreamSocket"),
        (2, "model.llama.scheduler.BatchScheduler"),
    ]
    assert broken_references(sample) == [
        f"{sample}:1: wsgi_app.server.worker.StreamSocket",
        f"{sample}:2: model.llama.scheduler.BatchScheduler",
    ]
    assert references(
        "`server/worker.StreamSocket.write_chunks`, `deploy/nginx/greenserve.conf`"
    ) == [
        (
            "server/worker.StreamSocket.write_chunks",
            ["wsgi_app.server.worker.StreamSocket.write_chunks"],
        )
    ]
    assert len(prose_files()) > 300


def test_nothing_cites_a_ticket_number():
    cited = [
        f"{p.relative_to(ROOT)}:{line}: {citation}"
        for p in scanned_files()
        for line, citation in ticket_citations(p.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not cited, f"ticket numbers a reader cannot follow (say the reason instead): {cited}"


def test_the_ticket_check_sees_what_it_checks():
    # spelled in pieces, so this file does not cite what it tests
    issue, task, ticket = "iss" + "ue", "ta" + "sk", "tick" + "et"
    text = f'# ({issue} 31, item 7)\n"""{task}s 3-4 and {ticket} #12"""\n{issue.title()} 39: x'
    assert ticket_citations(text) == [
        (1, f"{issue} 31"),
        (2, f"{task}s 3"),
        (2, f"{ticket} #12"),
        (3, f"{issue.title()} 39"),
    ]
    assert (
        ticket_citations("cpython#106905; a queue of tasks; the issues; item 3; 12 tickets") == []
    )
