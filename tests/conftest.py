"""Shared fixtures: the test models, real gunicorn servers on them, and the server factories.

Servers that several modules need with the same settings are session presets here (``succ_server``,
``default_server``, ``smollm2_server``); a server with a module's own settings comes from
``serve_module`` (one per module), one for a single test from ``serve``. Both factories give each
server its own directory and stop it at teardown, and nothing else in the suite builds a
``GunicornServer`` by hand unless it needs what the factories do not give (another launcher, a
start that must fail, a restart on the same history database). ``family`` runs what asks for it
once per model family (its settings go to a factory); ``browser`` and ``page`` are the page tests'
Chromium.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.collector import FakeCollector
from tests.gguffiles import (  # noqa: F401 (session fixtures)
    gguf_cache_dir,
    smollm2,
    smollm2_data,
    smollm2_gguf,
    smollm2_server,
)
from tests.installed import build_wheel
from tests.llamafiles import convert_stories
from tests.modelfiles import write_succ_model
from tests.server import GunicornServer

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

    from tests.browser import Watch

# A test that asks for one of these (directly or through another fixture) needs the SmolLM2 GGUF or
# its llama.cpp reference outputs: it is marked ``gguf`` without saying so itself.
GGUF_FIXTURES = frozenset({"smollm2_gguf", "smollm2_data"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the SmolLM2 files ``gguf`` (``-m "not gguf"`` leaves them out)."""
    for item in items:
        if GGUF_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gguf)


@pytest.fixture(scope="session")
def succ_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding the "succ" bigram (``W[i][(i+1) % 256] = 2.0``, all else 0)."""
    return write_succ_model(tmp_path_factory.mktemp("succ"))


@pytest.fixture(scope="session")
def succ_server(
    succ_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """One gunicorn (1 gevent worker, API + health ports) serving the succ model."""
    with GunicornServer(
        tmp_path_factory.mktemp("succ-server"), {"MODEL_DIR": str(succ_dir)}
    ) as srv:
        yield srv


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    """One gunicorn serving the packaged default model (``MODEL_DIR`` unset)."""
    with GunicornServer(tmp_path_factory.mktemp("default-server")) as srv:
        yield srv


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K (the shared llama2.c checkpoint) converted once into a Hugging Face Llama folder;
    skips (fails under CI) without the shared data."""
    return convert_stories(tmp_path_factory.mktemp("stories260K"))


@pytest.fixture(scope="module", params=["bigram", "stories260K"])
def family(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """Each model family in turn, as ``(name, server settings)``: the packaged bigram
    (``MODEL_DIR`` unset), then stories260K (``stories_dir``); what asks for it runs once per family."""
    if request.param == "bigram":
        return "bigram", {}
    return "stories260K", {"MODEL_DIR": str(request.getfixturevalue("stories_dir"))}


Serve = Callable[..., GunicornServer]


@contextlib.contextmanager
def _servers(root: Path) -> Iterator[Serve]:
    """Yield ``start(workers=1, health_port=True, args=(), reuse_port=False, **env)``; stop what it
    started on exit.

    Each server gets its own directory under ``root`` (``server-0``, ``server-1``, ... in start
    order) for its log and history database.
    """
    with contextlib.ExitStack() as stack:
        servers: list[GunicornServer] = []

        def start(
            *,
            workers: int = 1,
            health_port: bool = True,
            args: tuple[str, ...] = (),
            reuse_port: bool = False,
            **env: str,
        ) -> GunicornServer:
            workdir = root / f"server-{len(servers)}"
            srv = GunicornServer(
                workdir,
                env,
                workers=workers,
                health_port=health_port,
                args=args,
                reuse_port=reuse_port,
            )
            servers.append(srv)
            return stack.enter_context(srv)

        yield start


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Return ``serve(workers=1, health_port=True, args=(), reuse_port=False, **env)``: a started
    server (env: the server's settings), stopped at the test's teardown."""
    with _servers(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def serve_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """``serve`` for a module's own server: stopped when the module's tests are done.

    A fixture that needs something to outlive the server (a fake collector that receives its last
    spans) asks for that fixture before ``serve_module``: pytest tears down in reverse order.
    """
    with _servers(tmp_path_factory.mktemp("module-servers")) as start:
        yield start


@pytest.fixture(scope="session")
def greenserve_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once (``pip wheel --no-deps .``, not editable)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """A headless Chromium for a module's page tests (``tests.browser``), closed after them."""
    from tests.browser import launch  # Playwright is imported by the browser tests only

    yield from launch()


@pytest.fixture
def page(browser: Browser) -> Iterator[tuple[Page, Watch]]:
    """A wide, light page of ``browser`` with its :class:`tests.browser.Watch`, closed after the
    test."""
    from tests.browser import new_page

    yield from new_page(browser)


@pytest.fixture(scope="module")
def collector() -> Iterator[FakeCollector]:
    """A fake OTLP collector for a module's server (``OTEL_EXPORTER_OTLP_ENDPOINT=collector.url``);
    asked for before ``serve_module``, it outlives the server and so receives its last spans."""
    with FakeCollector() as col:
        yield col
