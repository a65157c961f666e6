"""A closed-loop load generator in one process: raw non-blocking sockets on one epoll selector.

Each of ``concurrency`` slots sends ``POST /v1/completions``, reads the answer, and starts the next
request as soon as the previous one ends, until the measurement window closes. Two kinds of client:
one request per connection (``Connection: close``, the default: a new connection per request, as
most clients and every load balancer health check open), or ``keepalive``, the next request on the
same connection once the answer's framing (the chunked body's last chunk, or ``Content-Length``)
says it ended.
Parsing is minimal on purpose, so the client costs far less CPU than the server: a streamed answer is
counted by its ``data: {`` events (split across reads is handled), checked for ``data: [DONE]`` and
for error events; a plain answer by the ``completion_tokens`` of its usage. The client measures its
own CPU, and (from /proc) the server's CPU and RSS over the same window.

Source: RFC 9112 (HTTP/1.1 messages, chunked coding); WHATWG HTML §9.2 (event streams).
"""

from __future__ import annotations

import errno
import re
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from bench import procstat
from bench.loadstats import Results, Window, account, report

_DATA = b"data: {"
_ERROR = b'data: {"error"'
_DONE = b"data: [DONE]"
_TAIL = len(_ERROR) - 1  # bytes kept between reads so a split pattern is still seen once
_USAGE = re.compile(rb'"completion_tokens":(\d+)')
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")
_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)
_LAST_CHUNK = b"\r\n0\r\n\r\n"  # a chunked body's end (no trailers)
_RECV = 262144


@dataclass
class LoadSpec:
    """One load run.

    Attributes:
        port: the server's API port on 127.0.0.1.
        body: the JSON request body.
        stream: whether the body asks for a stream.
        expect_tokens: tokens every answer must carry (``max_tokens``).
        extra_events: ``data: {`` events a stream carries besides one per token (llama.cpp's server
            ends with an empty-text chunk holding ``finish_reason``: 1); tokens/s counts events and
            scales them by ``expect_tokens / (expect_tokens + extra_events)``.
        concurrency: requests in flight.
        warmup_s: seconds of load before the measurement window opens.
        duration_s: length of the measurement window, seconds.
        drain_s: after the window, seconds to let in-flight requests finish (then they are dropped).
        ramp_s: the first ``concurrency`` requests start evenly over this many seconds, so that a
            closed loop does not keep them in lockstep (all finishing, and restarting, at once).
        timeout_s: per-request limit, seconds.
        spin: poll without sleeping (keeps the client core awake; see the README).
        keepalive: send each slot's next request on the same connection (else a new one each).
        probe_ports: ports to send ``GET /healthz`` to, one at a time each, every ``probe_every_s``.
        server_pids: processes whose CPU and RSS are reported.
    """

    port: int
    body: bytes
    stream: bool
    expect_tokens: int
    concurrency: int
    extra_events: int = 0
    warmup_s: float = 1.0
    duration_s: float = 5.0
    drain_s: float = 5.0
    timeout_s: float = 60.0
    spin: bool = True
    keepalive: bool = False
    probe_ports: tuple[int, ...] = ()
    probe_every_s: float = 0.02
    ramp_s: float = 0.0
    server_pids: list[int] = field(default_factory=list)
    server_cores: list[int] = field(default_factory=list)


def http_request(
    method: str, path: str, port: int, body: bytes = b"", keepalive: bool = False
) -> bytes:
    """Return one HTTP/1.1 request (``Connection: close`` unless ``keepalive``) as bytes."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if not keepalive:
        head += "Connection: close\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class Conn:
    """One request on one socket."""

    __slots__ = (
        "sock",
        "out",
        "t0",
        "t_first",
        "t_last",
        "status",
        "tokens",
        "events",
        "errors",
        "done",
        "tail",
        "head",
        "body",
        "probe",
        "fd",
        "t_head",
        "length",
        "seen",
        "end_tail",
    )

    def __init__(self, sock: socket.socket, out: bytes, t0: float, probe: int = 0) -> None:
        self.sock = sock
        self.out = out
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.status = 0
        self.tokens = 0
        self.events = 0
        self.errors = 0
        self.done = False
        self.tail = b""
        self.head: bytes | None = b""  # None once the status line and headers are read
        self.body: list[bytes] = []
        self.probe = probe  # the probed port, or 0 for a load request
        self.fd = sock.fileno()
        self.t_head: float | None = None
        self.length: int | None = None  # the body's Content-Length, None when chunked
        self.seen = 0  # body bytes read
        self.end_tail = b""  # the body's last bytes, to see a chunked body end across reads

    def again(self, out: bytes, t0: float) -> None:
        """Start the next request on this (kept-alive) connection."""
        self.__init__(self.sock, out, t0, self.probe)

    def ended(self, data: bytes) -> bool:
        """Note body bytes ``data``; True once the answer's framing says it is complete."""
        self.seen += len(data)
        if self.length is not None:
            return self.seen >= self.length
        self.end_tail = (self.end_tail + data)[-len(_LAST_CHUNK) :]
        return self.end_tail == _LAST_CHUNK


