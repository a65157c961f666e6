"""The client's connection as the generating code sees it: tuned for streaming, and checked for a
client that left.

Source: POSIX ``recv(MSG_PEEK | MSG_DONTWAIT)`` (a zero-byte read is the peer's FIN); Linux ``tcp(7)``
``TCP_INFO`` (the connection's state); RFC 9293 (TCP).
"""

from __future__ import annotations

import socket

from wsgi_app.server.stream_socket import StreamSocket

TCP_CLOSE = 7  # include/net/tcp_states.h


def tune_socket(sock: socket.socket | None, send_timeout_s: float) -> None:
    """Send each event at once, and cut a reader that stops reading for ``send_timeout_s``.

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.
        send_timeout_s: how long a write may wait without progress, seconds (``SEND_TIMEOUT_S``).
    """
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A write that waits this long without progress raises; gunicorn then closes the body,
        # freeing the slot. Under another worker class (gunicorn's own gevent worker, TLS) the
        # socket's timeout is all there is: it bounds a whole write, and reads too.
        if isinstance(sock, StreamSocket):
            sock.send_timeout_s = send_timeout_s
        else:
            sock.settimeout(send_timeout_s)
    except OSError:  # already closed, or not TCP: nothing to tune
        pass


def peer_closed(sock: socket.socket | None) -> bool:
    """True when the client has closed its side of ``sock`` (a zero-byte peek); never consumes data.

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.
    """
    if sock is None:
        return False
    # A non-blocking peek of the real socket (gevent's wraps one; its recv would wait on EAGAIN).
    # Not select(): it refuses descriptors past FD_SETSIZE (1024), which a busy worker has.
    raw = getattr(sock, "_sock", sock)
    try:
        return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # nothing to read: the client is still there
        return False
    except OSError:
        return True


def peer_reset(sock: socket.socket | None) -> bool:
    """True when the client's connection is known gone: reset or failed, never a mere end of file.

    A client that half-closed (``SHUT_WR``) after its request has sent all it will, and may still
    read: its FIN is no reason to end a stream (:func:`peer_closed` says only that a FIN came). A
    client that closed for good is found out by the next write, which its kernel answers with a
    reset; a stream that waits writes heartbeats for that. Never consumes data.

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.

    Source: RFC 9293 §3.6 (closing a connection: a half-closed side may still receive); RFC 9112
    §9.6 (a client may half-close after sending its request).
    """
    if sock is None:
        return False
    try:
        # Linux ``TCP_INFO``: its first byte is the connection's state. A half-closed peer leaves it
        # in CLOSE_WAIT; a reset moves it to CLOSE (an end of file read before hides the reset
        # from recv()).
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except (OSError, AttributeError):  # not TCP, or closed: nothing known
        return False
    return state == TCP_CLOSE


def hang_up(sock: socket.socket | None) -> None:
    """End the connection without an answer, for a client taken for gone before its answer's first
    byte: whatever the server writes after this fails (gunicorn ignores that ``EPIPE``), so a client
    that only half-closed reads the connection's end, not a status it never waited for.

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.

    Source: nginx's ``ngx_http_upstream`` (a client gone before the upstream's answer is logged
    499 and its connection closed, nothing written).
    """
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already reset or closed: nothing more to end
        pass


def close_after_response(sock: socket.socket | None) -> None:
    """Answer the current request with ``Connection: close`` and close the connection after it
    (where the request's end on the connection is unknown, e.g. a body that stopped arriving).

    Args:
        sock: the connection's socket (gunicorn's ``environ["gunicorn.socket"]``), or None.
    """
    if isinstance(sock, StreamSocket):
        sock.close_after_response()
