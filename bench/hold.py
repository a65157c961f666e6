"""The "hold" scenario: as many slowly-read concurrent streams as one worker takes, and its RSS per stream.

Streams are opened at a steady rate over ``ramp_s``; each is read until its first token and from then
on only ``read_bytes`` every ``read_every_s`` (a slow reader). Two knobs make the server really block
on such a reader after little work, instead of the kernel absorbing the whole stream: the client
sets ``TCP_MAXSEG`` and a small ``SO_RCVBUF`` before connecting (so the server's send buffer stays
small), and the model name, which every frame echoes, is as long as the server accepts, so fewer
frames fill those buffers. After ``hold_s`` the worker's RSS is read from /proc, ``/healthz`` is
probed meanwhile, and every stream is closed.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from typing import Any

from bench import procstat
from bench.loadgen import _STATUS, http_request
from wsgi_app.api.fields import MAX_MODEL_CHARS

_FIRST = b"data: {"


def _probe(port: int, timeout_s: float = 5.0) -> float | None:
    """Return the seconds a blocking ``GET /healthz`` took, or None when it failed."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(http_request("GET", "/healthz", port))
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    return time.perf_counter() - t0 if data.startswith(b"HTTP/1.1 200") else None


def run_hold(
    port: int,
    target: int,
    server_pids: list[int],
    probe_ports: tuple[int, ...] = (),
    ramp_s: float = 10.0,
    hold_s: float = 10.0,
    read_bytes: int = 256,
    read_every_s: float = 1.0,
    rcvbuf: int = 4096,
    mss: int = 536,
    model: str = "bigram-" + "x" * (MAX_MODEL_CHARS - 7),
    grace_s: float = 60.0,
    max_tokens: int = 4096,
) -> dict[str, Any]:
    """Open ``target`` slow streams, hold them, and return counts, RSS and ``/healthz`` latency."""
    procstat.raise_nofile()
    body = json.dumps(
        {
            "model": model,
            "prompt": "ROMEO:",
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    request = http_request("POST", "/v1/completions", port, body)
    rss_idle = procstat.rss_bytes(server_pids)
    sel = selectors.EpollSelector()
    errors: dict[str, int] = {}
    pending: dict[int, list[Any]] = {}  # fd -> [sock, unsent bytes, received head+body]
    held: list[socket.socket] = []
    ttft: list[float] = []
    started: dict[int, float] = {}
    t_begin = time.perf_counter()
    opened = 0

    def fail(fd: int, kind: str) -> None:
        sock = pending.pop(fd)[0]
        sel.unregister(sock)
        sock.close()
        errors[kind] = errors.get(kind, 0) + 1

    ramp_end = t_begin + ramp_s
    while (opened < target or pending) and time.perf_counter() < ramp_end + grace_s:
        now = time.perf_counter()
        due = min(target, int(target * (now - t_begin) / ramp_s) + 1)
        while opened < due:
            opened += 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex(("127.0.0.1", port))
            fd = sock.fileno()
            pending[fd] = [sock, request, b""]
            started[fd] = time.perf_counter()
            sel.register(sock, selectors.EVENT_WRITE, fd)
        for key, _mask in sel.select(0.005):
            fd = key.data
            entry = pending[fd]
            sock = entry[0]
            if entry[1]:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    fail(fd, "connect")
                    continue
                try:
                    entry[1] = entry[1][sock.send(entry[1]) :]
                except BlockingIOError:
                    continue
                except OSError:
                    fail(fd, "reset")
                    continue
                if not entry[1]:
                    sel.modify(sock, selectors.EVENT_READ, fd)
                continue
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                fail(fd, "reset")
                continue
            if not data:
                match = _STATUS.match(entry[2])
                fail(fd, f"http_{match.group(1).decode()}" if match else "closed_early")
                continue
            entry[2] += data
            if _FIRST in entry[2]:
                if not entry[2].startswith(b"HTTP/1.1 200"):
                    fail(fd, "bad_status")
                    continue
                ttft.append(time.perf_counter() - started[fd])
                sel.unregister(sock)  # from now on a slow reader
                del pending[fd]
                held.append(sock)
    for fd in list(pending):
        fail(fd, "no_first_token")
    t_ramped = time.perf_counter()

    probes: dict[int, list[float]] = {p: [] for p in probe_ports}
    probe_errors = 0
    closed_by_server = 0
    next_read = time.perf_counter() + read_every_s
    hold_end = time.perf_counter() + hold_s
    while time.perf_counter() < hold_end:
        for p in probe_ports:
            latency = _probe(p)
            if latency is None:
                probe_errors += 1
            else:
                probes[p].append(latency)
        if read_bytes and time.perf_counter() >= next_read:
            next_read += read_every_s
            alive = []
            for sock in held:
                try:
                    if sock.recv(read_bytes) == b"":
                        closed_by_server += 1
                        sock.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed_by_server += 1
                    sock.close()
                    continue
                alive.append(sock)
            held = alive
        time.sleep(0.1)
    rss_held = procstat.rss_bytes(server_pids)
    threads = procstat.threads(server_pids)
    n_held = len(held)
    for sock in held:
        sock.close()
    sel.close()
    time.sleep(2.0)
    after = {p: _probe(p) for p in probe_ports}
    out: dict[str, Any] = {
        "target": target,
        "ramp_s": round(t_ramped - t_begin, 2),
        "hold_s": hold_s,
        "read_bytes_every_s": [read_bytes, read_every_s],
        "client_rcvbuf_mss": [rcvbuf, mss],
        "opened": opened,
        "held_at_end": n_held,
        "closed_by_server": closed_by_server,
        "errors": dict(sorted(errors.items())),
        "ttft_ms": procstat.ms(ttft, (0.5, 0.99, 1.0)),
        "server_rss_mb_idle": round(rss_idle / 2**20, 1),
        "server_rss_mb_held": round(rss_held / 2**20, 1),
        "rss_kib_per_stream": round((rss_held - rss_idle) / 1024 / n_held, 1) if n_held else None,
        "server_threads": threads,
        "healthz_ms": {
            str(p): {**procstat.ms(v, (0.5, 0.99, 1.0)), "n": len(v)} for p, v in probes.items()
        },
        "healthz_errors": probe_errors,
        "healthz_after_close_ms": {str(p): v and round(v * 1000, 3) for p, v in after.items()},
        "server_rss_mb_after_close": round(procstat.rss_bytes(server_pids) / 2**20, 1),
    }
    return out