def _connect(sel: selectors.BaseSelector, port: int, out: bytes, probe: int = 0) -> Conn:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Conn(sock, out, time.perf_counter(), probe)
    err = sock.connect_ex(("127.0.0.1", port))
    if err not in (0, errno.EINPROGRESS):
        sock.close()
        raise ConnectionRefusedError(err)
    sel.register(sock, selectors.EVENT_WRITE, conn)
    return conn


def _on_event(
    sel: selectors.BaseSelector, conn: Conn, mask: int, now: float, res: Results, w
) -> str:
    """Advance ``conn``; return "" while it runs, "ok" when finished well, else an error kind."""
    sock = conn.sock
    if conn.out:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return "connect"
        try:
            sent = sock.send(conn.out)
        except BlockingIOError:
            return ""
        except OSError:
            return "reset"
        conn.out = conn.out[sent:]
        if not conn.out:
            sel.modify(sock, selectors.EVENT_READ, conn)
        return ""
    try:
        data = sock.recv(_RECV)
    except BlockingIOError:
        return ""
    except OSError:
        return "reset"
    if not data:
        return _judge(conn, res, w)
    if conn.head is not None:
        head = conn.head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            conn.head = head
            return ""
        match = _STATUS.match(head)
        conn.status = int(match.group(1)) if match else -1
        conn.head = None
        conn.t_head = now
        length = _LENGTH.search(head, 0, end + 2)
        conn.length = int(length.group(1)) if length else None
        data = head[end + 4 :]
        if conn.t_first is None and not conn.probe and not w.stream_spec:
            conn.t_first = now  # a plain answer: its first byte
    complete = w.keepalive and conn.ended(data)
    if conn.probe or not w.stream_spec or conn.status != 200:
        conn.body.append(data)
        return _judge(conn, res, w) if complete else ""
    buf = conn.tail + data
    n = buf.count(_DATA) - conn.tail.count(_DATA)
    if n:
        errs = buf.count(_ERROR) - conn.tail.count(_ERROR)
        conn.errors += errs
        n -= errs
    if not conn.done and _DONE in buf:
        conn.done = True
    conn.tail = buf[-_TAIL:]
    if n:
        conn.tokens += n
        if conn.t_first is None:
            conn.t_first = now
        elif w.start <= now < w.end:
            res.gaps.append(now - conn.t_last)
        if w.start <= now < w.end:
            res.tokens_in_window += n
            res.zero_gaps += n - 1
        conn.t_last = now
    return _judge(conn, res, w) if complete else ""


def _judge(conn: Conn, res: Results, w) -> str:
    if conn.probe:
        return "ok" if conn.status == 200 else f"http_{conn.status}"
    if conn.status != 200:
        return f"http_{conn.status}"
    if w.stream_spec:
        if conn.errors:
            return "error_event"
        if not conn.done:
            return "no_done"
        if conn.tokens != w.expect:
            return "short_stream"
        return "ok"
    match = _USAGE.search(b"".join(conn.body))
    if match is None:
        return "bad_body"
    conn.tokens = int(match.group(1))
    return "ok" if conn.tokens == w.expect else "short_answer"


