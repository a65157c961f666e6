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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

ROOT = Path(__file__).resolve().parent.parent
# The master's "Listening at: <urls> (<pid>)"; no urls under --reuse-port (each worker binds its own).
_LISTENING = re.compile(r"Listening at: (\S*) \(")
T = TypeVar("T")


class ServerDied(RuntimeError):
    """The server process exited while a test expected it to run."""


class StartedWhileOpen:
    """A context manager for a process a test runs: ``start()`` on entry (its value is the
    ``with`` target), ``stop()`` on exit, whatever happened inside."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class GunicornServer(StartedWhileOpen):
    """One gunicorn master with its workers; as a context manager, started on entry and stopped on exit.

    Args:
        workdir: a private directory for the log file.
        env: extra environment variables (the server's settings, as ``wsgi_app/settings.py`` reads them).
        workers: ``WEB_CONCURRENCY``.
        health_port: bind a second (health) port as well.
        reuse_port: gunicorn's ``--reuse-port``: every worker binds sockets of its own (the master
            none) to ports picked free here, as port 0 would give each worker another port.
        args: more gunicorn arguments.
        command: the launcher instead of ``python -m gunicorn -c gunicorn.conf.py`` (the binds and
            ``args`` follow a ``--``, as ``greenserve`` takes them).
        cwd: the folder the server starts in (default: the checkout).
    """

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        workers: int = 1,
        health_port: bool = True,
        args: tuple[str, ...] = (),
        command: list[str] | None = None,
        cwd: Path | None = None,
        reuse_port: bool = False,
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
        self.fixed_ports = [_free_port() for _ in range(1 + health_port)] if reuse_port else []
        binds = [
            a
            for port in self.fixed_ports or [0] * (1 + health_port)
            for a in ("--bind", f"127.0.0.1:{port}")
        ] + (["--reuse-port"] if reuse_port else [])
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
        if command is not None:  # another launcher (the installed ``greenserve``) with these binds
            self.cmd = [*command, "--", *binds, "--no-control-socket", *args]
        self.cwd = cwd or ROOT
        self.proc: subprocess.Popen | None = None
        self.ports: list[int] = []

    # -- process ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> GunicornServer:
        """Start the server and wait until ``/healthz`` answers on every port.

        A failed start leaves nothing running (the log stays readable).

        Raises:
            ServerDied: the master exited first.
            TimeoutError: it did not bind or answer within ``timeout_s`` seconds.
        """
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> GunicornServer:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=self.cwd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s

        def left_s() -> float:
            return deadline - time.monotonic()

        def healthy(port: int) -> bool:
            try:
                return self.get("/healthz", port=port)[0] == 200
            except OSError:
                return False

        try:
            bound = wait_until(
                lambda: self._check_alive() or _LISTENING.search(self.log_text()),
                left_s(),
                "the server to bind",
            )
            urls = [u for u in bound.group(1).split(",") if u]
            self.ports = [int(u.rsplit(":", 1)[1]) for u in urls] or self.fixed_ports
            for port in self.ports:
                wait_until(
                    lambda port=port: self._check_alive() or healthy(port),
                    left_s(),
                    f"/healthz on port {port}",
                )
        except AssertionError as timed_out:
            raise TimeoutError(f"{timed_out}:\n{self.log_tail()}") from None
        return self

    def _check_alive(self) -> None:
        """Raise ``ServerDied`` (with the log tail) if the master has exited."""
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
        if self._log.closed:  # stopped already
            return self.proc.returncode
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

    # -- the server's own view ----------------------------------------------------------------------

    def log_line(self, request_id: str) -> dict | None:
        """Return the JSON log line of request ``request_id`` (``"message": "request"``), or None
        while it is not written."""
        for text in self.log_text().splitlines():
            if text.startswith("{"):
                line = json.loads(text)
                if line.get("message") == "request" and line.get("request_id") == request_id:
                    return line
        return None

    def state(self) -> dict:
        """Return ``/debug/state`` of the worker that answers (slots, queue, in-flight requests, pid)."""
        status, _, body = self.get("/debug/state")
        assert status == 200, body
        return json.loads(body)

    def in_flight(self, request_id: str) -> dict | None:
        """Return the ``/debug/state`` entry of request ``request_id``, or None when it holds none."""
        return next((r for r in self.state()["requests"] if r["request_id"] == request_id), None)

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Poll until zero busy slots, an empty queue and no request in flight; return that state."""

        seen: list[dict] = []

        def idle() -> dict | None:
            seen[:] = [self.state()]
            s = seen[0]
            return None if s["slots"]["busy"] or s["queue"]["waiting"] or s["requests"] else s

        return wait_until(idle, timeout_s, lambda: f"the server to be idle; last state {seen}")

    def wait_workers(self, n: int, timeout_s: float = 30.0) -> set[int]:
        """Poll ``/debug/state`` until ``n`` different workers have answered (all booted); return
        their pids."""
        pids: set[int] = set()
        return wait_until(
            lambda: pids.add(self.state()["pid"]) or len(pids) >= n and pids,
            timeout_s,
            lambda: f"{n} workers to answer; only {sorted(pids)} did",
        )


