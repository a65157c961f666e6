"""SIGTERM: idle keep-alive connections closed at once (as nginx does), in-flight requests answered
``Connection: close``, the listeners closed (new connections refused, the backlog reset, while the
streams in flight finish), a worker stopping alone leaving the listeners to the others, a SIGTERM
that comes while a worker boots stopping it as gracefully as a late one, and the worker's exit hooks
always running within the grace period.

Source: RFC 9112 §9.6 (tear-down); gunicorn's ``graceful_timeout`` and ``worker_exit`` hook.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.collector import FakeCollector
from tests.loglines import request_line
from tests.server import SLACK_S, wait_until
from tests.sse import SHUTDOWN_END, open_stream


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


def listening_ports(pid: int) -> set[int]:
    """The TCP ports of the listening sockets process ``pid`` holds a descriptor of (Linux's /proc)."""
    listening: dict[str, int] = {}  # socket inode -> port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            held.add(listening[target[8:-1]])
    return held


def refused(port: int) -> bool:
    """True when a connection to ``port`` is refused; a connection that is made is closed again."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_refuses_new_connections_and_resets_the_backlog_while_a_stream_finishes(
    serve, succ_dir
):
    srv = serve(
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS="slow_step_s=0.02",
        GRACEFUL_TIMEOUT_S="5",  # the stream is ended 3.5 s after SIGTERM
        WORKER_CONNECTIONS="1",  # the stream fills the API port's one place: a backlog forms
    )
    body = {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
    stream = open_stream(srv.port, body, "in-flight")
    assert stream.next_frame() == b": ok\n"
    assert stream.next_frame().startswith(b"data: {")  # generating
    # Connected (the kernel's handshake) and sent, but never accepted: the worker has no place.
    waiting = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    waiting.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
    srv.signal(signal.SIGTERM)
    stopped = time.monotonic()
    # Both ports refuse at once (the master and the worker closed them): a load balancer tries the
    # next host now, not after the grace period. Within SLACK_S, far short of the stream's 3.5 s.
    for port in srv.ports:
        wait_until(lambda port=port: refused(port), SLACK_S, f"port {port} to refuse")
    # What waited in the backlog is reset, not left hanging until the worker exits.
    with pytest.raises(ConnectionResetError):
        waiting.recv(1)
    waiting.close()
    assert time.monotonic() - stopped < SLACK_S
    # The stream in flight still ends as a stop ends it: the final error event and [DONE].
    rest = stream.resp.read()
    assert rest.endswith(SHUTDOWN_END), rest[-300:]
    assert time.monotonic() - stopped > 5 - 1.5 - 0.5  # at END_STREAMS_S before the grace ends
    stream.close()
    assert srv.wait(10) == 0
    log = srv.log_text()
    assert "Worker exiting" in log and "graceful timeout" not in log, srv.log_tail()
    assert "Socket error" not in log and "Traceback" not in log, srv.log_tail()


@pytest.mark.parametrize("reuse_port", [False, True], ids=["shared sockets", "reuse_port"])
def test_a_worker_that_stops_alone_leaves_the_listeners_to_the_others(serve, succ_dir, reuse_port):
    # Shared sockets: the worker closes its copy only, and the others keep accepting on them. Under
    # --reuse-port each worker has sockets of its own, and the kernel spreads new connections over
    # them: the stopping worker's, left open, would take a share and leave it hanging.
    srv = serve(
        workers=2,
        reuse_port=reuse_port,
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS="slow_step_s=0.02",
        GRACEFUL_TIMEOUT_S="4",  # the stream is ended 2.5 s after its worker's SIGTERM
    )
    srv.wait_workers(2)
    body = {"model": "m", "prompt": "a", "max_tokens": 1000, "stream": True}
    stream = open_stream(srv.port, body, "draining")
    assert stream.next_frame() == b": ok\n"

    def streaming_worker() -> int | None:
        s = srv.state()
        return s["pid"] if any(r["request_id"] == "draining" for r in s["requests"]) else None

    stopping = wait_until(streaming_worker, 10, "the stream's worker")
    assert listening_ports(stopping) == set(srv.ports)
    os.kill(stopping, signal.SIGTERM)  # as the master stops one worker (TTOU, a reload)
    # It closes its listeners at once, not when its stream is done (2.5 s later)...
    wait_until(lambda: not listening_ports(stopping), SLACK_S, "the worker to close its listeners")
    # ... while the other worker answers every new connection on both ports: nothing refused,
    # nothing left hanging.
    for _ in range(10):
        for port in srv.ports:
            status, _, answer = srv.get("/ready", port=port, timeout_s=1)
            assert (status, json.loads(answer)) == (200, {"status": "ready"})
        status, _, answer = srv.complete(
            {"model": "m", "prompt": "a", "max_tokens": 3, "temperature": 0}, timeout_s=1
        )
        assert (status, json.loads(answer)["choices"][0]["text"]) == (200, "bcd")
        assert srv.state()["pid"] != stopping
    assert stream.resp.read().endswith(SHUTDOWN_END)
    stream.close()
    wait_until(lambda: f"Worker exiting (pid: {stopping})" in srv.log_text(), 10, "its exit")
    assert "graceful timeout" not in srv.log_text(), srv.log_tail()


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGQUIT], ids=["SIGINT", "SIGQUIT"])
def test_a_quick_stop_still_logs_the_requests_it_cuts(serve, succ_dir, sig):
    # Ctrl-C (SIGINT) and SIGQUIT are gunicorn's quick stop: the worker exits within ~0.1 s, its
    # streams cut without [DONE]. Each request it cuts still gets its access line (end_reason
    # "shutdown"), where gunicorn's own quick exit left them unfinished and unlogged.
    srv = serve(
        MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="slow_step_s=0.02", GRACEFUL_TIMEOUT_S="10"
    )
    body = {"model": "m", "prompt": "a", "max_tokens": 500, "stream": True, "temperature": 0}
    stream = open_stream(srv.port, body, "quick-stream")
    plain = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    plain.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": False}),
        {"X-Request-Id": "quick-json"},
    )
    wait_until(
        lambda: all(
            (srv.in_flight(r) or {}).get("tokens", 0) > 0 for r in ("quick-stream", "quick-json")
        ),
        what="both requests to generate",
    )
    srv.signal(sig)
    stopped = time.monotonic()
    assert srv.wait(10) == 0
    assert time.monotonic() - stopped < 2.0  # quick: not the 10 s grace period
    with pytest.raises(http.client.IncompleteRead) as cut:  # the chunked body never ends
        stream.resp.read()
    assert not cut.value.partial.endswith(b"data: [DONE]\n\n")
    with pytest.raises((http.client.IncompleteRead, http.client.RemoteDisconnected)):
        plain.getresponse().read()  # the JSON answer never came
    # The stream had sent its 200; the JSON request had no answer yet: a 503, as a span says too.
    for rid, status, finish_reason in (
        ("quick-stream", 200, "abort"),
        ("quick-json", 503, "error"),
    ):
        line = request_line(srv, rid)
        assert (line["status"], line["end_reason"], line["finish_reason"]) == (
            status,
            "shutdown",
            finish_reason,
        ), line
    stream.close(), plain.close()
