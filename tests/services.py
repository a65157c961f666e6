"""Real system services for integration tests: Redis and nginx, each a subprocess on a free loopback port.

Both come from the OS packages (``.ci/run`` installs ``nginx`` and ``redis-server``). Each runs in its own
process group with its output in a private directory, is polled until it answers, and is stopped (then
killed) when the test that started it is done (each is a context manager). nginx runs the repository's
example site, ``deploy/nginx/greenserve.conf``, with only its ports and log path changed.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

from tests.needs import unavailable
from tests.server import StartedWhileOpen, wait_until

ROOT = Path(__file__).resolve().parent.parent
NGINX_SITE = ROOT / "deploy" / "nginx" / "greenserve.conf"
NGINX = "/usr/sbin/nginx"
MISSING = "{} not found: install the Debian packages nginx and redis-server (.ci/run does)"


def missing_service(what: str) -> None:
    """Skip the test when a system service is not installed, so a newcomer's first run is green;
    under CI (``CI`` set, where ``.ci/run`` installs it) a missing service is a failure, never a skip."""
    unavailable(MISSING.format(what))


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago (the caller retries on a clash)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(proc: subprocess.Popen, answers: Callable[[], bool], timeout_s: float) -> bool:
    """Poll until ``answers()`` is true (True), or the process exited or ``timeout_s`` passed (False)."""
    try:
        wait_until(lambda: proc.poll() is not None or answers(), timeout_s, "the service")
    except AssertionError:
        return False
    return proc.poll() is None


def _launch(
    cmd: list[str], log_path: Path, answers: Callable[[], bool], timeout_s: float
) -> subprocess.Popen | None:
    """Start ``cmd`` in its own process group, its output appended to ``log_path``; return the
    process once ``answers()`` is true, or None (the process killed) when it exited or
    ``timeout_s`` passed first."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    if _serving(proc, answers, timeout_s):
        return proc
    _stop(proc, signal.SIGKILL)
    return None


def _stop(
    proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 10.0
) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


class RedisServer(StartedWhileOpen):
    """A throwaway ``redis-server`` without persistence.

    Args:
        workdir: a private directory for its log and working files.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            missing_service("redis-server")
        self.binary = binary

    def url(self, db: int = 0) -> str:
        """The ``RATE_LIMIT_STORAGE_URI`` of database ``db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A redis-py client for database ``db``."""
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start on a free port (the same port again after :meth:`stop`); wait until PING answers."""
        for _ in range(5):
            self.port = self.port or free_port()
            self.proc = _launch(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                ],  # fmt: skip
                self.workdir / f"redis-{self.port}.log",
                self._pings,
                timeout_s,
            )
            if self.proc is not None:
                return self
            self.port = 0  # most likely the port was taken meanwhile: try another
        raise RuntimeError("redis-server did not start; see " + str(self.workdir))

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its data is gone, its port is kept."""
        _stop(self.proc)


UPSTREAM_LINE = "server 127.0.0.1:8000 max_fails=1 fail_timeout=10s;"


def render_site(site: str, upstream_port: int | list[int], listen_port: int, log_dir: Path) -> str:
    """Return the example site with the test's ports and log path; every other directive unchanged.
    A list of upstream ports repeats the upstream's ``server`` line once per port (several hosts).

    Raises:
        AssertionError: the example no longer has the lines this substitutes (keep them in sync).
    """
    ports = upstream_port if isinstance(upstream_port, list) else [upstream_port]
    swaps = {
        UPSTREAM_LINE: "\n    ".join(UPSTREAM_LINE.replace(":8000", f":{p}") for p in ports),
        "listen 80;": f"listen 127.0.0.1:{listen_port};",
        "/var/log/nginx/greenserve.access.log": str(log_dir / "access.log"),
    }
    for old, new in swaps.items():
        assert site.count(old) == 1, f"{NGINX_SITE} should contain {old!r} exactly once"
        site = site.replace(old, new)
    return site


def nginx_main_conf(tmp: Path, site_path: Path) -> str:
    """Return an nginx.conf that keeps every file in ``tmp`` and includes the site at ``site_path``.

    Like Debian's own nginx.conf it turns gzip on globally, and more (every type, any size), so the
    tests show that the site turns it off for event streams.
    """
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers may then use the temp dirs
    temp = "\n".join(
        f"    {kind}_temp_path {tmp / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
{user}worker_processes 1;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} info;
events {{
    worker_connections 256;
}}
http {{
    default_type application/octet-stream;
{temp}
    gzip on;
    gzip_types *;
    gzip_min_length 1;
    include {site_path};
}}
"""


class NginxServer(StartedWhileOpen):
    """The real nginx, in the foreground, proxying to ``upstream_port`` with the example site.

    Args:
        workdir: a private directory for the config, logs, pid and temp files.
        upstream_port: the gunicorn API port, or a list of them (one upstream server each).
    """

    def __init__(self, workdir: Path, upstream_port: int | list[int]) -> None:
        if not os.access(NGINX, os.X_OK):
            missing_service(NGINX)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.upstream_port = upstream_port
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> NginxServer:
        """Write the config, start nginx on a free port, wait until ``/healthz`` answers through it."""
        site_path = self.workdir / "greenserve.conf"
        conf_path = self.workdir / "nginx.conf"
        conf_path.write_text(nginx_main_conf(self.workdir, site_path))
        for _ in range(5):
            self.port = free_port()
            site = render_site(NGINX_SITE.read_text(), self.upstream_port, self.port, self.workdir)
            site_path.write_text(site)
            cmd = [NGINX, "-p", str(self.workdir), "-c", str(conf_path), "-e", "stderr"]
            self.proc = _launch(cmd, self.workdir / "nginx.out", self._healthy, timeout_s)
            if self.proc is not None:
                return self
        raise RuntimeError("nginx did not start:\n" + self.log_tail())

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/healthz")[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop nginx (SIGTERM: fast shutdown), then kill its process group if it lingers."""
        _stop(self.proc)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        """The end of nginx's own output and error log."""
        text = ""
        for name in ("nginx.out", "error.log"):
            path = self.workdir / name
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        source: str = "127.0.0.1",
        timeout_s: float = 30.0,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request through nginx from loopback address ``source`` (any 127.x.y.z works).

        Returns:
            (status, headers with lower-case names, body).
        """
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.port, timeout=timeout_s, source_address=(source, 0)
        )
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        finally:
            conn.close()
