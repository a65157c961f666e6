"""A client that leaves while its request waits for its first token frees the engine within 2 s.

A stream that has no token yet (queued, or its prompt being read) writes a comment every
``WAITING_HEARTBEAT_S`` (0.5 s), whatever ``HEARTBEAT_S`` is: a client that left is found by a failed
write and its sequence is dropped at the engine's next step, mid-prompt. A non-streamed answer cannot
write before its status, so a client whose end closed (a FIN, a half-close included) while it is
queued or prefilling is gone: 499 in the log, its connection closed with nothing written, its slot
or queue place freed (nginx's proxy takes a client so). A stream whose client only half-closed is
still served (``tests/test_half_close.py``). Each test drives a real gunicorn over raw sockets.

Source: docs/ARCHITECTURE.md §9; RFC 9112 §7.1 (chunked coding).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlencode

import pytest

from tests.loglines import request_line
from tests.server import SLACK_S, GunicornServer, read_all, send_request, wait_until

# from the client's close to its slot or queue place freed: twice the longest wait
# docs/ARCHITECTURE.md §9 gives (two waiting heartbeats, 1 s, in the queue), for a loaded machine
GONE_WITHIN_S = 2.0
# The most a waiting stream's comments may be apart as the client sees them: the 0.5 s heartbeat
# falls on an engine tick (0.25 s) and a busy two-core machine delays the hub a little more.
MAX_COMMENT_GAP_S = 1.2
# ~5,600 SmolLM2 tokens: a prefill of ~44 chunks of 128 rows, seconds of engine work.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 560


class Frames(threading.Thread):
    """Read one chunked event stream on ``sock`` in the background: the head, then every chunk (one
    SSE event or comment each, as the server writes them) with the ``time.monotonic()`` it arrived.
    Ends (and closes ``sock``) at the last chunk, the connection's end or its close."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.head = b""
        self.frames: list[tuple[float, bytes]] = []
        self._buf = b""
        self.start()

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError
        self._buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            self._more()
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._more()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def run(self) -> None:
        try:
            while b"\r\n\r\n" not in self._buf:
                self._more()
            self.head, self._buf = self._buf.split(b"\r\n\r\n", 1)
            while size := int(self._line(), 16):
                frame = self._take(size)
                self._take(2)
                self.frames.append((time.monotonic(), frame))
        except (EOFError, OSError):
            pass
        finally:
            self.sock.close()

    def data_at(self) -> float | None:
        """When the first ``data:`` event arrived, or None."""
        return next((t for t, f in self.frames if f.startswith((b"data: ", b"id: "))), None)

    def comment_gaps(self, until: float) -> list[float]:
        """The gaps (seconds) between consecutive frames that arrived before ``until``, every one of
        them a comment or the opening ``retry:``."""
        before = [(t, f) for t, f in self.frames if t < until]
        assert all(f.startswith((b": ", b"retry: ")) for _, f in before), before
        return [b[0] - a[0] for a, b in zip(before, before[1:], strict=False)]


def leave(sock: socket.socket) -> float:
    """Close ``sock`` as a client that goes away; return when (``time.monotonic()``)."""
    left = time.monotonic()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    return left


def state(srv: GunicornServer) -> tuple[int, int]:
    """``(busy slots, queued requests)`` of the worker."""
    s = srv.state()
    return s["slots"]["busy"], s["queue"]["waiting"]


