"""gunicorn's gevent worker: cheap, progress-bounded writes, bounded request heads, health probes
answered before the app, and a graceful stop that always leaves time for the exit hooks.

Every plain TCP connection is a :class:`~wsgi_app.server.stream_socket.StreamSocket` (one
non-blocking ``send`` first; the send timeout bounds a write without progress), accepted straight
into one (:class:`_Server`). Requests are parsed by ``wsgi_app.server.request_head`` (the head
bounded in bytes and time, ``Host`` required, idle keep-alive connections waited on only while the
worker runs). A plain health probe is answered by the worker from the app's registered answers
(``wsgi_app.server.probes``), and a new connection that opens with a whole probe head is served from
the accept itself, ahead of the set-up of every connection accepted before it.

On SIGTERM the worker closes its listeners (the master has closed its own copies: new connections
are then refused, and those waiting in the backlog reset), and, as nginx does: idle keep-alive
connections are closed at once, requests in flight are answered ``Connection: close``;
``END_STREAMS_S`` before ``graceful_timeout`` ends the app ends its streams with a final error event
(``Runtime.begin_shutdown``), writes still blocked on a reader that stopped are cut ``CUT_WRITES_S``
before it, and whatever still runs is ended ``EXIT_RESERVE_S`` before it, so the exit hooks (spans,
history, metrics) always run before the arbiter kills the worker (a SIGTERM sent while the worker
still boots is held for its handlers: ``wsgi_app.server.early_signals``). A connection the worker
cuts or ends is marked ``end_reason = "shutdown"`` first, one the send timeout cuts
``"send_timeout"``, so that the request's log line says who ended it. A reload's SIGTERM starts that stop
only once a worker of the new generation has loaded its models, and a new worker accepts only once the
old ones have closed their listeners (``wsgi_app.server.handoff``).

This module is imported by the arbiter (``worker_class`` in ``gunicorn.conf.py``): it imports gevent
and gunicorn only, never Flask.
"""

from __future__ import annotations

import socket
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import gevent
from gevent import Greenlet, GreenletExit
from gevent.baseserver import _handle_and_close_when_done
from gevent.event import Event
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn import util
from gunicorn.sock import ssl_context
from gunicorn.workers import ggevent

from wsgi_app.server import early_signals, probes, response
from wsgi_app.server.end_reason import SHUTDOWN
from wsgi_app.server.handoff import POLL_S, Handoff
from wsgi_app.server.hubturn import setup_turn
from wsgi_app.server.request_head import HeadLimits, HeadTimeout, install
from wsgi_app.server.stream_socket import SendTimeout, StreamSocket
from wsgi_app.settings import ServerSettings

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


class _Server(StreamServer):
    """gevent's ``StreamServer`` accepting each plain TCP connection straight into a
    :class:`StreamSocket` (gevent's own makes a socket object that would then be re-made, a few
    percent of a short request's cost), and serving a new connection that opens with a whole probe
    head at once, from the accept (``wsgi_app.server.probes``).

    Attributes:
        probing: returns True while the worker answers probes itself (an app registered them).
    """

    probing: Any = staticmethod(lambda: False)

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

    def do_handle(self, *args: Any) -> None:
        """Serve an accepted connection: in a new greenlet started at the hub's next turn (gevent's
        way), or, when its first bytes are already a whole probe head, in one switched to now.

        A spawned greenlet runs after every callback queued before it, which under a burst of new
        connections is the set-up of each of them (~1 ms apiece): a probe served so never waits
        for those. It runs until it blocks, then the hub goes on accepting.
        """
        sock = args[0]
        if type(sock) is not StreamSocket or not self.probing() or not _probe_waiting(sock):
            super().do_handle(*args)
            return
        greenlet = Greenlet(_handle_and_close_when_done, self._handle, self.do_close, args)
        if self.pool is not None:
            self.pool.add(greenlet)  # counted as a connection, as a spawned one is
        greenlet.switch()


class _Listener:
    """A listening socket as its connections' handlers see it: its name, kept from the start, so
    that a handler the server spawned just before the worker closed the listener still gets it
    (gunicorn's ``handle`` asks ``listener.getsockname()`` for the WSGI environ)."""

    __slots__ = ("_name",)

    def __init__(self, sock: socket.socket) -> None:
        self._name = sock.getsockname()

    def getsockname(self) -> Any:
        """The address the socket was bound to: ``(host, port)``, or a Unix socket's path."""
        return self._name


