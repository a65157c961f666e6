"""The vanished-client check of a non-streamed answer: a peek, fine for any descriptor number."""

from __future__ import annotations

import os
import resource
import socket
import struct

import pytest
from gevent import socket as gsocket

from wsgi_app.server.connection import peer_closed, peer_reset


def test_peer_closed_sees_data_and_the_fin_without_consuming():
    a, b = gsocket.socketpair()
    assert peer_closed(a) is False  # nothing yet: still there
    b.sendall(b"x")
    assert peer_closed(a) is False and a.recv(1) == b"x"  # pipelined bytes are left in place
    b.close()
    assert peer_closed(a) is True
    a.close()
    assert peer_closed(None) is False


def test_peer_closed_works_past_fd_setsize():
    # select() refuses descriptors >= 1024 (ValueError, answered as a 500 before); a busy worker
    # holding a thousand connections has them.
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1100:
        pytest.skip("the open-file limit does not reach past 1024")
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1100)
    a.close()
    sock = gsocket.socket(fileno=high)
    try:
        assert peer_closed(sock) is False
        b.close()
        assert peer_closed(sock) is True
    finally:
        sock.close()


def test_peer_reset_tells_a_half_close_from_a_reset():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        conn = gsocket.socket(fileno=server.detach())
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        client.shutdown(socket.SHUT_WR)  # done sending, still reading
        assert peer_reset(conn) is False
        assert conn.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
        assert peer_closed(conn) is True and peer_reset(conn) is False  # a FIN only
        conn.sendall(b"still read")
        assert client.recv(100) == b"still read"
        # Closed with SO_LINGER 0: the kernel resets the connection.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        assert peer_reset(conn) is True
        conn.close()
    assert peer_reset(None) is False