# -- a long SmolLM2 prefill ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_one_slot(smollm2_gguf, smollm2, gguf_cache_dir, tmp_path_factory):
    """SmolLM2 with one slot of one sequence: the engine batch holds a single sequence, so another
    can start only once the engine has dropped the one before it."""
    env = {
        "MODEL_DIR": str(smollm2_gguf),
        "GREENSERVE_CACHE_DIR": str(gguf_cache_dir),  # built by ``smollm2``: the server maps it
        "MAX_SLOTS": "1",
        "MAX_N": "1",
    }
    srv = GunicornServer(tmp_path_factory.mktemp("leave-smollm2"), env)
    srv.start(timeout_s=120)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_stream_that_leaves_mid_prefill_frees_the_engine_within_2_s(smollm2_one_slot):
    srv = smollm2_one_slot
    body = {"model": "s", "prompt": LONG_PROMPT, "max_tokens": 8, "stream": True}
    leaver = Frames(send_request(srv.port, body, "prefill-leaver"))
    wait_until(lambda: srv.in_flight("prefill-leaver"), what="the long prompt to start")
    short = {"model": "s", "prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0}
    waiter = Frames(send_request(srv.port, short, "prefill-waiter"))
    wait_until(lambda: state(srv) == (1, 1), what="the short request queued behind it")
    wait_until(lambda: len(leaver.frames) >= 5, what="four heartbeats of the prefill")
    assert leaver.data_at() is None  # still reading its prompt
    left = leave(leaver.sock)
    wait_until(lambda: state(srv)[1] == 0, GONE_WITHIN_S + 5, "the slot handed to the waiter")
    assert time.monotonic() - left <= GONE_WITHIN_S
    leaver.join(5)

    # Heartbeats every ~0.5 s: ": ping" while the prompt is read, ": queued" behind it.
    assert leaver.head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert [f for _, f in leaver.frames] == [b": ok\n\n"] + [b": ping\n\n"] * (
        len(leaver.frames) - 1
    )
    assert max(leaver.comment_gaps(left)) <= MAX_COMMENT_GAP_S, leaver.frames
    # The engine dropped the sequence mid-prompt: the waiter's sequence fits its one-sequence batch.
    # Its first token waits for the engine step in flight (~0.3 s idle, over 1 s on a busy machine):
    # the bound, with the suite's tolerance for a busy machine (``SLACK_S``).
    wait_until(waiter.data_at, GONE_WITHIN_S + 10, "the waiter's first token")
    assert waiter.data_at() - left <= GONE_WITHIN_S + SLACK_S, (
        waiter.data_at() - left,
        waiter.frames,
    )
    assert waiter.frames[0][1] == b": ok\n\n" and b": queued\n\n" in [f for _, f in waiter.frames]
    assert max(waiter.comment_gaps(waiter.data_at())) <= MAX_COMMENT_GAP_S, waiter.frames
    waiter.join(10)
    assert waiter.frames[-1][1] == b"data: [DONE]\n\n"

    line = request_line(srv, "prefill-leaver", 5)
    assert (line["status"], line["end_reason"], line["finish_reason"]) == (
        200,
        "client_left",
        "abort",
    )
    assert (line["prompt_tokens"], line["completion_tokens"], line["ttft_s"]) == (5601, 0, None)
    line = request_line(srv, "prefill-waiter", 5)
    assert (line["status"], line["completion_tokens"], line["end_reason"]) == (200, 1, "finished")
    srv.wait_idle(5)


# -- the bigram, one slot held by a slow stream -------------------------------------------------


@pytest.fixture(scope="module")
def one_slot(succ_dir, serve_module):
    """One slot, 50 tokens/s, the default ``HEARTBEAT_S`` (15 s)."""
    return serve_module(
        MODEL_DIR=str(succ_dir), MAX_SLOTS="1", GREENSERVE_FAULTS="slow_step_s=0.02"
    )


def hold(srv: GunicornServer, request_id: str) -> Frames:
    """Start a 4 s stream on the only slot."""
    body = {"model": "m", "prompt": "a", "max_tokens": 200, "stream": True}
    holder = Frames(send_request(srv.port, body, request_id))
    wait_until(lambda: state(srv) == (1, 0) and srv.in_flight(request_id), what="the slot held")
    return holder


def ending(srv: GunicornServer, request_id: str) -> tuple[int, str, int, str | None]:
    """The request line's ``(status, end_reason, completion_tokens, error)``, once it is logged."""
    line = request_line(srv, request_id)
    return line["status"], line["end_reason"], line["completion_tokens"], line["error"]


def test_a_plain_request_whose_client_half_closes_while_queued_is_gone_within_2_s(one_slot):
    srv = one_slot
    holder = hold(srv, "plain-holder")
    queued = send_request(srv.port, {"model": "m", "prompt": "a", "max_tokens": 5}, "plain-fin")
    wait_until(lambda: state(srv) == (1, 1), what="the plain request queued")
    queued.shutdown(socket.SHUT_WR)  # a FIN: done sending, still reading
    fin = time.monotonic()
    gone = ending(srv, "plain-fin")
    assert time.monotonic() - fin <= GONE_WITHIN_S
    assert state(srv) == (1, 0) and srv.in_flight("plain-holder")  # its queue place freed
    assert gone == (499, "client_left", 0, "client disconnected while queued")
    assert read_all(queued) == b""  # the connection ends with no answer written
    holder.join(10)
    assert holder.frames[-1][1] == b"data: [DONE]\n\n"
    srv.wait_idle(5)


def test_a_plain_request_whose_client_half_closed_on_an_idle_server_is_never_started(one_slot):
    srv = one_slot
    srv.wait_idle(5)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    # Corked, the request and the FIN leave in one segment: the FIN is there when the slot comes
    # (at once: the server is idle), the one moment the FIN is looked for before any work.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    data = json.dumps({"model": "m", "prompt": "a", "max_tokens": 5}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: idle-fin\r\nContent-Length: %d\r\n\r\n" % len(data) + data
    )
    sock.shutdown(socket.SHUT_WR)
    assert read_all(sock) == b""
    assert ending(srv, "idle-fin") == (499, "client_left", 0, "client disconnected while queued")
    # The same request from a client that keeps its end open is answered.
    status, _, raw = srv.complete({"model": "m", "prompt": "a", "max_tokens": 5, "temperature": 0})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "bcdef"
    srv.wait_idle(5)


def test_a_queued_eventsource_stream_writes_heartbeats_and_leaves_within_2_s(one_slot):
    srv = one_slot
    holder = hold(srv, "es-holder")
    query = urlencode({"model": "m", "prompt": "a", "max_tokens": 5})
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.sendall(
        b"GET /v1/completions?%s HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n"
        b"X-Request-Id: es-queued\r\n\r\n" % query.encode()
    )
    stream = Frames(sock)
    wait_until(lambda: len(stream.frames) >= 4, what="three heartbeats in the queue")
    left = leave(sock)
    stream.join(5)
    assert [f for _, f in stream.frames] == [b"retry: 3000\n\n"] + [b": queued\n\n"] * (
        len(stream.frames) - 1
    )
    assert max(stream.comment_gaps(left)) <= MAX_COMMENT_GAP_S, stream.frames
    gone = ending(srv, "es-queued")
    assert time.monotonic() - left <= GONE_WITHIN_S
    assert state(srv) == (1, 0) and srv.in_flight("es-holder")  # its queue place freed
    assert gone == (200, "client_left", 0, None)
    holder.join(10)
    srv.wait_idle(5)
