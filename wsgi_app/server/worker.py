"""gunicorn's gevent worker, with the writes of a stream made cheap and bounded by progress.

A token event is ~150 bytes and the kernel almost always takes it whole, yet gevent's
``socket.sendall`` pays for a general path every time: a ``getsockopt(SO_SNDBUF)`` system call to size
its slices, a deadline, a memoryview and three Python frames. On the streamed hot path that was about a
tenth of the worker's CPU. :class:`StreamSocket` tries one non-blocking ``send`` first.

When the kernel's buffer is full the rest waits for the socket to drain, and the send timeout
(``SEND_TIMEOUT_S``, set per request by the app) bounds a wait *without progress* (the kernel's send
queue did not shrink: ``SIOCOUTQ``), not the whole write: a slow reader that keeps reading is never
cut, one that stops is cut after that long (:class:`SendTimeout`). The timeout is for writes only,
so reading the next request on a keep-alive connection is not affected by it.

Requests are parsed by ``wsgi_app.server.request_head`` (the head bounded in bytes and time, ``Host``
required, idle keep-alive connections waited on only while the worker runs).

On SIGTERM, as nginx does: idle keep-alive connections are closed at once, requests in flight are
answered ``Connection: close``; ``END_STREAMS_S`` before ``graceful_timeout`` ends the app ends its
streams with a final error event (``Runtime.begin_shutdown``), writes still blocked on a reader that
stopped are cut ``CUT_WRITES_S`` before it, and whatever still runs is ended ``EXIT_RESERVE_S`` before
it, so the exit hooks (spans, history, metrics) always run before the arbiter kills the worker. A
connection the worker cuts or ends is marked ``end_reason = "shutdown"`` first, one the send timeout
cuts ``"send_timeout"``, so that the request's log line says who ended it.

This module is imported by the arbiter (``worker_class`` in ``gunicorn.conf.py``): it imports gevent
and gunicorn only, never Flask.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import gevent
from gevent import GreenletExit
from gevent import socket as gsocket
from gevent.event import Event
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn import util
from gunicorn.sock import ssl_context
from gunicorn.workers import ggevent

from wsgi_app.server.end_reason import SEND_TIMEOUT, SHUTDOWN
from wsgi_app.server.request_head import HeadLimits, HeadTimeout, install
from wsgi_app.settings import ServerSettings

# How often a blocked write looks at the kernel's send queue for progress, seconds: a reader that
# stops is cut at most this long after ``SEND_TIMEOUT_S``.
PROGRESS_CHECK_S = 0.25
# The end of a graceful stop, in seconds before ``graceful_timeout`` ends, in order. Streams are told
# to end (their pacer raises 503 ``unavailable``: a final error event, ``[DONE]``) first, early enough
# that a stream waiting on an engine tick (0.25 s) or in the queue gets there before the cut and the
# kill; writes still blocked on a reader that stopped are then shut down (no event can reach it);
# last, whatever still runs is ended, keeping EXIT_RESERVE_S for the exit hooks (flushing spans,
# history and metrics).
END_STREAMS_S = 1.5
CUT_WRITES_S = 1.0
EXIT_RESERVE_S = 0.75
# A refused request's connection reads and discards what the client still sends for this long
# (seconds) and at most this much (bytes) before closing.
LINGER_S = 1.0
LINGER_MAX_BYTES = 1 << 20


class SendTimeout(TimeoutError):
    """A write made no progress for the connection's send timeout: the client stopped reading."""


