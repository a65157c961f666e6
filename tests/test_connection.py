"""The vanished-client check of a non-streamed answer: a peek, fine for any descriptor number."""

from __future__ import annotations

import os
import resource
import socket

import pytest
from gevent import socket as gsocket

from wsgi_app.server.connection import peer_closed


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
