"""A stand-in for systemd's notification socket: a Unix datagram socket that collects what a service
sends with sd_notify (``READY=1``, ``MAINPID=…``), so a test can check the protocol without systemd.

Source: sd_notify(3), the ``NOTIFY_SOCKET`` datagram protocol.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path


class NotifySocket:
    """Bind ``path`` for datagrams; pass :attr:`path` as ``NOTIFY_SOCKET`` to the service.

    Args:
        path: where to bind (under 108 bytes, the ``sun_path`` limit).
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, predicate, timeout_s: float = 30.0) -> str:
        """Collect messages until one satisfies ``predicate``; return it.

        Raises:
            AssertionError: none did within ``timeout_s``.
        """
        for message in self.messages:
            if predicate(message):
                return message
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.messages.append(message)
            if predicate(message):
                return message
        raise AssertionError(f"no such notification; got {self.messages}")

    def close(self) -> None:
        """Close and unlink the socket."""
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)