class StreamSocket(gsocket.socket):
    """A gevent TCP socket whose ``sendall`` tries one plain non-blocking ``send`` first.

    Attributes:
        send_timeout_s: the longest a write may wait for the peer to take more bytes, seconds; None
            falls back to gevent's ``sendall`` and the socket's own timeout.
        stalled: True once a write was cut by ``send_timeout_s``.
        end_reason: who ended the connection's request, when the server did: ``"send_timeout"``
            (its reader stopped), ``"shutdown"`` (the worker stopping cut or ended it), else None.
        blocked: True while a write waits for the peer.
        idle: True while the connection waits for a request to start.
        request: the request being answered (gunicorn's ``Request``), or None.
        http: True when the connection speaks HTTP/1.x (gunicorn's ``protocol`` is ``http``, not
            ``uwsgi``), so gunicorn frames a body of unknown length as chunks on HTTP/1.1.
    """

    __slots__ = ("send_timeout_s", "stalled", "end_reason", "blocked", "idle", "request", "http")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout_s: float | None = None
        self.stalled = False
        self.end_reason: str | None = None
        self.blocked = False
        self.idle = False
        self.request: Any = None
        self.http = True

    def close_after_response(self) -> None:
        """Answer the current request with ``Connection: close`` and close the connection after it
        (when its headers are still unsent; otherwise just close after it)."""
        if self.request is not None:
            self.request.force_close()

    def sendall(self, data: Any, flags: int = 0) -> None:
        """Send all of ``data`` (a bytes-like object), cooperatively when the kernel is full.

        Raises:
            SendTimeout: the peer took nothing for ``send_timeout_s`` seconds.
            OSError: the connection failed (reset, broken pipe), as ``socket.sendall``.
        """
        try:
            sent = self._sock.send(data, flags)  # the real socket is non-blocking under gevent
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send_rest(memoryview(data).cast("B")[sent:], flags)

    def write_chunks(self, events: Iterator[bytes]) -> Iterator[bytes]:
        """Send each of ``events`` as one chunk of a chunked body (the bytes gunicorn's
        ``write_chunk`` sends, without its four Python calls an event); yields nothing, so that a
        body ending with it writes every event within one request of the server for its next item.

        Raises:
            SendTimeout, OSError: as :meth:`sendall`, out of the body, as from gunicorn's write.

        Source: RFC 9112 §7.1 (chunked transfer coding).
        """
        send = self.sendall
        for event in events:
            send(b"%X\r\n%b\r\n" % (len(event), event))
        yield from ()

    def _send_rest(self, view: memoryview, flags: int) -> None:
        timeout = self.send_timeout_s
        if timeout is None:
            super().sendall(view, flags)
            return
        # One bound, counted from the last progress seen: a wait is cut into slices, and each slice
        # looks at the send queue. Restarting a whole timeout after a wait that saw progress (the
        # queue shrank at its very start, say) would let a reader that stopped hold on for twice it.
        check_s = min(PROGRESS_CHECK_S, timeout)
        self.blocked = True
        try:
            queued = _queued_bytes(self)
            progress_at = time.monotonic()
            while view:
                left = progress_at + timeout - time.monotonic()
                if left <= 0:
                    self.stalled = True
                    if self.end_reason is None:  # not if the worker cut it first
                        self.end_reason = SEND_TIMEOUT
                    raise _timeout_exc(timeout)
                try:
                    gsocket.wait_write(self.fileno(), min(check_s, left), _timeout_exc(timeout))
                except SendTimeout:
                    # The kernel reports a socket writable only once a third of its (autotuned, up
                    # to megabytes) buffer is free: a slow reader can take bytes all along and
                    # still never get there within the timeout. Progress is what counts.
                    now_queued = _queued_bytes(self)
                    if 0 <= now_queued < queued:
                        progress_at = time.monotonic()
                    queued = now_queued
                    continue
                try:
                    view = view[self._sock.send(view, flags) :]
                except BlockingIOError:  # woken, but another writer got there first
                    continue
                # The kernel took bytes: the peer made room.
                progress_at = time.monotonic()
                queued = _queued_bytes(self)
        finally:
            self.blocked = False


