"""Requests cut by a killed worker are logged and counted.

A worker killed by a signal (``kill -9``, the OOM killer) cannot log the requests it was serving:
their streams ended without ``[DONE]`` and left no line and no metric, so availability figures never
counted worker crashes. The master reads the dead worker's running and queued gauges before it marks
it dead, and writes one log line and ``greenserve_requests_total{end_reason="worker_lost"}``.

Source: docs/ARCHITECTURE.md §9 (why it ended), §10 (Prometheus).
"""

from __future__ import annotations

import json
import os
import signal
import socket

from tests.server import raw_request, wait_until

LABELS = ('endpoint="unknown"', 'status="502"', 'finish_reason="error"', 'end_reason="worker_lost"')


def lost_count(srv) -> float:
    status, _, text = srv.get("/metrics", port=srv.health_port)
    assert status == 200
    for line in text.decode().splitlines():
        if line.startswith("greenserve_requests_total{") and all(x in line for x in LABELS):
            return float(line.split()[-1])
    return 0.0


def test_streams_of_a_killed_worker_are_logged_and_counted(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), GREENSERVE_FAULTS="slow_step_s=0.05")
    body = {"model": "m", "prompt": "A", "max_tokens": 400, "stream": True}
    streams = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
    for i, sock in enumerate(streams):
        sock.sendall(raw_request(body, request_id=f"lost-{i}"))
    wait_until(lambda: srv.state()["slots"]["busy"] == 2, 10, "two streams in flight")
    worker = srv.state()["pid"]
    wait_until(lambda: lost_count(srv) == 0 and srv.state()["requests"], 5, "the gauges written")
    os.kill(worker, signal.SIGKILL)
    for sock in streams:  # cut: no [DONE]
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        assert b"[DONE]" not in data
    wait_until(lambda: lost_count(srv) == 2, 30, lambda: f"the count; log:\n{srv.log_tail()}")
    lines = [json.loads(x) for x in srv.log_text().splitlines() if x.startswith("{")]
    lost = [x for x in lines if x.get("end_reason") == "worker_lost"]
    assert len(lost) == 1 and lost[0]["worker_pid"] == worker, lost
    assert lost[0]["lost_requests"] == 2 and lost[0]["level"] == "ERROR"
    # A worker that exits through its hooks (a reload) loses nothing.
    booted = srv.log_text().count("Booting worker")
    srv.signal(signal.SIGHUP)
    wait_until(lambda: srv.log_text().count("Booting worker") > booted, 30, "the reload")
    srv.wait_workers(1)
    assert lost_count(srv) == 2
