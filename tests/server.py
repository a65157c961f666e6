"""A real gunicorn (gevent workers) in a subprocess, on ephemeral loopback ports, for integration tests.

The server runs in its own process group with stderr to a file; its bound ports are read from its log
("Listening at: …"); readiness is polled with a deadline; a failure shows the log tail.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"Listening at: (\S+)")


class ServerDied(RuntimeError):
    """The server process exited while a test expected it to run."""


class GunicornServer:
    """One gunicorn master with its workers.

    Args:
        workdir: a private directory for the log file.
        env: extra environment variables (settings of DESIGN §7).
        workers: ``WEB_CONCURRENCY``.
        health_port: bind a second (health) port as well.
    """

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        workers: int = 1,
        health_port: bool = True,
        args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "gunicorn.log"
        # The test decides tracing and every setting: nothing leaks in from the caller's shell.
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "GREENSERVE", "PROMETHEUS_MULTIPROC_DIR"))
        }
        # A private history database per server, so parallel test servers never share counts.
        self.env.update(
            {
                "WEB_CONCURRENCY": str(workers),
                "STATS_DB": str(self.workdir / "stats.db"),
                **(env or {}),
            }
        )
        binds = ["--bind", "127.0.0.1:0"] + (["--bind", "127.0.0.1:0"] if health_port else [])
        self.cmd = [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            str(ROOT / "gunicorn.conf.py"),
            *binds,
            "--no-control-socket",
            *args,
        ]
        self.proc: subprocess.Popen | None = None
        self.ports: list[int] = []

    # -- process ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> GunicornServer:
        """Start the server and wait until ``/healthz`` answers on every port."""
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not self.ports:
            self._check_alive()
            match = _LISTENING.search(self.log_text())
            if match:
                self.ports = [int(u.rsplit(":", 1)[1]) for u in match.group(1).split(",")]
            elif time.monotonic() > deadline:
                raise TimeoutError("server did not bind:\n" + self.log_tail())
            time.sleep(0.05)
        for port in self.ports:
            while True:
                self._check_alive()
                try:
                    if self.get("/healthz", port=port)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("server not ready:\n" + self.log_tail())
                time.sleep(0.05)
        return self

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerDied(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the gunicorn master."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait for the master to exit; return its exit code."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> int | None:
        """SIGTERM the master, then kill the whole process group if it lingers."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                code = self.proc.wait(timeout=5)
        try:  # orphaned workers, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return code

    def log_text(self) -> str:
        """The server's whole log so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server's log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- client helpers ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The API port."""
        return self.ports[0]

    @property
    def health_port(self) -> int:
        """The health port."""
        return self.ports[1]

    @property
    def url(self) -> str:
        """Base URL of the API port."""
        return f"http://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None,
        port: int | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request on a fresh connection; return (status, headers with lower-case names, body)."""
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=timeout_s)
        try:
            hdrs = {"Content-Type": "application/json"} if body is not None else {}
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        finally:
            conn.close()

    def get(self, path: str, **kw) -> tuple[int, dict[str, str], bytes]:
        """GET ``path``."""
        return self.request("GET", path, **kw)

    def post(self, path: str, body, **kw) -> tuple[int, dict[str, str], bytes]:
        """POST ``body`` (a dict is sent as JSON) to ``path``."""
        return self.request("POST", path, body=body, **kw)

    def complete(self, body: dict, **kw) -> tuple[int, dict[str, str], bytes]:
        """POST ``body`` to ``/v1/completions``."""
        return self.post("/v1/completions", body, **kw)


def sse_events(body: bytes) -> list[bytes]:
    """Split an SSE body into its ``data:`` payloads (comments dropped), checking the framing."""
    assert body.endswith(b"\n\n"), body[-40:]
    payloads = []
    for frame in body[:-2].split(b"\n\n"):
        lines = [ln for ln in frame.split(b"\n") if not ln.startswith(b":")]
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith(b"data: "), frame
        payloads.append(lines[0][len(b"data: ") :])
    return payloads


def sse_json(body: bytes) -> list[dict]:
    """The JSON payloads of an SSE body; asserts it ends with exactly one ``[DONE]``."""
    payloads = sse_events(body)
    assert payloads[-1] == b"[DONE]", payloads[-3:]
    assert b"[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


class EventReader:
    """Read an SSE response event by event over a real connection (http.client decodes chunking).

    Args:
        port: the server's API port.
        body: the JSON request body (a dict).
        path: the route POSTed to.
        rcvbuf: a small ``SO_RCVBUF`` in bytes, to make a non-reading client block the server sooner.
    """

    def __init__(
        self,
        port: int,
        body: dict,
        headers: dict[str, str] | None = None,
        rcvbuf: int | None = None,
        timeout_s: float = 30.0,
        path: str = "/v1/completions",
    ) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        if rcvbuf is not None:
            import socket

            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Before connect(), so the advertised window stays small.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.settimeout(timeout_s)
            sock.connect(("127.0.0.1", port))
            self.conn.sock = sock
        self.conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        self.sock = self.conn.sock
        self.resp: http.client.HTTPResponse | None = None

    def open(self) -> http.client.HTTPResponse:
        """Read the status line and headers."""
        self.resp = self.conn.getresponse()
        return self.resp

    def next_frame(self) -> bytes:
        """Return the next frame (event or comment) without its blank line; b"" at the end."""
        assert self.resp is not None
        lines = []
        while True:
            line = self.resp.readline()
            if not line:
                return b"".join(lines)
            if line == b"\n":
                return b"".join(lines)
            lines.append(line)

    def close(self) -> None:
        """Close the connection abruptly (as a client that goes away)."""
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.resp is not None:
            self.resp.close()
        self.conn.close()
        self.sock.close()


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` every 20 ms until it returns something truthy; return that.

    Raises:
        AssertionError: ``timeout_s`` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# gevent's monitor thread reports any greenlet that holds the hub longer than this (100 ms).
HUB_MONITOR_ENV = {"GEVENT_MONITOR_THREAD_ENABLE": "1", "GEVENT_MAX_BLOCKING_TIME": "0.1"}


def assert_hub_never_blocked(srv: GunicornServer) -> None:
    """Assert that gevent's monitor thread ran in ``srv`` (started with ``HUB_MONITOR_ENV``) and never
    reported a blocked hub."""
    import importlib.util

    log = srv.log_text()
    if importlib.util.find_spec("psutil") is None:  # the monitor's start-up warning proves it ran
        assert "Unable to monitor memory usage" in log
    assert "appears to be blocked" not in log, srv.log_tail()