def failed_start(
    tmp_path: Path, env: dict[str, str], own_binds: bool = False
) -> tuple[str, list[str]]:
    """Run gunicorn until it exits (code 1 asserted); return its stderr and its non-JSON lines.

    The temp dir is private, so that the metrics dir ``gunicorn.conf.py`` makes is seen removed.
    With ``own_binds`` the test servers' ``--bind 127.0.0.1:0`` are left out, so ``HOST``, ``PORT``
    and ``HEALTH_PORT`` decide what is bound.
    """
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    srv = GunicornServer(tmp_path / "run", {"TMPDIR": str(tmp), **env})
    cmd = srv.cmd
    if own_binds:
        cmd = [part for part in cmd if part not in ("--bind", "127.0.0.1:0")]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env=srv.env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "Listening at" not in done.stderr  # stopped before binding
    assert list(tmp.iterdir()) == []  # no metrics dir left behind
    lines = done.stderr.splitlines()
    for line in lines:
        if line.startswith("{"):
            json.loads(line)  # gunicorn's own lines stay JSON
    return done.stderr, [line for line in lines if not line.startswith("{")]


def refused_setting(tmp_path: Path, setting: str, value: str) -> str:
    """Start with ``setting=value``, which must stop the start; return the one line printed, asserted
    to begin ``greenserve: cannot start: <setting> (<value>): ``."""
    _, plain = failed_start(tmp_path, {setting: value})
    assert len(plain) == 1 and plain[0].startswith(
        f"greenserve: cannot start: {setting} ({value}): "
    ), plain
    return plain[0]