def _probe_waiting(sock: StreamSocket) -> bool:
    """True when the bytes waiting on a new connection are a whole probe head (a non-blocking peek)."""
    try:
        return probes.plain_probe_head(
            sock._sock.recv(probes.PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        )
    except OSError:  # nothing yet (BlockingIOError), or the connection failed
        return False


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
        # The app's answers to health probes, registered at start (``gunicorn_config``), or None:
        # probes then go to the app like any request.
        self.probes: probes.ProbeResponder | None = None
        self.held_signals: frozenset[int] = frozenset()  # blocked from the fork to init_signals
        self.servers: list[StreamServer] = []  # serving, from run()
        self.handoff: Handoff | None = None  # a reload's hand-off (wsgi_app.server.handoff)
        self.handing_off = False  # stopping for a reload, serving on until a new worker is ready
        self.stopping = False  # the graceful stop has begun
        self._on_stop: list[Callable[[], object]] = []

    def init_process(self) -> None:
        """Bound the request parser (``MAX_HEADER_BYTES``, ``HEADER_TIMEOUT_S``), send each
        response's head with its first body bytes (``wsgi_app.server.response``), fix the
        settings' values (:func:`freeze_settings`), then run."""
        server = ServerSettings.from_env()
        self.header_timeout_s = server.header_timeout_s
        if server.handoff_dir:
            self.handoff = Handoff(server.handoff_dir, server.generation)
        install(
            HeadLimits(
                server.max_header_bytes,
                server.header_timeout_s,
                self.cfg.keepalive,
                stopping=lambda: not self.alive,
            )
        )
        response.install()
        freeze_settings(self.cfg)
        super().init_process()

    def hold_stop_signals(self, arbiter: Any) -> None:
        """Keep a stop signal sent before :meth:`init_signals` for the worker's own handlers (called by
        the ``post_fork`` hook, first thing in the child: ``wsgi_app.server.early_signals``)."""
        self.held_signals = early_signals.hold(arbiter)

    def init_signals(self) -> None:
        """Install gunicorn's handlers, then let through a stop signal held since the fork."""
        super().init_signals()
        early_signals.release(self.held_signals)
        self.held_signals = frozenset()

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

    @property
    def _http(self) -> bool:
        return getattr(self.cfg, "protocol", "http") == "http"

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> bool:
        """Serve one request: a plain health probe from the worker (``wsgi_app.server.probes``),
        anything else through the app once the hub's next pass gives it a set-up turn
        (``wsgi_app.server.hubturn.setup_turn``: a burst of set-ups never holds the hub's polls).
        A reader cut by the send timeout closes the connection quietly (the app logs the
        request), where gunicorn would log a socket-error traceback."""
        if isinstance(sock, StreamSocket):
            sock.request = req
        try:
            responder = self.probes
            if responder is not None and self._http and probes.plain_probe(req):
                return probes.answer(self, responder, req, sock, addr)
            # The app's set-up runs a poll's worth at a time, ahead of the streams (hubturn).
            setup_turn()
            return super().handle_request(listener_name, req, sock, addr)
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

    def handle_usr1(self, sig: int, frame: Any) -> None:
        """Reopen the log files in a greenlet (as gunicorn's gevent worker), then have the next
        request's environ made anew: its ``wsgi.errors`` names the files
        (``wsgi_app.server.response.BaseEnviron``)."""
        gevent.spawn(self._reopen_logs)

    def _reopen_logs(self) -> None:
        self.log.reopen_files()
        response.logs_reopened()
        # Says the reopen is done (logrotate's postrotate, and tests, wait for it).
        self.log.info("Worker reopened its log files (pid:%s)", self.pid)

    def handle_quit(self, sig: int, frame: Any) -> None:
        """Quick stop (SIGINT, SIGQUIT: Ctrl-C): as gunicorn's, exit within ~0.1 s, but first end
        the requests in flight, marked ``end_reason = "shutdown"``, so that each still gets its
        access line, metrics and span (gunicorn's own exits with them unfinished and unlogged)."""
        self.alive = False
        self.end_in_flight(block=False)  # each ends on the hub's next turn, before the exit
        super().handle_quit(sig, frame)  # a greenlet: worker_int, 0.1 s for the ends, exit

    def when_stopping(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the graceful stop begins (now, if it has): the app's own stop
        (``Runtime.begin_shutdown``), registered once the app is loaded."""
        if self.stopping:
            callback()
        else:
            self._on_stop.append(callback)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: stop (:meth:`begin_stop`), unless this is a reload's and the worker accepts: it
        then serves on until a worker of the new generation is ready (``wsgi_app.server.handoff``),
        and stops then. A second SIGTERM (the master stopping meanwhile) stops it at once."""
        if self.handoff is None or self.handing_off or not self.handoff.reloading():
            self.begin_stop()
            return
        self.handing_off = True
        gevent.spawn(self._hand_off, self.handoff)

    def _hand_off(self, handoff: Handoff) -> None:
        """Serve on until a newer generation is ready (at most gunicorn's ``timeout``), then stop."""
        self.log.info("Worker waits for the new workers to load (pid:%s)", self.pid)
        deadline = time.monotonic() + (self.cfg.timeout or self.cfg.graceful_timeout)
        while not (self.stopping or handoff.newer_ready()):
            if time.monotonic() >= deadline:
                self.log.warning("No new worker ready in time, stopping (pid:%s)", self.pid)
                break
            gevent.sleep(POLL_S)
        self.begin_stop()

    def begin_stop(self) -> None:
        """Stop, once: close idle connections now, answer in-flight requests ``Connection: close``,
        cut blocked writes ``CUT_WRITES_S`` before the grace ends and the rest ``EXIT_RESERVE_S``
        before; the callbacks of :meth:`when_stopping` run first."""
        if self.stopping:
            return
        self.stopping = True
        self.alive = False
        grace = float(self.cfg.graceful_timeout)
        self.exit_by = time.monotonic() + grace
        for callback in self._on_stop:
            callback()
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

    def end_in_flight(self, block: bool) -> None:
        """Mark the requests in flight (:meth:`mark_in_flight`) and kill their greenlets: waiting up
        to 0.2 s for them to end when ``block``, else on the hub's next turn."""
        self.mark_in_flight()
        for server in self.servers:
            server.pool.kill(block=block, timeout=0.2 if block else None)

    def exit_budget_s(self, cap_s: float) -> float:
        """Seconds an exit hook may still take: at most ``cap_s``, less when the arbiter's kill is
        near (a little is kept for the process to exit)."""
        if self.exit_by is None:
            return cap_s
        return max(0.0, min(cap_s, self.exit_by - time.monotonic() - 0.1))

    def run(self) -> None:
        """Serve until SIGTERM, then close the listeners and wait for the open connections until
        ``EXIT_RESERVE_S`` before the grace ends, and end those left (gunicorn's loop, checking
        every 50 ms, not every second, and never past the point where the exit hooks would be
        killed)."""
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        servers = self.servers
        for s in self.sockets:
            s.setblocking(1)
            server = (StreamServer if ssl_args else _Server)(
                s,
                handle=partial(self.handle, _Listener(s)),
                spawn=Pool(self.worker_connections),
                **ssl_args,
            )
            if self.cfg.workers > 1:
                server.max_accept = 1
            else:
                # The whole backlog in one go: a probe behind a burst of new connections is reached
                # in one accept pass, not after one pass (and every set-up it spawned) per 100.
                server.max_accept = max(server.max_accept, self.worker_connections)
            if not ssl_args:
                server.probing = lambda: self.probes is not None
            servers.append(server)
        self._take_over()
        for server in servers:
            if self.alive:
                server.start()
        while self.alive:
            self.notify()
            self.stop_requested.wait(1.0)
        for server in servers:
            # Close this worker's copy of the listener, not only stop accepting: once the master and
            # every worker closed theirs (a whole stop), the kernel resets what waits in the backlog
            # and refuses new connections at once, where they would hang until the worker exits. A
            # worker stopping alone (a reload, TTOU) leaves the socket to the master and the others.
            # Closed, the server also never resumes accepting when its full pool frees a place.
            server.close()
        if self.handoff is not None:
            self.handoff.stopped_accepting()  # a new generation may take over
        end_by = (self.exit_by or time.monotonic()) - EXIT_RESERVE_S
        while any(server.pool.free_count() != server.pool.size for server in servers):
            if time.monotonic() >= end_by:
                self.log.warning("Worker graceful timeout (pid:%s)", self.pid)
                self.end_in_flight(block=True)
                break
            self.notify()
            gevent.sleep(0.05)

    def _take_over(self) -> None:
        """Before the first accept: say that this worker is ready, then wait (notifying the
        arbiter) until no worker of an older generation accepts any more, at most gunicorn's
        ``timeout`` (``wsgi_app.server.handoff``)."""
        handoff = self.handoff
        if handoff is None or not self.alive:
            return
        handoff.ready()
        deadline = time.monotonic() + (self.cfg.timeout or self.cfg.graceful_timeout)
        while self.alive and handoff.older_accepting():
            if time.monotonic() >= deadline:
                self.log.warning("Older workers still accept, accepting too (pid:%s)", self.pid)
                break
            self.notify()
            gevent.sleep(POLL_S)
        if handoff.generation:  # a reload's worker: from here on the new version answers
            self.log.info("Worker accepts, generation %s (pid:%s)", handoff.generation, self.pid)


def freeze_settings(cfg: Any) -> None:
    """Keep each of gunicorn's settings on ``cfg`` as a plain attribute, its value as it is now.

    gunicorn reads a setting through ``Config.__getattr__`` (a Python call and a dict lookup): ~30
    reads a request, one per header for ``strip_header_spaces`` alone. A worker's settings never
    change after it started (a reload starts new workers), so the values are stored once; the
    ``Config`` properties (``is_ssl``, ``address``...) stay as they are and read these.
    """
    for name, setting in cfg.settings.items():
        if not hasattr(type(cfg), name):  # a property of the same name keeps computing itself
            cfg.__dict__[name] = setting.get()


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
