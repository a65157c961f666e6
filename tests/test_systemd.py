"""The systemd unit in deploy/systemd/: ``systemd-analyze verify`` finds nothing to say about it, and
its ``ExecStart``, run as systemd runs it (its environment file, ``/`` as working directory, a
``NOTIFY_SOCKET``), reports ready, serves, and stops gracefully on SIGTERM within ``TimeoutStopSec``
while a stream is in flight. systemd itself is not PID 1 here: its notification socket is stood in for.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import binary
from tests.notify import NotifySocket
from tests.server import ROOT, GunicornServer
from tests.services import free_port
from tests.sse import EventReader, sse_json

UNIT = ROOT / "deploy" / "systemd" / "greenserve.service"
ENV_FILE = ROOT / "deploy" / "systemd" / "greenserve.env"
EXEC_START = "/opt/greenserve/venv/bin/greenserve"


def unit_directives(text: str) -> dict[str, str]:
    """``Key=value`` lines of a unit file (the last one wins), comments dropped."""
    pairs = [ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#")]
    return {k.strip(): v.strip() for k, v in pairs}


def env_file(text: str) -> dict[str, str]:
    """Parse an ``EnvironmentFile=`` (``VAR=value`` lines; ``#`` comments)."""
    return dict(
        ln.split("=", 1) for ln in text.splitlines() if ln.strip() and not ln.startswith("#")
    )


def verify(unit_text: str, where: Path) -> str:
    """Run ``systemd-analyze verify`` on ``unit_text`` with ExecStart pointing at this checkout's
    installed ``greenserve``; return everything it printed."""
    analyze = binary("systemd-analyze", "systemd")
    here = Path(sys.executable).parent / "greenserve"  # the same command, installed in this venv
    assert here.exists()
    path = where / "greenserve.service"
    path.write_text(unit_text.replace(EXEC_START, str(here)))
    proc = subprocess.run(
        [analyze, "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    return proc.stdout + proc.stderr + ("" if proc.returncode == 0 else f"exit {proc.returncode}")


@pytest.mark.services
def test_unit_verifies_clean(tmp_path):
    text = UNIT.read_text()
    assert text.count(EXEC_START) == 1
    assert verify(text, tmp_path) == ""
    # The check can fail: a misspelt type and an unknown key are reported.
    broken = text.replace("Type=notify", "Type=notfy\nRestartSecs=2")
    said = verify(broken, tmp_path)
    assert "Failed to parse service type" in said and "Unknown key" in said, said


def test_unit_has_the_operating_directives():
    unit = unit_directives(UNIT.read_text())
    settings = env_file(ENV_FILE.read_text())
    assert unit["Type"] == "notify" and unit["NotifyAccess"] == "all"
    assert unit["ExecStart"] == EXEC_START
    assert unit["EnvironmentFile"] == "/etc/greenserve/greenserve.env"
    assert unit["User"] == unit["Group"] == "greenserve"
    assert unit["KillMode"] == "mixed" and unit["KillSignal"] == "SIGTERM"
    assert unit["Restart"] == "on-failure"
    # A stop right after a reload waits for the reload's old workers first (gunicorn's reload()).
    assert int(unit["TimeoutStopSec"]) > 2 * int(settings["GRACEFUL_TIMEOUT_S"])
    assert unit["StandardError"] == "journal"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert unit[key] == value, key
    # Where the service writes is where systemd lets it (StateDirectory, RuntimeDirectory).
    assert settings["STATS_DB"].startswith(f"/var/lib/{unit['StateDirectory']}/")
    assert settings["MODEL_DIR"].startswith(f"/var/lib/{unit['StateDirectory']}/")
    assert settings["GREENSERVE_CACHE_DIR"].startswith(f"/var/lib/{unit['StateDirectory']}/")
    assert settings["GUNICORN_CONTROL_SOCKET"].startswith(f"/run/{unit['RuntimeDirectory']}/")


def test_exec_start_runs_as_the_unit_says(succ_dir, tmp_path):
    unit = unit_directives(UNIT.read_text())
    here = str(Path(sys.executable).parent / "greenserve")
    argv = shlex.split(unit["ExecStart"].replace(EXEC_START, here))
    # The example environment file, with this host's paths and free loopback ports.
    env = {
        **env_file(ENV_FILE.read_text()),
        "HOST": "127.0.0.1",
        "PORT": str(free_port()),
        "HEALTH_PORT": str(free_port()),
        "MODEL_DIR": str(succ_dir),
        "GREENSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "STATS_DB": str(tmp_path / "stats.db"),
        "GUNICORN_CONTROL_SOCKET": str(tmp_path / "gunicorn.ctl"),
        "WEB_CONCURRENCY": "1",
        "GREENSERVE_FAULTS": "slow_step_s=0.05",
        "PATH": os.environ["PATH"],
    }
    notify = NotifySocket(tmp_path / "notify")
    srv = GunicornServer(tmp_path / "log")
    srv.cmd, srv.cwd, srv.env = argv, Path("/"), {**env, "NOTIFY_SOCKET": notify.path}
    with contextlib.closing(notify), srv:
        assert srv.ports == [int(env["PORT"]), int(env["HEALTH_PORT"])]
        assert notify.wait_for(lambda m: "READY=1" in m)
        # A stream is in flight when systemd stops the service: it still ends complete.
        reader = EventReader(
            srv.port,
            {"model": "m", "prompt": "a", "max_tokens": 20, "temperature": 0, "stream": True},
        )
        assert reader.open().status == 200
        assert reader.next_frame() == b": ok\n"
        first = reader.next_frame()
        srv.signal(signal.SIGTERM)
        frames = [first]
        while frame := reader.next_frame():
            frames.append(frame)
        reader.close()
        assert frames[-1] == b"data: [DONE]\n"
        chunks = sse_json(b"".join(f + b"\n" for f in frames))
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == "bcdefghijklmnopqrstu"
        assert srv.wait(int(unit["TimeoutStopSec"])) == 0
