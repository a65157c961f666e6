"""A models file edited and applied by ``SIGHUP``: the master checks it before the new workers start;
a good file is served by them (a model added, one removed), a bad one is not applied, the server keeps
serving the last good one and the log says why.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from model import __version__
from model.bigram.train import train_bigram, write_model
from model.loader import load_model
from tests.server import GunicornServer, wait_until
from tests.sse import EventReader, sse_json

FIRST = '[models.xyz]\nsource = "xyz"\n'
SECOND = 'default = "xzy"\n[models.xzy]\nsource = "xzy"\naliases = ["xyz"]\n'


def write_trained(directory: Path, text: bytes) -> Path:
    """Write a bigram trained on ``text`` repeated into ``directory``."""
    write_model(directory, train_bigram([text * 200]), {"trained_on": [text.decode()]})
    return directory


def listed(srv: GunicornServer) -> list[str]:
    """The ids ``/v1/models`` lists."""
    return [card["id"] for card in json.loads(srv.get("/v1/models")[2])["data"]]


def served_version(srv: GunicornServer, model: str) -> str:
    """The ``X-Model-Version`` of a completion for ``model``."""
    status, headers, raw = srv.complete({"model": model, "prompt": "x", "max_tokens": 1})
    assert status == 200, raw
    return headers["x-model-version"]


def test_a_reload_applies_a_good_file_and_keeps_the_last_good_one(tmp_path):
    write_trained(tmp_path / "xyz", b"xyz")
    write_trained(tmp_path / "xzy", b"xzy")
    versions = {
        name: f"{load_model(tmp_path / name).checksum[:16]}+greenserve-{__version__}"
        for name in ("xyz", "xzy")
    }
    models_file = tmp_path / "models.toml"
    models_file.write_text(FIRST)
    srv = GunicornServer(tmp_path / "run", {"MODELS_FILE": str(models_file)}, workers=2).start()
    try:
        assert listed(srv) == ["xyz"]
        assert served_version(srv, "xyz") == versions["xyz"]

        # A good edit: xzy replaces xyz, which stays a name (an alias) of the new default.
        models_file.write_text(SECOND)
        srv.signal(signal.SIGHUP)
        wait_until(lambda: listed(srv) == ["xzy", "xyz"], 60, lambda: srv.log_tail())
        srv.wait_workers(2)
        for _ in range(4):  # both new workers serve the new file
            assert served_version(srv, "xyz") == versions["xzy"]
        assert "models file applied" in srv.log_text()

        # A bad edit: not applied; the new workers serve the last good file.
        models_file.write_text('[models.broken]\nsource = "nowhere"\n')
        srv.signal(signal.SIGHUP)
        why = (
            f"models file not applied, the last good one is served: MODELS_FILE ({models_file}): "
            f"models.broken.source: '{tmp_path / 'nowhere'}' does not exist"
        )
        wait_until(lambda: why in srv.log_text(), 60, lambda: srv.log_tail())
        pids = srv.wait_workers(2)
        assert srv.proc is not None and srv.proc.poll() is None  # the master still runs
        assert listed(srv) == ["xzy", "xyz"]
        for _ in range(4):
            assert served_version(srv, "xyz") == versions["xzy"]
        assert len(pids) == 2
    finally:
        srv.stop()


def test_a_reload_drops_none_of_32_running_streams(tmp_path):
    """32 streams (300 tokens at a test-only 20 ms a token: 6 s each) run while a reload replaces
    their model: every one ends whole (its exact text, ``length``, ``[DONE]``) on the old workers,
    and the new workers serve the new file."""
    write_trained(tmp_path / "xyz", b"xyz")
    write_trained(tmp_path / "xzy", b"xzy")
    models_file = tmp_path / "models.toml"
    models_file.write_text(FIRST)
    env = {"MODELS_FILE": str(models_file), "GREENSERVE_FAULTS": "slow_step_s=0.02"}
    srv = GunicornServer(tmp_path / "run", env, workers=2).start()
    body = {"model": "xyz", "prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True}
    streams = []
    try:
        for _ in range(32):
            reader = EventReader(srv.port, body)
            assert reader.open().status == 200
            first = reader.next_frame()
            while not first.startswith(b"data: "):  # the ": ok" comment comes first
                first = reader.next_frame()
            streams.append((reader, first))
        models_file.write_text(SECOND)
        srv.signal(signal.SIGHUP)
        # The new workers serve (and gunicorn has sent the old ones SIGTERM) while the streams,
        # 6 s each, still run on the old workers.
        wait_until(lambda: srv.log_text().count('"message": "serving"') == 4, 60, srv.log_tail)
        for reader, first in streams:
            assert reader.resp is not None
            chunks = sse_json(first + b"\n" + reader.resp.read())  # the frame ends with "\\n"
            text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
            assert text == "yzx" * 100
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: listed(srv) == ["xzy", "xyz"], 60, lambda: srv.log_tail())
    finally:
        for reader, _ in streams:
            reader.close()
        srv.stop()
