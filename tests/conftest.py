"""Shared fixtures: real gunicorn servers on the succ test model and on the packaged default model,
and ``serve``, which starts servers for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gguffiles import (  # noqa: F401 (session fixtures)
    gguf_cache_dir,
    smollm2,
    smollm2_data,
    smollm2_gguf,
)
from tests.installed import build_wheel
from tests.modelfiles import write_succ_model
from tests.server import GunicornServer

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


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., GunicornServer]]:
    """Return ``serve(workers=1, health_port=True, args=(), **env)``: a started server, stopped at teardown.

    Each server gets its own directory under ``tmp_path`` (``server-0``, ``server-1``, ... in start
    order) for its log and history database.
    """
    with contextlib.ExitStack() as stack:

        def start(
            *, workers: int = 1, health_port: bool = True, args: tuple[str, ...] = (), **env: str
        ) -> GunicornServer:
            workdir = tmp_path / f"server-{len(servers)}"
            srv = GunicornServer(workdir, env, workers=workers, health_port=health_port, args=args)
            servers.append(srv)
            return stack.enter_context(srv)

        servers: list[GunicornServer] = []
        yield start


@pytest.fixture(scope="session")
def greenserve_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once (``pip wheel --no-deps .``, not editable)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))