def _queued_bytes(sock: StreamSocket) -> int:
    """Bytes in the socket's send queue not yet taken by the peer (Linux ``SIOCOUTQ``); -1 where
    the system does not tell, which counts as no progress."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError):
        return -1
    return struct.unpack("i", raw)[0]


def _timeout_exc(timeout_s: float) -> SendTimeout:
    return SendTimeout(f"the client read nothing for {timeout_s:g} s")


class _Server(StreamServer):
    """gevent's ``StreamServer`` accepting each plain TCP connection straight into a
    :class:`StreamSocket` (gevent's own makes a socket object that would then be re-made, a few
    percent of a short request's cost)."""

    def do_read(self) -> tuple[StreamSocket, Any] | None:
        """Accept one connection; None when there was none after all (as gevent's)."""
        listener = self.socket
        try:
            fd, address = listener._accept()
        except BlockingIOError:
            if not listener.timeout:
                return None
            raise
        return StreamSocket(listener.family, listener.type, listener.proto, fileno=fd), address


class GeventWorker(ggevent.GeventWorker):
    """gunicorn's gevent worker whose plain TCP connections are :class:`StreamSocket`\\ s, whose
    requests are parsed by ``wsgi_app.server.request_head``, and which stops as the module docstring says.

    TLS connections (gunicorn's ``certfile``) and anything else keep gevent's own class.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections: weakref.WeakSet[StreamSocket] = weakref.WeakSet()
        self.stop_requested = Event()
        self.exit_by: float | None = None  # monotonic time the exit hooks must be done by
        self.header_timeout_s = ServerSettings.header_timeout_s

    def init_process(self) -> None:
        """Bound the request parser (``MAX_HEADER_BYTES``, ``HEADER_TIMEOUT_S``), then run."""
        server = ServerSettings.from_env()
        self.header_timeout_s = server.header_timeout_s
        install(
            HeadLimits(
                server.max_header_bytes,
                server.header_timeout_s,
                self.cfg.keepalive,
                stopping=lambda: not self.alive,
            )
        )
        super().init_process()

    def timeout_ctx(self) -> gevent.Timeout:
        """Bound the wait for the next request as a whole; its parts (the idle wait, the head) have
        their own, shorter bounds in ``wsgi_app.server.request_head``."""
        return gevent.Timeout(self.cfg.keepalive + self.header_timeout_s, False)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        """Serve one connection (gunicorn's ``handle``); a plain TCP one is a :class:`StreamSocket`
        (made so by :class:`_Server`)."""
        if type(client) is StreamSocket:
            client.http = getattr(self.cfg, "protocol", "http") == "http"
            self.connections.add(client)
        super().handle(listener, client, addr)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> None:
        """Serve one request; a reader cut by the send timeout closes the connection quietly (the
        app logs the request), where gunicorn would log a socket-error traceback."""
        if isinstance(sock, StreamSocket):
            sock.request = req
        try:
            super().handle_request(listener_name, req, sock, addr)
        except SendTimeout as exc:
            raise StopIteration(str(exc)) from None  # gunicorn's "close this connection"
        finally:
            if isinstance(sock, StreamSocket):
                sock.request = None

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """Answer a late request head 408, the rest as gunicorn does; then close the connection
        lingering (so the client reads the answer rather than a reset)."""
        if isinstance(exc, HeadTimeout):
            self.log.debug("Request head timed out from %s: %s", addr, exc)
            try:
                util.write_error(client, 408, "Request Timeout", str(exc))
            except OSError:
                pass
        elif isinstance(exc, GreenletExit):
            # Ended at the end of the grace period (``run``), not a server fault: no 500, no
            # traceback; a request that got this far had its 503 or error event already.
            self.log.debug("Connection from %s ended by the worker's stop", addr)
            return  # closed by gunicorn at once: no lingering past the kill
        else:
            super().handle_error(req, client, addr, exc)
        _linger(client)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Stop: close idle connections now, answer in-flight requests ``Connection: close``, cut
        blocked writes ``CUT_WRITES_S`` before the grace ends and the rest ``EXIT_RESERVE_S`` before."""
        super().handle_exit(sig, frame)
        grace = float(self.cfg.graceful_timeout)
        if self.exit_by is None:
            self.exit_by = time.monotonic() + grace
        self.stop_requested.set()
        gevent.spawn(self.close_idle_connections)
        gevent.spawn_later(max(0.0, grace - CUT_WRITES_S), self.cut_blocked_writes)

    def close_idle_connections(self) -> None:
        """Shut down connections waiting for a request (new or kept alive) on which no byte waits;
        mark the others to close after their request."""
        for conn in list(self.connections):
            if conn.idle and not _bytes_waiting(conn):
                _shutdown(conn)
            else:
                conn.close_after_response()

    def cut_blocked_writes(self) -> None:
        """Shut down every connection whose write waits for a reader (it fails with EPIPE at once),
        marked ``end_reason = "shutdown"`` first (the cut is the worker's doing, whatever the reader
        did before)."""
        for conn in list(self.connections):
            if conn.blocked:
                conn.end_reason = SHUTDOWN
                _shutdown(conn)

    def mark_in_flight(self) -> None:
        """Mark every connection answering a request ``end_reason = "shutdown"`` (unless marked
        already), before the worker ends what still runs."""
        for conn in list(self.connections):
            if not conn.idle and conn.end_reason is None:
                conn.end_reason = SHUTDOWN

    def exit_budget_s(self, cap_s: float) -> float:
        """Seconds an exit hook may still take: at most ``cap_s``, less when the arbiter's kill is
        near (a little is kept for the process to exit)."""
        if self.exit_by is None:
            return cap_s
        return max(0.0, min(cap_s, self.exit_by - time.monotonic() - 0.1))

    def run(self) -> None:
        """Serve until SIGTERM, then wait for the open connections until ``EXIT_RESERVE_S`` before
        the grace ends, and end those left (gunicorn's loop, checking every 50 ms, not every second,
        and never past the point where the exit hooks would be killed)."""
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        servers = []
        for s in self.sockets:
            s.setblocking(1)
            server = (StreamServer if ssl_args else _Server)(
                s, handle=partial(self.handle, s), spawn=Pool(self.worker_connections), **ssl_args
            )
            if self.cfg.workers > 1:
                server.max_accept = 1
            server.start()
            servers.append(server)
        while self.alive:
            self.notify()
            self.stop_requested.wait(1.0)
        for server in servers:
            # Stop accepting, but keep the listener open: a handler just spawned still asks it its name.
            server.stop_accepting()
        end_by = (self.exit_by or time.monotonic()) - EXIT_RESERVE_S
        while any(server.pool.free_count() != server.pool.size for server in servers):
            if time.monotonic() >= end_by:
                self.log.warning("Worker graceful timeout (pid:%s)", self.pid)
                self.mark_in_flight()
                for server in servers:
                    server.pool.kill(block=True, timeout=0.2)
                break
            self.notify()
            gevent.sleep(0.05)


def _bytes_waiting(conn: socket.socket) -> bool:
    """True when the peer has sent bytes not yet read (a request on its way): a non-blocking peek."""
    try:
        return bool(conn._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing to read (BlockingIOError), or the connection failed
        return False


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile
        pass


def _linger(conn: socket.socket) -> None:
    """Half-close ``conn`` and discard what the client still sends, for up to ``LINGER_S``: closing
    with unread bytes would reset the connection and could destroy the answer just written.

    Source: RFC 9112 §9.6 (tear-down); nginx's ``lingering_close``.
    """
    try:
        conn.shutdown(socket.SHUT_WR)
        with gevent.Timeout(LINGER_S, False):
            discarded = 0
            while discarded < LINGER_MAX_BYTES:
                data = conn.recv(65_536)
                if not data:
                    break
                discarded += len(data)
    except OSError:
        pass
