"""A models file edited and applied by ``SIGHUP``: the master checks it before the new workers start;
a good file is served by them (a model added, one replaced, one removed), a bad one is not applied,
the server keeps serving the last good one and the log says why.

A reload is a hand-off (``wsgi_app.server.handoff``): the old workers serve until a new one has
loaded its models, and a new one accepts only once every old one has closed its listeners; it logs
"Worker accepts, generation 1" then. So a client sees the old version, then the new one, never the
old again, and every connection it opens after that line is answered by the new version.
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import dataclass

from model import __version__
from model.loader import load_model
from tests.modelfiles import write_trained
from tests.server import GunicornServer, wait_until
from tests.sse import EventReader, sse_json

FIRST = '[models.xyz]\nsource = "xyz"\n'
SECOND = 'default = "xzy"\n[models.xzy]\nsource = "xzy"\naliases = ["xyz"]\n'


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


# Before the reload: "swap" (to be replaced) and "gone" (to be removed) beside "stay"; after it,
# "swap" has new weights, "gone" is no more (its name goes to the default, "stay") and "new" is added.
# Each bigram is trained on its own three bytes: greedily after "x" it repeats the other two and "x".
BEFORE = """default = "stay"
[models.stay]
source = "xyz"
[models.swap]
source = "xzy"
[models.gone]
source = "xyw"
"""
AFTER = """default = "stay"
[models.stay]
source = "xyz"
[models.swap]
source = "xwy"
[models.new]
source = "xwz"
"""
TRAINED = ("xyz", "xzy", "xyw", "xwy", "xwz")
BOOTING = "Booting worker"  # logged by each worker as it starts, before it loads the models
ACCEPTS = "Worker accepts, generation 1"  # logged by a new worker just before its first accept


class LogFollower:
    """Counts lines of a server's log as it grows, to tell what had been logged before an action."""

    def __init__(self, srv: GunicornServer, *texts: str) -> None:
        self.path, self.offset = srv.log_path, 0
        self.seen = dict.fromkeys(texts, 0)

    def counts(self) -> dict[str, int]:
        """How many times each text has been logged so far (the log read once, as it grows)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            new = f.read()
        end = new.rfind(b"\n") + 1  # a line being written is read with the next call
        self.offset += end
        for text in self.seen:
            self.seen[text] += new[:end].decode(errors="replace").count(text)
        return dict(self.seen)


@dataclass
class Answer:
    """One short request of the client: what the log said before it was sent, what came back."""

    booting: bool  # a new worker had started (not yet loaded its models)
    accepting: bool  # a new worker had logged that it accepts
    status: int
    version: str  # X-Model-Version
    text: str


def test_a_reload_that_adds_replaces_and_removes_models_drops_nothing(tmp_path):
    """32 streams (300 tokens at a test-only 20 ms a token: 6 s each) on the replaced and the
    removed model run through a reload, while a client sends short requests one after another.
    Every stream ends whole on the old workers; every short request is answered 200 with the text
    of the version it names; the old workers answer while the new ones load; the versions flip
    once (old, then new, never old again); every request sent once a new worker logged that it
    accepts gets the new version."""
    for name in TRAINED:
        write_trained(tmp_path / name, name.encode())
    version = {
        name: f"{load_model(tmp_path / name).checksum[:16]}+greenserve-{__version__}"
        for name in TRAINED
    }
    text = {name: name[1:] + name[0] for name in TRAINED}  # "xzy" greedily: "zyx" "zyx"...
    models_file = tmp_path / "models.toml"
    models_file.write_text(BEFORE)
    env = {"MODELS_FILE": str(models_file), "GREENSERVE_FAULTS": "slow_step_s=0.02"}
    srv = GunicornServer(tmp_path / "run", env, workers=2).start()
    streams = []
    answers: list[Answer] = []
    done = threading.Event()

    def short_requests() -> None:
        log = LogFollower(srv, BOOTING, ACCEPTS)
        body = {"model": "swap", "prompt": "x", "max_tokens": 3, "temperature": 0}
        while not done.is_set():
            seen = log.counts()
            status, headers, raw = srv.complete(body)
            got = json.loads(raw)["choices"][0]["text"] if status == 200 else raw.decode()
            booting, accepting = seen[BOOTING] > 2, seen[ACCEPTS] > 0
            answers.append(Answer(booting, accepting, status, headers["x-model-version"], got))

    client = threading.Thread(target=short_requests)
    try:
        for i in range(32):
            model = ("swap", "gone")[i % 2]
            body = {"model": model, "prompt": "x", "max_tokens": 300, "temperature": 0}
            reader = EventReader(srv.port, {**body, "stream": True})
            assert reader.open().status == 200
            first = reader.next_frame()
            while not first.startswith(b"data: "):  # the ": ok" comment comes first
                first = reader.next_frame()
            streams.append((reader, first, {"swap": "xzy", "gone": "xyw"}[model]))
        client.start()
        wait_until(lambda: len(answers) >= 3, 30, "answers before the reload")
        models_file.write_text(AFTER)
        srv.signal(signal.SIGHUP)
        # Both new workers accept (the old ones stopped accepting) while the streams, 6 s each,
        # still run on the old workers.
        wait_until(lambda: srv.log_text().count(ACCEPTS) == 2, 60, srv.log_tail)
        flipped = len(answers)
        wait_until(lambda: len(answers) >= flipped + 5, 30, "answers after the reload")
        done.set()
        client.join(30)
        for reader, first, trained in streams:
            assert reader.resp is not None
            chunks = sse_json(first + b"\n" + reader.resp.read())  # the frame ends with "\\n"
            assert "".join(c["choices"][0]["text"] for c in chunks) == text[trained] * 100
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        old, new = version["xzy"], version["xwy"]
        assert [a.status for a in answers] == [200] * len(answers), answers
        assert all(a.text == text[{old: "xzy", new: "xwy"}[a.version]] for a in answers), answers
        served = [a.version for a in answers]
        flip = served.index(new)
        assert served == [old] * flip + [new] * (len(served) - flip)
        assert all(a.version == new for a in answers if a.accepting)
        assert any(a.version == old for a in answers if a.booting)  # no wait for the new models
        assert sum(a.accepting for a in answers) >= 5

        # Added: listed and served; removed: its name goes to the default model (the seed contract).
        assert listed(srv) == ["stay", "swap", "new"]
        assert served_version(srv, "new") == version["xwz"]
        body = {"model": "gone", "prompt": "x", "max_tokens": 3, "temperature": 0}
        status, headers, raw = srv.complete(body)
        assert status == 200 and headers["x-model-version"] == version["xyz"]
        assert json.loads(raw)["model"] == "gone"
        assert json.loads(raw)["choices"][0]["text"] == text["xyz"]
        assert "Traceback" not in srv.log_text()
    finally:
        done.set()
        for reader, _, _ in streams:
            reader.close()
        srv.stop()
