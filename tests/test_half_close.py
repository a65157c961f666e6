"""A streamed request whose client half-closed (``SHUT_WR``) after sending it is served to its end: a
FIN says the client sends nothing more, not that it stopped reading (RFC 9293 §3.6; RFC 9112 §9.6).
Only a failed write or a reset ends a stream early. On a real gunicorn, queued and running."""

from __future__ import annotations

import json
import socket

import pytest

from tests.loglines import request_line
from tests.server import read_all, send_request

BODY = {"model": "m", "prompt": "a", "max_tokens": 5, "stream": True, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot(succ_dir, tmp_path_factory):
    """One worker, one slot, 50 tokens/s, heartbeats every 0.2 s while queued."""
    from tests.server import GunicornServer

    env = {
        "MODEL_DIR": str(succ_dir),
        "MAX_SLOTS": "1",
        "GREENSERVE_FAULTS": "slow_step_s=0.02",
        "HEARTBEAT_S": "0.2",
    }
    with GunicornServer(tmp_path_factory.mktemp("half-close"), env) as srv:
        yield srv


def dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + body[:n], body[n + 2 :]


def served_in_full(srv, sock: socket.socket, request_id: str) -> tuple[list[str], dict]:
    head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
    assert b"\r\nTransfer-Encoding: chunked\r\n" in head + b"\r\n"
    events = dechunk(body)
    line = request_line(srv, request_id)
    return events.decode().split("\n\n"), line


def test_a_half_closed_stream_that_waits_for_a_slot_is_served_to_its_end(one_slot):
    holder = send_request(
        one_slot.port, {**BODY, "max_tokens": 40}, "holder"
    )  # ~0.8 s on the only slot
    assert holder.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    queued = send_request(one_slot.port, BODY, "half-closed-queued")
    queued.shutdown(socket.SHUT_WR)  # the client is done sending; it still reads
    frames, line = served_in_full(one_slot, queued, "half-closed-queued")
    assert frames[0] == ": ok" and ": queued" in frames  # heartbeats reached it while it waited
    data = [f for f in frames if f.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    tokens = [json.loads(f[len("data: ") :])["choices"][0] for f in data[:-1]]
    assert len(tokens) == 5 and tokens[-1]["finish_reason"] == "length"
    assert (line["status"], line["completion_tokens"], line["end_reason"]) == (200, 5, "finished")
    assert line["queue_wait_s"] > 0
    read_all(holder)


def test_a_half_closed_stream_is_served_while_it_runs_and_a_reset_still_ends_one(one_slot):
    one_slot.wait_idle()
    running = send_request(one_slot.port, {**BODY, "max_tokens": 20}, "half-closed-running")
    running.shutdown(socket.SHUT_WR)
    frames, line = served_in_full(one_slot, running, "half-closed-running")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert (line["completion_tokens"], line["end_reason"]) == (20, "finished")
    # A client that closes for good (the server's next write meets a reset) is still taken for gone.
    gone = send_request(one_slot.port, {**BODY, "max_tokens": 200}, "closed")
    assert gone.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    gone.close()
    line = request_line(one_slot, "closed", 15)
    assert line["end_reason"] == "client_left" and line["completion_tokens"] < 200
