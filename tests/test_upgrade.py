"""Upgrading a running server to new code and a new model without failing a request (the README's
"Upgrades"): point the ``MODEL_DIR`` symlink at the new model, install the new code, ``kill -USR2``
the master (gunicorn re-executes itself: a new master importing the new code, with new workers loading
the new model, beside the old ones on the same sockets), wait for the new master's ``MAINPID=``
notification (its first worker serves), then ``kill -TERM`` the old master (its workers finish their
streams and exit). A SIGHUP alone would not do: it forks new workers from the old master's code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.installed import installed_site, make_venv
from tests.modelfiles import succ_weight, write_model_dir
from tests.notify import NotifySocket
from tests.server import GunicornServer, wait_until
from tests.sse import sse_json

STREAM_TOKENS = 8


def version_of(model_dir: Path, code_version: str) -> str:
    """The ``X-Model-Version`` a server answers with: the weights' SHA-256 prefix and the code's."""
    digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    return f"{digest[:16]}+greenserve-{code_version}"


@pytest.fixture
def layout(greenserve_wheel, tmp_path) -> dict[str, Path]:
    """An installed greenserve and two model versions: v1 continues "A" with "B", v2 with "C"."""
    models = tmp_path / "models"
    write_model_dir(models / "v1", succ_weight())
    write_model_dir(models / "v2", np.roll(succ_weight(), 1, axis=1))  # W[i][i + 2] = 2
    (tmp_path / "model").symlink_to(models / "v1")
    bin_dir = make_venv(tmp_path / "venv", greenserve_wheel)
    return {"root": tmp_path, "models": models, "model": tmp_path / "model", "bin": bin_dir}


def swap_symlink(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (``ln -s`` then ``rename``, as ``mv -T`` does)."""
    fresh = link.with_name(link.name + ".new")
    fresh.symlink_to(target)
    os.replace(fresh, link)


def test_usr2_upgrade_serves_the_new_version_and_fails_nothing(layout):
    notify = NotifySocket(layout["root"] / "notify")
    srv = GunicornServer(
        layout["root"] / "log",
        {"MODEL_DIR": str(layout["model"]), "GREENSERVE_FAULTS": "slow_step_s=0.05"},
        command=[str(layout["bin"] / "greenserve")],
        cwd=layout["root"],
    )
    srv.env.update({"NOTIFY_SOCKET": notify.path})
    srv.env.pop("VIRTUAL_ENV", None)
    old = version_of(layout["models"] / "v1", "0.1.0")
    new = version_of(layout["models"] / "v2", "0.2.0")
    results: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def load(stream: bool) -> None:
        body = {"model": "m", "prompt": "A", "temperature": 0, "stream": stream}
        body["max_tokens"] = STREAM_TOKENS if stream else 1
        while not stop.is_set():
            try:
                status, headers, data = srv.complete(body)
            except OSError as exc:  # a refused or reset connection is a failed request too
                results.append((0, "", repr(exc)))
                continue
            if status != 200:
                results.append((status, "", data.decode(errors="replace")))
            elif stream:
                chunks = sse_json(data)  # ends with exactly one [DONE]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                results.append((status, headers["x-model-version"], text))
            else:
                text = json.loads(data)["choices"][0]["text"]
                results.append((status, headers["x-model-version"], text))

    new_master = 0

    def stop_new_master() -> None:
        if new_master:
            try:
                os.kill(new_master, signal.SIGTERM)
            except ProcessLookupError:
                pass

    # Undone in reverse: the loaders stop, the new master, the old one, the notification socket.
    with contextlib.ExitStack() as stack:
        stack.callback(notify.close)
        stack.enter_context(srv)
        stack.callback(stop_new_master)
        stack.callback(stop.set)
        old_master = srv.proc.pid
        assert notify.wait_for(lambda m: "READY=1" in m)
        assert (
            srv.complete({"model": "m", "prompt": "A", "max_tokens": 1})[1]["x-model-version"]
            == old
        )
        loaders = [threading.Thread(target=load, args=(s,)) for s in (True, False, True)]
        for t in loaders:
            t.start()
        wait_until(lambda: len(results) >= 3, 30, "the old version to answer the load")

        # 1. The new model: MODEL_DIR's symlink now names v2 (the old workers keep v1 mapped).
        swap_symlink(layout["model"], layout["models"] / "v2")
        # 2. The new code, as `pip install --upgrade` would leave it in site-packages.
        init = installed_site(layout["bin"]) / "model" / "__init__.py"
        init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.2.0"'))
        # 3. A new master from the new code; it names itself the main process once a worker serves.
        os.kill(old_master, signal.SIGUSR2)
        message = notify.wait_for(lambda m: m.startswith("MAINPID="))
        new_master = int(message.removeprefix("MAINPID="))
        assert new_master != old_master
        # 4. The old master stops gracefully: its workers finish what they have started.
        os.kill(old_master, signal.SIGTERM)
        assert srv.wait(40) == 0
        wait_until(  # the load goes on: the new master's workers answer it
            lambda: sum(version == new for _, version, _ in results) >= 3,
            30,
            "the new version to answer the load",
        )
        stop.set()
        for t in loaders:
            t.join(30)

        status, headers, body = srv.complete(
            {"model": "m", "prompt": "A", "max_tokens": 1, "temperature": 0}
        )
        assert status == 200 and headers["x-model-version"] == new
        assert json.loads(body)["choices"][0]["text"] == "C"
        os.kill(new_master, 0)  # still serving after its parent left

    failed = [r for r in results if r[0] != 200]
    assert not failed, failed
    # Every answer is whole and from one version: v1 continues with B, v2 with C.
    expected = {
        old: {"B", "BCDEFGHI"},
        new: {"C", "CEGIKMOQ"},
    }
    for _, version, text in results:
        assert text in expected[version], (version, text)
    served = {version for _, version, _ in results}
    assert served == {old, new}, served
    assert len(results) >= 10, len(results)
