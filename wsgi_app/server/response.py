"""gunicorn's HTTP/1.x response writer, its head sent in the same ``send`` as the first body bytes.

gunicorn's ``Response.write`` sends the status line and headers with one ``sendall``, then the body
bytes with another: two system calls (and two wake-ups of the client) for every JSON answer and for a
stream's opening event. :class:`Response` gathers what one ``write`` (or a ``close`` that sends the
head of an empty body) would send and sends it at once. The bytes, their order and every failure
(raised from the same call, before the next item of the body is asked for) are gunicorn's: only the
number of ``send`` calls changes. A stream's first event still leaves at once, with its head, so the
client has the headers before the first token, as before.

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


def install() -> None:
    """Make this worker's gunicorn answer HTTP/1.x requests with :class:`Response` (call once per
    worker; gunicorn's ``wsgi.create`` takes its default class from its module at each request)."""
    wsgi.Response = Response
