"""A canary split across two hosts behind one real nginx (the example site, round robin): both hosts
share ``VARIANT_SALT``, so a client gets the same variant whichever host answers, and a 10 % canary
lands within 10 % ± 3 over 1,000 clients.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from model import __version__
from model.loader import load_model
from tests.modelfiles import write_trained
from tests.server import GunicornServer
from tests.services import NginxServer

pytestmark = pytest.mark.services

CLIENTS = 1_000
MODELS_TOML = """
[models.loop]
source = "xyz"

[models.loop.variants.canary]
source = "xzy"
weight = 10
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[tuple[NginxServer, list[GunicornServer], Path]]:
    """nginx -> two gunicorns (1 worker each), the same models file and salt."""
    root = tmp_path_factory.mktemp("canary-models")
    write_trained(root / "xyz", b"xyz")
    write_trained(root / "xzy", b"xzy")
    (root / "models.toml").write_text(MODELS_TOML)
    env = {"MODELS_FILE": str(root / "models.toml"), "VARIANT_SALT": "fleet-salt"}
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(GunicornServer(tmp_path_factory.mktemp(f"host{i}"), env))
            for i in (1, 2)
        ]
        nginx = stack.enter_context(
            NginxServer(tmp_path_factory.mktemp("nginx"), [s.port for s in servers])
        )
        yield nginx, servers, root


def served(srv: GunicornServer) -> float:
    """Completions this host answered with 200 (its own metrics)."""
    _, _, body = srv.get("/metrics", port=srv.health_port)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("greenserve_requests_total{") and 'status="200"' in line
    )


def test_each_client_gets_its_variant_on_either_host(hosts):
    nginx, servers, root = hosts
    canary = f"{load_model(root / 'xzy').checksum[:16]}+greenserve-{__version__}"
    primary = f"{load_model(root / 'xyz').checksum[:16]}+greenserve-{__version__}"
    got: dict[int, set[str]] = {}
    for _ in range(2):  # round robin: a client's two requests reach both hosts
        for n in range(CLIENTS):
            body = {"model": "loop", "prompt": "x", "max_tokens": 1, "user": f"client-{n}"}
            status, headers, raw = nginx.request(
                "POST",
                "/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            assert status == 200, raw
            got.setdefault(n, set()).add(headers["x-model-version"])
    assert all(len(versions) == 1 for versions in got.values())  # sticky across hosts
    share = 100.0 * sum(versions == {canary} for versions in got.values()) / CLIENTS
    assert 7.0 <= share <= 13.0, share
    assert {v for versions in got.values() for v in versions} == {primary, canary}
    counts = [served(s) for s in servers]
    assert min(counts) >= CLIENTS / 2, counts  # both hosts answered a large share
