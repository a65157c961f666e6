"""Why a generation ended: the names of ``RequestRecord.end_reason`` (docs/ARCHITECTURE.md §9).

Here, below both their users, so that the worker (which marks a connection it cuts, or one the send
timeout cut: ``wsgi_app.server.stream_socket.StreamSocket.end_reason``) and the request's record
(``wsgi_app.generation.record``) share them without the transport importing the generation.

The client's doing: CLIENT_LEFT (it closed the connection), SEND_TIMEOUT (it stopped reading for
``SEND_TIMEOUT_S``). The server's: DEADLINE (``REQUEST_TIMEOUT_S``), SHUTDOWN (the worker stopping),
ENGINE_ERROR (any other failure), WORKER_LOST (the worker died with the request in flight: counted
by the master, ``telemetry.lost``, never on a record). A normal end: FINISHED (every choice ran to
``max_tokens``), STOP (at least one choice ended at a stop string or the end-of-generation token).
"""

from __future__ import annotations

FINISHED, STOP = "finished", "stop"
CLIENT_LEFT, SEND_TIMEOUT = "client_left", "send_timeout"
DEADLINE, SHUTDOWN, ENGINE_ERROR = "deadline", "shutdown", "engine_error"
WORKER_LOST = "worker_lost"
END_REASONS = (FINISHED, STOP, CLIENT_LEFT, SEND_TIMEOUT, DEADLINE, SHUTDOWN, ENGINE_ERROR)