def run_load(spec: LoadSpec) -> dict[str, Any]:
    """Run ``spec`` and return its results (see the README's column list)."""
    procstat.raise_nofile()
    sel = selectors.EpollSelector()
    request = http_request("POST", "/v1/completions", spec.port, spec.body, spec.keepalive)
    probe_req = {p: http_request("GET", "/healthz", p) for p in spec.probe_ports}
    res = Results()
    res.probes = {p: [] for p in spec.probe_ports}
    t_begin = time.perf_counter()
    w = Window(
        t_begin + spec.warmup_s,
        t_begin + spec.warmup_s + spec.duration_s,
        spec.stream,
        spec.expect_tokens + spec.extra_events,
    )
    w.keepalive = spec.keepalive
    hard_end = w.end + spec.drain_s
    live: dict[int, Conn] = {}  # fileno -> conn
    probing: dict[int, Conn] = {}  # port -> probe in flight
    next_probe = t_begin
    snap: dict[str, float] = {}
    busy = 0.0
    poll = 0.0 if spec.spin else 0.005

    def top_up(now: float) -> None:
        """Start requests until ``concurrency`` (or the ramp's share of it) are in flight."""
        if now >= w.end:
            return
        want = spec.concurrency
        if spec.ramp_s > 0 and now - t_begin < spec.ramp_s:
            want = min(want, 1 + int(spec.concurrency * (now - t_begin) / spec.ramp_s))
        while len(live) < want:
            try:
                c = _connect(sel, spec.port, request)
            except OSError:
                res.error("connect")
                return
            live[c.fd] = c

    last_sweep = t_begin
    while True:
        now = time.perf_counter()
        top_up(now)
        if not snap and now >= w.start:
            snap.update(
                cpu=procstat.own_cpu_s(),
                server=procstat.cpu_s(spec.server_pids),
                core=procstat.core_busy_s(spec.server_cores),
                t=now,
                busy=busy,
            )
        if "end_t" not in snap and now >= w.end:
            snap.update(
                end_t=now,
                end_cpu=procstat.own_cpu_s(),
                end_server=procstat.cpu_s(spec.server_pids),
                end_core=procstat.core_busy_s(spec.server_cores),
                end_busy=busy,
                rss=procstat.rss_bytes(spec.server_pids),
                threads=procstat.threads(spec.server_pids),
            )
        if now >= hard_end or (now >= w.end and not live):
            break
        if spec.probe_ports and now >= next_probe and now < w.end:
            next_probe = now + spec.probe_every_s
            for p in spec.probe_ports:
                if p not in probing:
                    try:
                        probing[p] = _connect(sel, p, probe_req[p], probe=p)
                    except OSError:
                        res.probe_errors += 1
        events = sel.select(poll)
        if not events:
            continue
        t_work = time.perf_counter()
        for key, mask in events:
            conn: Conn = key.data
            outcome = _on_event(sel, conn, mask, t_work, res, w)
            if not outcome:
                continue
            if conn.probe or outcome != "ok" or not spec.keepalive or t_work >= w.end:
                sel.unregister(conn.sock)
                conn.sock.close()
            else:  # the next request on the same connection
                account(conn, outcome, t_work, res, w)
                conn.again(request, t_work)
                sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                continue
            if conn.probe:
                del probing[conn.probe]
                if outcome == "ok" and w.start <= conn.t0 < w.end:
                    res.probes[conn.probe].append(t_work - conn.t0)
                elif outcome != "ok":
                    res.probe_errors += 1
                continue
            del live[conn.fd]
            account(conn, outcome, t_work, res, w)
        done = time.perf_counter()
        busy += done - t_work
        if done - last_sweep > 0.1:
            last_sweep = done
            for fd, conn in list(live.items()):
                if done - conn.t0 > spec.timeout_s:
                    sel.unregister(conn.sock)
                    conn.sock.close()
                    del live[fd]
                    account(conn, "timeout", done, res, w)
    dropped = len(live)
    for conn in live.values():
        if w.start <= conn.t0 < w.end and conn.t_first is not None:
            res.ttft.append(conn.t_first - conn.t0)
        if w.start <= conn.t0 < w.end and conn.t_head is not None:
            res.ttfb.append(conn.t_head - conn.t0)
        sel.unregister(conn.sock)
        conn.sock.close()
    for conn in probing.values():
        sel.unregister(conn.sock)
        conn.sock.close()
    sel.close()
    return report(spec, res, snap, dropped)
