"""Shared fixtures: real gunicorn servers on the succ test model and on the packaged default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.installed import build_wheel
from tests.modelfiles import write_succ_model
from tests.server import GunicornServer


@pytest.fixture(scope="session")
def succ_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding the DESIGN §2 "succ" bigram (``W[i][(i+1) % 256] = 2.0``)."""
    return write_succ_model(tmp_path_factory.mktemp("succ"))


@pytest.fixture(scope="session")
def succ_server(
    succ_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """One gunicorn (1 gevent worker, API + health ports) serving the succ model."""
    srv = GunicornServer(tmp_path_factory.mktemp("succ-server"), {"MODEL_DIR": str(succ_dir)})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    """One gunicorn serving the packaged default model (``MODEL_DIR`` unset)."""
    srv = GunicornServer(tmp_path_factory.mktemp("default-server"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def greenserve_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once (``pip wheel --no-deps .``, not editable)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))
