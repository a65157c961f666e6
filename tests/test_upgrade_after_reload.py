"""Upgrades after a reload, and upgrades in a row, keep the server whole.

After a ``SIGHUP`` reload gunicorn saves an environment holding ``PROMETHEUS_MULTIPROC_DIR``; a
``USR2`` then started the new master on the old master's metrics directory, which the old master's
exit deleted: ``/metrics``, ``/stats`` and ``POST /debug/drain`` answered 500 and the next worker
could not boot. Each master now owns a directory of its own; the checks below run on the master
that is left, after it has replaced the old one.

Source: gunicorn's arbiter (``reexec`` passes ``cfg.env_orig``; ``reload`` re-reads the config).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.notify import NotifySocket
from tests.server import GunicornServer, wait_until

GREENSERVE = str(Path(sys.executable).parent / "greenserve")


def upgrade(srv: GunicornServer, notify: NotifySocket, master: int) -> int:
    """``USR2`` ``master``, wait for the new one to serve (``MAINPID=``), ``TERM`` the old one;
    return the new master's pid."""
    os.kill(master, signal.SIGUSR2)
    message = notify.wait_for(lambda m: m.startswith("MAINPID=") and m != f"MAINPID={master}")
    new = int(message.removeprefix("MAINPID="))
    assert new != master
    os.kill(master, signal.SIGTERM)
    wait_until(lambda: not _alive(master), 40, f"the old master {master} to exit")
    return new


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if pid == os.getpid():
        return True
    with contextlib.suppress(OSError):  # a zombie child of this test is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False


def check_whole(srv: GunicornServer) -> None:
    """The master left serves metrics, stats, a drain and a new worker after one is killed."""
    body = {"model": "m", "prompt": "A", "max_tokens": 2}
    assert srv.complete(body)[0] == 200
    status, _, text = srv.get("/metrics", port=srv.health_port)
    assert status == 200 and b"greenserve_requests_total" in text, text[:300]
    assert srv.get("/stats", port=srv.health_port)[0] == 200
    status, _, raw = srv.post("/debug/drain", b"")
    assert status == 200 and json.loads(raw)["status"] == "draining"
    assert srv.get("/ready", port=srv.health_port)[0] == 503
    assert srv.request("DELETE", "/debug/drain")[0] == 200
    wait_until(lambda: srv.get("/ready", port=srv.health_port)[0] == 200, 10, "/ready again")
    worker = srv.state()["pid"]
    os.kill(worker, signal.SIGKILL)
    wait_until(
        lambda: srv.state()["pid"] != worker and srv.complete(body)[0] == 200,
        60,
        lambda: f"a new worker to serve; log:\n{srv.log_tail()}",
    )


@pytest.mark.parametrize("case", ["reload-then-upgrade", "operator-dir", "two-upgrades"])
def test_the_master_left_after_upgrades_is_whole(succ_dir, tmp_path, case):
    notify = NotifySocket(tmp_path / "notify")
    env = {"MODEL_DIR": str(succ_dir)}
    operator_dir = tmp_path / "metrics"
    if case == "operator-dir":
        operator_dir.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(operator_dir)
    srv = GunicornServer(tmp_path / "run", env, command=[GREENSERVE])
    srv.env["NOTIFY_SOCKET"] = notify.path
    with contextlib.ExitStack() as stack:
        stack.callback(notify.close)
        stack.enter_context(srv)
        master = srv.proc.pid
        assert notify.wait_for(lambda m: "READY=1" in m)
        if case != "two-upgrades":
            booted = srv.log_text().count("Booting worker")
            srv.signal(signal.SIGHUP)
            wait_until(lambda: srv.log_text().count("Booting worker") > booted, 30, "the reload")
            srv.wait_workers(1)
        master = upgrade(srv, notify, master)
        check_whole(srv)
        if case == "two-upgrades":
            master = upgrade(srv, notify, master)
            check_whole(srv)
        if case == "operator-dir":  # the operator's directory stays; one master's dir in it
            assert [p.name.startswith("master-") for p in operator_dir.iterdir()] == [True]
        os.kill(master, signal.SIGTERM)
        wait_until(lambda: not _alive(master), 40, "the last master to exit")
    if case == "operator-dir":
        assert operator_dir.is_dir() and not list(operator_dir.iterdir())