def _free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_request(body: dict, request_id: str = "", path: str = "/v1/completions") -> bytes:
    """Return a complete HTTP/1.1 POST of ``body`` as JSON (with ``X-Request-Id`` when one is given),
    for tests that write to a plain socket."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    if request_id:
        head += f"X-Request-Id: {request_id}\r\n"
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def send_request(
    port: int, body: dict, request_id: str = "", timeout_s: float = 20.0
) -> socket.socket:
    """Connect to ``127.0.0.1:port``, send :func:`raw_request` of ``body`` and return the open socket
    (its timeout ``timeout_s`` seconds), for the test to read, half-close or drop."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(raw_request(body, request_id))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Read ``sock`` until the server closes it; close it; return what came."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def server_read_all(sock: socket.socket) -> bool:
    """True when the server end of the loopback connection ``sock`` has read every byte sent on it so
    far: the server's kernel has acknowledged all of them (the client end's ``tx_queue`` in
    /proc/net/tcp or tcp6 is empty) and the server process has taken them (its end's ``rx_queue`` is).

    Raises:
        AssertionError: either end of the connection is not listed as established.
    """
    client_port, server_port = sock.getsockname()[1], sock.getpeername()[1]
    queues: dict[tuple[int, int], tuple[int, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            # sl local_address rem_address st tx_queue:rx_queue ...; ports and queues in hex
            local, remote, state, tx_rx = row.split()[1:5]
            if state == "01":  # ESTABLISHED
                ports = (int(local.rpartition(":")[2], 16), int(remote.rpartition(":")[2], 16))
                tx, _, rx = tx_rx.partition(":")
                queues[ports] = (int(tx, 16), int(rx, 16))
    client, server = queues.get((client_port, server_port)), queues.get((server_port, client_port))
    assert client and server, f"no established connection {client_port} <-> {server_port}"
    return client[0] == 0 and server[1] == 0


def blocked_on_its_reader(srv: GunicornServer, request_id: str) -> bool:
    """True when request ``request_id`` is in flight and made no token in 0.2 s (its write blocks)."""
    before = srv.in_flight(request_id)
    time.sleep(0.2)
    after = srv.in_flight(request_id)
    return bool(before and after and 0 < before["tokens"] == after["tokens"])


def wait_until(
    predicate,
    timeout_s: float = 10.0,
    what: str | Callable[[], str] = "condition",
    sleep: Callable[[float], object] = time.sleep,
):
    """Poll ``predicate`` every 20 ms until it returns something truthy; return that.

    Args:
        predicate: called with no arguments; its first truthy result is returned.
        timeout_s: the deadline, in seconds.
        what: what is awaited, for the failure message; a callable is asked at the deadline (to show
            the state that was seen last).
        sleep: the pause between polls (``gevent.sleep`` where other greenlets must run meanwhile).

    Raises:
        AssertionError: ``timeout_s`` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        sleep(0.02)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def concurrently(call: Callable[[int], T], n: int, timeout_s: float = 60.0) -> list[T]:
    """Run ``call(0)`` … ``call(n - 1)`` each in its own thread, released together; return the results
    in index order.

    Raises:
        BaseException: the first exception a call raised (an assertion inside a call fails the test).
        AssertionError: some call was still running after ``timeout_s`` seconds.
    """
    results: list = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call(i)
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"calls still running after {timeout_s} s"
    if errors:
        raise errors[0]
    return results


# The tolerance a documented time bound is asserted with: what a busy machine (the suite shares its
# cores with other work) may add before a process acts. A bound that only tells a behaviour from its
# absence is set halfway to the absence instead (a heartbeat 30 s away, a collector that answers in
# 5 s). Tests assert order and outcomes; a duration only where the duration is the documented
# behaviour, and never a speed (that is bench/'s).
SLACK_S = 1.5

# gevent's monitor thread reports any greenlet that holds the hub longer than this (100 ms).
HUB_MONITOR_ENV = {"GEVENT_MONITOR_THREAD_ENABLE": "1", "GEVENT_MAX_BLOCKING_TIME": "0.1"}


def assert_hub_never_blocked(srv: GunicornServer) -> None:
    """Assert that gevent's monitor thread ran in ``srv`` (started with ``HUB_MONITOR_ENV``) and never
    reported a blocked hub while the worker served.

    A report whose blocked stack is in gunicorn's ``load_wsgi`` is the worker building the app
    (loading the model, importing ``requests`` for the span exporter) before it accepts any
    connection: it delays no request, and on a loaded machine its imports alone can take over
    100 ms, so it is not counted."""
    import importlib.util

    log = srv.log_text()
    if importlib.util.find_spec("psutil") is None:  # the monitor's start-up warning proves it ran
        assert "Unable to monitor memory usage" in log
    # gevent writes each report as a block of lines, headed by its "... appears to be blocked" line
    reports = re.split(r"\n(?=\S+ : Greenlet .* appears to be blocked)", log)[1:]
    serving = [r for r in reports if "appears to be blocked" in r and " in load_wsgi\n" not in r]
    assert not serving, serving[0][:4000]
