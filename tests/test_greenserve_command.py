"""The installed ``greenserve`` command: a non-editable wheel in its own virtualenv serves the embedded
default model when started from an unrelated folder, and ``greenserve --help`` names every flag's
environment variable."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from model import __version__
from tests.installed import ROOT, import_paths, make_venv
from tests.server import GunicornServer
from wsgi_app.cli import FLAGS


@pytest.fixture(scope="module")
def installed(greenserve_wheel, tmp_path_factory) -> Path:
    """The ``bin`` folder of a virtualenv holding the freshly built wheel."""
    return make_venv(tmp_path_factory.mktemp("venv") / "greenserve", greenserve_wheel)


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    """A folder with nothing of the project in it (the user's home, say)."""
    return tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def server(installed, elsewhere, tmp_path_factory) -> Iterator[GunicornServer]:
    srv = GunicornServer(
        tmp_path_factory.mktemp("greenserve-log"),
        command=[str(installed / "greenserve"), "--log-level", "info"],
        cwd=elsewhere,
    )
    srv.env.pop("VIRTUAL_ENV", None)
    with srv:
        yield srv


def test_the_wheel_is_what_runs(installed, elsewhere):
    site = installed.parent
    for package, path in import_paths(installed, elsewhere).items():
        assert Path(path).is_relative_to(site), (package, path)


def test_installed_command_serves_the_default_model(server):
    assert "Using worker: wsgi_app.server.worker.GeventWorker" in server.log_text()
    status, headers, body = server.complete(
        {"model": "bigram", "prompt": "ROMEO:", "max_tokens": 24, "seed": 1}
    )
    assert status == 200, body
    answer = json.loads(body)
    assert answer["model"] == "bigram"
    assert answer["choices"][0]["text"] == SEEDED_ROMEO
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 24, "total_tokens": 30}
    assert headers["x-model-version"].endswith(f"+greenserve-{__version__}")
    status, _, body = server.get("/metrics", port=server.health_port)
    assert (
        status == 200
        and b'greenserve_requests_total{end_reason="finished",endpoint="/v1/completions",'
        b'finish_reason="length",model="bigram",status="200",variant="primary"} 1.0'
        in body
    )


def test_help_names_every_variable(installed, elsewhere):
    out = subprocess.run(
        [str(installed / "greenserve"), "--help"], cwd=elsewhere, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag, env, _ in FLAGS:
        assert f"{flag} {env}" in text and f"[{env}]" in text, flag


def test_one_version_everywhere(installed, elsewhere):
    # model.__version__ is the one source: the wheel's metadata (pyproject's dynamic version) and
    # `greenserve --version` say the same; X-Model-Version and the OTLP scope are checked where they
    # are served (above; tests/test_tracing.py).
    out = subprocess.run(
        [str(installed / "greenserve"), "--version"], cwd=elsewhere, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"greenserve {__version__}\n"
    code = "from importlib.metadata import version; print(version('greenserve'))"
    meta = subprocess.run(
        [str(installed / "python"), "-c", code], cwd=elsewhere, capture_output=True, text=True
    )
    assert meta.stdout.strip() == __version__, meta.stderr
    # The OpenAPI document is served byte for byte, so it holds a copy: it must not drift.
    document = json.loads((ROOT / "wsgi_app" / "openapi.json").read_text())
    assert document["info"]["version"] == __version__


def test_a_bad_flag_value_is_one_line(installed, elsewhere):
    out = subprocess.run(
        [str(installed / "greenserve"), "--port", "80000"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "greenserve: cannot start: PORT must be in 0..65535, got 80000"
    )


# The packaged bigram's answer to "ROMEO:" with seed 1 (the same as from the checkout).
SEEDED_ROMEO = " sen anove?\n****KI d  ly"


def test_greenserve_train_help_names_the_installed_command(installed, elsewhere):
    out = subprocess.run(
        [str(installed / "greenserve-train"), "--help"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: greenserve-train [-h] ARCH ...\n")
    assert "python -m model.train" not in out.stdout
