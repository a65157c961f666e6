"""SIGTERM with idle keep-alive connections: closed at once (as nginx does), in-flight requests answered
``Connection: close``, a SIGTERM that comes while a worker boots stopping it as gracefully as a late
one, and the worker's exit hooks always running within the grace period.

Source: RFC 9112 §9.6 (tear-down); gunicorn's ``graceful_timeout`` and ``worker_exit`` hook.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.collector import FakeCollector
from tests.server import wait_until


def test_sigterm_closes_idle_keepalive_connections_and_flushes(serve, succ_dir):
    with FakeCollector() as collector, contextlib.ExitStack() as opened:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GREENSERVE_FAULTS="slow_step_s=0.02",
            KEEPALIVE_S="30",
            GRACEFUL_TIMEOUT_S="3",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        idle = []
        for i in range(5):  # each answers one request, then idles on keep-alive
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            opened.callback(conn.close)
            conn.request("GET", "/v1/models", headers={"X-Request-Id": f"idle-{i}"})
            resp = conn.getresponse()
            resp.read()
            assert resp.getheader("Connection") == "keep-alive"
            idle.append(conn)
        busy = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        opened.callback(busy.close)
        body = {"model": "m", "prompt": "a", "max_tokens": 40, "temperature": 0}  # ~0.8 s
        busy.request("POST", "/v1/completions", json.dumps(body), {"X-Request-Id": "in-flight"})
        wait_until(  # SIGTERM comes while the request is being generated
            lambda: (srv.in_flight("in-flight") or {}).get("tokens", 0) > 0,
            what="the in-flight request to generate",
        )
        srv.signal(signal.SIGTERM)
        stopped = time.monotonic()
        resp = busy.getresponse()
        assert resp.status == 200 and resp.getheader("Connection") == "close"
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 40
        for conn in idle:  # closed by the server: the socket reads EOF at once
            assert conn.sock.recv(1) == b""
        assert srv.wait(10) == 0
        exit_s = time.monotonic() - stopped
        log = srv.log_text()
        assert "Worker exiting" in log and "graceful timeout" not in log, srv.log_tail()
        assert exit_s < 3.0, exit_s  # not the whole grace period, let alone a SIGKILL
        for rid in ["in-flight"] + [f"idle-{i}" for i in range(5)]:
            collector.span_for(rid, timeout_s=1)


def test_sigterm_closes_connections_that_sent_nothing_and_ends_a_stalled_head_quietly(
    serve, succ_dir
):
    srv = serve(MODEL_DIR=str(succ_dir), GRACEFUL_TIMEOUT_S="3", HEADER_TIMEOUT_S="10")
    with contextlib.ExitStack() as opened:
        silent = [
            opened.enter_context(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            for _ in range(3)
        ]
        partial = opened.enter_context(
            socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        )
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        # Accepted in order: once a later connection is answered, the worker has accepted these
        # and waits for their requests.
        assert srv.get("/healthz")[0] == 200
        srv.signal(signal.SIGTERM)
        stopped = time.monotonic()
        for sock in silent:  # shut down at once, as an idle keep-alive connection: EOF, no answer
            assert sock.recv(1) == b""
            assert time.monotonic() - stopped < 3.0 / 2  # not at the grace period's end
        # The stalled head is ended at the end of the grace period: closed, without a 500.
        assert partial.recv(65536) == b""
        assert srv.wait(10) == 0
        log = srv.log_text()
        assert "Worker exiting" in log
        assert "Internal Server Error" not in log and "GreenletExit" not in log, srv.log_tail()


# A configuration that runs greenserve's, with the new worker paused (PAUSE_S) in the window between
# its fork and gunicorn's installing its signal handlers: before the ``post_fork`` hook (the master's
# handler still in place) or after it (the stop signals held). The window is the real one, widened.
PAUSED_BOOT = """
import time

import wsgi_app.gunicorn_config as greenserve
from wsgi_app.gunicorn_config import *  # noqa: F403

PAUSE_S = 1.0


def post_fork(server, worker):
    if {before}:
        time.sleep(PAUSE_S)
    greenserve.post_fork(server, worker)
    if not {before}:
        time.sleep(PAUSE_S)
"""
_BOOTING = re.compile(r"Booting worker with pid: (\d+)")


@pytest.mark.parametrize(
    "pause",
    [None, "before post_fork", "after post_fork"],
    ids=["natural window", "paused before post_fork", "paused after post_fork"],
)
def test_sigterm_as_a_worker_boots_stops_it_gracefully(serve, succ_dir, tmp_path: Path, pause):
    args: tuple[str, ...] = ()
    if pause is not None:
        config = tmp_path / "paused_boot.py"
        config.write_text(PAUSED_BOOT.format(before=pause.startswith("before")))
        args = ("-c", str(config))  # the last -c is gunicorn's configuration
    grace_s = 12
    srv = serve(args=args, MODEL_DIR=str(succ_dir), GRACEFUL_TIMEOUT_S=str(grace_s))
    booted = len(_BOOTING.findall(srv.log_text()))

    def new_worker() -> str | None:
        """The pid of the worker forked after ``booted`` others, once it logged its boot."""
        found = _BOOTING.findall(srv.log_text())
        return found[booted] if len(found) > booted else None

    srv.signal(signal.SIGTTIN)  # one worker more: the master forks it now
    # Without a pause, the window after its boot line is the natural one (~0.1 s, gevent's patching
    # most of it): the log is polled every 20 ms.
    pid = int(wait_until(new_worker, 10, "the new worker to boot"))
    srv.signal(signal.SIGTERM)  # the master stops, and SIGTERMs the new worker in its window
    stopped = time.monotonic()
    assert srv.wait(grace_s + 10) == 0
    # Halfway to the grace period's end, where the arbiter kills a worker that missed the signal.
    assert time.monotonic() - stopped < grace_s / 2, srv.log_tail()
    log = srv.log_text()
    # Its exit path ran: gunicorn logs this line, then runs the worker_exit hook.
    assert f"Worker exiting (pid: {pid})" in log, srv.log_tail()
    assert "SIGKILL" not in log and "graceful timeout" not in log, srv.log_tail()
