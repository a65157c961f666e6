"""gunicorn's HTTP/1.x response writer, its head sent in the same ``send`` as the first body bytes;
and its base WSGI environ, made once per worker.

gunicorn's ``Response.write`` sends the status line and headers with one ``sendall``, then the body
bytes with another: two system calls (and two wake-ups of the client) for every JSON answer and for a
stream's opening event. :class:`Response` gathers what one ``write`` (or a ``close`` that sends the
head of an empty body) would send and sends it at once. The bytes, their order and every failure
(raised from the same call, before the next item of the body is asked for) are gunicorn's: only the
number of ``send`` calls changes. A stream's first event still leaves at once, with its head, so the
client has the headers before the first token, as before.

gunicorn also builds every request's environ from a fresh ``base_environ(cfg)``, whose ``wsgi.errors``
stream looks up gunicorn's error logger and its handlers each time (~1 % of a short request). Its
values are the same for every request of a worker (the settings and the logging set-up are fixed once
the worker runs; a log reopen, SIGUSR1, makes it anew): :class:`BaseEnviron` makes it once and gives
each request a copy.

This module is imported by the worker: gunicorn only, never Flask.

Source: gunicorn ``gunicorn/http/wsgi.py`` (``Response.send_headers``, ``write``, ``close``); RFC
9112 §6 (a message's head and body are one byte stream: how it is cut into segments is not meaningful).
"""

from __future__ import annotations

from typing import Any

from gunicorn.http import wsgi


class _Gathered:
    """A stand-in for the connection while one call of the response runs: keeps what is sent."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def sendall(self, data: Any) -> None:
        """Keep ``data`` (gunicorn's ``util.write`` and ``write_chunk`` send through this)."""
        self.parts.append(bytes(data))


class Response(wsgi.Response):
    """gunicorn's response whose head leaves in one ``send`` with the first body bytes (see the
    module docstring). Once the head is sent, writes are gunicorn's own, untouched."""

    def write(self, arg: bytes) -> None:
        """Write one item of the body (the head first, in the same ``send``, if not sent yet).

        Raises:
            TypeError: ``arg`` is not bytes (gunicorn's check; the head is still sent first).
            OSError: the connection failed.
        """
        if self.headers_sent:
            super().write(arg)
            return
        self._gathering(super().write, arg)

    def close(self) -> None:
        """End the body: the head of an empty body and its last chunk in one ``send``."""
        if self.headers_sent:
            super().close()
            return
        self._gathering(super().close)

    def _gathering(self, call: Any, *args: Any) -> None:
        """Run ``call(*args)`` with its sends gathered, then send them as one; what it gathered is
        sent even if it raised (as gunicorn's head had left before its ``TypeError``)."""
        sock, gathered = self.sock, _Gathered()
        self.sock = gathered
        try:
            call(*args)
        finally:
            self.sock = sock
            if gathered.parts:
                sock.sendall(b"".join(gathered.parts))


class BaseEnviron:
    """gunicorn's ``base_environ(cfg)``, made at the first request and copied for every other."""

    __slots__ = ("_make", "_made")

    def __init__(self, make: Any) -> None:
        self._make = make
        self._made: dict[str, Any] | None = None

    def __call__(self, cfg: Any) -> dict[str, Any]:
        """Return a new dict of the worker's base environ entries (shared values: the errors
        stream, the file wrapper class, constants)."""
        if self._made is None:
            self._made = self._make(cfg)
        return dict(self._made)

    def forget(self) -> None:
        """Make the base environ anew at the next request (the log files were reopened)."""
        self._made = None


def install() -> None:
    """Make this worker's gunicorn answer HTTP/1.x requests with :class:`Response` and build their
    environ from one :class:`BaseEnviron` (call once per worker, after its logging is set up;
    gunicorn's ``wsgi.create`` and ``default_environ`` look both up in their module at each
    request)."""
    wsgi.Response = Response
    if not isinstance(wsgi.base_environ, BaseEnviron):
        wsgi.base_environ = BaseEnviron(wsgi.base_environ)


def logs_reopened() -> None:
    """Tell the base environ that gunicorn reopened its log files (its errors stream holds them)."""
    if isinstance(wsgi.base_environ, BaseEnviron):
        wsgi.base_environ.forget()
