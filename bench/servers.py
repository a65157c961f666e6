"""Start the servers under test on loopback ports, pinned to their own core, and stop them.

``greenserve`` is ``gunicorn -c gunicorn.conf.py`` with one gevent worker; the references are
``bench/ref_pywsgi.py`` and ``bench/ref_fastapi.py`` under uvicorn; for a GGUF model, llama.cpp's
OpenAI server (:func:`start_llamacpp`). Every server gets the open-file limit raised to the hard
limit (the benchmark's settings only), its stderr in a log file, and is ready once ``GET /healthz``
(llama.cpp's server has none: ``GET /v1/models``) answers 200.
"""

from __future__ import annotations

import functools
import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import procstat
from wsgi_app.generation.pacer import HUB_ROUND_S, HUB_SLICE_S
from wsgi_app.server.hubturn import POLL_S

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("greenserve", "pywsgi", "fastapi")
# llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`): one thread for prompt and
# decode alike, and a running stream is never cut short by the next request (its default
# `--interrupt_requests True` ends it after about one token as soon as another request waits).
LLAMACPP_FLAGS = (
    "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", "2048",
    "--interrupt_requests", "False", "--verbose", "False",
)  # fmt: skip


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def cores() -> tuple[list[int], list[int]]:
    """Split the usable CPUs: (server cores, client cores). One core each on a 2-core machine.

    Cached: the first call sees this process's affinity before ``bench.run`` pins itself.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return cpus, cpus
    return [cpus[-1]], [cpus[0]]


def _raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Server:
    """A running server under test.

    Attributes:
        name: ``greenserve``, ``pywsgi``, ``fastapi`` or ``llamacpp``.
        port: the API port.
        health_port: greenserve's health port, else None.
        proc: the launched process (gunicorn's master for greenserve).
        log_path: its stderr and stdout.
    """

    name: str
    port: int
    health_port: int | None
    proc: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def serving_pids(self) -> list[int]:
        """The processes that serve requests: gunicorn's worker(s), or the reference process."""
        pids = procstat.tree(self.proc.pid)
        if self.name == "greenserve":
            return [p for p in pids if p != self.proc.pid]
        return pids

    def stop(self) -> None:
        """SIGTERM the server, then SIGKILL its process group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=5)

    def wait_idle(self, max_s: float = 10.0, quiet_cpu_s: float = 0.02) -> None:
        """Wait until the server used less than ``quiet_cpu_s`` CPU over 0.25 s (the last run ended)."""
        deadline = time.monotonic() + max_s
        pids = self.serving_pids()
        while time.monotonic() < deadline:
            before = procstat.cpu_s(pids)
            time.sleep(0.25)
            if procstat.cpu_s(pids) - before < quiet_cpu_s:
                return


def start(
    name: str,
    logdir: Path,
    env: dict[str, str] | None = None,
    workers: int = 1,
    ready_s: float = 30.0,
    root: Path = ROOT,
) -> Server:
    """Start server ``name`` pinned to the server core; return once ``/healthz`` answers.

    Args:
        name: one of :data:`NAMES`.
        logdir: where its log file goes.
        env: extra environment (greenserve settings such as ``MAX_SLOTS``).
        workers: greenserve's gunicorn workers (``WEB_CONCURRENCY``); the others have one.
        ready_s: how long it may take to become ready, seconds (a GGUF is hashed at each start).
        root: the checkout whose code the server runs (another commit's worktree, for a "before").

    Raises:
        RuntimeError: the server exited or did not become ready within ``ready_s`` (with its log
            tail).
    """
    port = free_port()
    health_port = free_port() if name == "greenserve" else None
    full_env = {**os.environ, "PYTHONPATH": str(root), "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    if name == "greenserve":
        full_env.update(WEB_CONCURRENCY=str(workers), HOST="127.0.0.1", PORT=str(port))
        full_env["HEALTH_PORT"] = str(health_port)
        argv = [sys.executable, "-m", "gunicorn", "-c", str(root / "gunicorn.conf.py")]
        argv.append("--no-control-socket")
    elif name == "pywsgi":
        # The same scheduling as greenserve's Pacer, so the ceiling differs only by the work done.
        full_env.update(REF_HUB_SLICE_S=str(HUB_SLICE_S), REF_HUB_ROUND_S=str(HUB_ROUND_S))
        full_env.update(REF_HUB_POLL_S=str(POLL_S))
        argv = [sys.executable, "-m", "bench.ref_pywsgi", str(port)]
    elif name == "fastapi":
        argv = [sys.executable, "-m", "uvicorn", "bench.ref_fastapi:app", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--workers", "1", "--no-access-log", "--log-level", "warning"]
        argv += ["--backlog", "2048"]
    else:
        raise ValueError(f"unknown server {name!r}; choose from {NAMES}")
    return _launch(name, argv, full_env, port, health_port, logdir, env or {}, ready_s, root)


def start_llamacpp(python: str, model: Path, alias: str, logdir: Path) -> Server:
    """Start llama.cpp's OpenAI server on ``model``, one thread, pinned to the server core.

    Args:
        python: the interpreter of the virtualenv holding ``llama-cpp-python[server]``.
        model: the GGUF file.
        alias: the model name it answers to (greenserve's name for the same file).
        logdir: where its log file goes.

    Returns:
        The server, once ``GET /v1/models`` answers.

    Raises:
        RuntimeError: the server exited or did not become ready within 30 s (with its log tail).
    """
    port = free_port()
    argv = [python, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias]
    argv += ["--host", "127.0.0.1", "--port", str(port), *LLAMACPP_FLAGS]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return _launch("llamacpp", argv, env, port, None, logdir, {}, ready_path="/v1/models")


def _launch(
    name: str,
    argv: list[str],
    full_env: dict[str, str],
    port: int,
    health_port: int | None,
    logdir: Path,
    env: dict[str, str],
    ready_s: float = 30.0,
    root: Path = ROOT,
    ready_path: str = "/healthz",
) -> Server:
    """Run ``argv`` pinned to the server core; return once ``ready_path`` (and ``/healthz`` on
    ``health_port``) answer 200."""
    server_cores, _ = cores()
    argv = ["taskset", "-c", ",".join(map(str, server_cores)), *argv]
    logdir.mkdir(parents=True, exist_ok=True)
    log_path = logdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=root,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_raise_nofile,
        )
    server = Server(name, port, health_port, proc, log_path, env)
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
        if _healthy(port, ready_path) and (health_port is None or _healthy(health_port)):
            return server
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} not ready after {ready_s:g} s:\n{_tail(log_path)}")
        time.sleep(0.1)


def _healthy(port: int, path: str = "/healthz") -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
