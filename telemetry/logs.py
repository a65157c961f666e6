"""Structured logs: one JSON object per line, for gunicorn's own messages and the app's alike.

The formatter is ``python-json-logger``'s, configured so every line starts with ``time`` (ISO 8601 UTC,
milliseconds), ``level``, ``logger``, ``pid`` and ``message``, followed by the record's ``extra`` fields
(``request_id``, ``trace_id``, ``status``, …). ``logging_config()`` is the ``logconfig_dict`` that
``gunicorn.conf.py`` hands to gunicorn, so its master and workers log in the same shape.

Source: python-json-logger documentation (``pythonjsonlogger.json.JsonFormatter``); Python
``logging.config`` dictionary schema; gunicorn settings, ``logconfig_dict``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonEncoder
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

__all__ = [
    "CLIENT_HASH_HEX",
    "JsonFormatter",
    "StderrHandler",
    "client_hash",
    "held_lines",
    "lighten_records",
    "logging_config",
]

CLIENT_HASH_HEX = (
    16  # hex characters kept of the salted SHA-256: 64 bits, enough to tell clients apart
)


class JsonFormatter(_JsonFormatter):
    """Format a record as one JSON line: ``time``, ``level``, ``logger``, ``pid``, ``message``, extras.

    Exceptions appear as ``exc_info`` (the formatted traceback). Non-ASCII text is written as is.
    """

    def __init__(self) -> None:
        super().__init__(
            ["levelname", "name", "process", "message"],
            rename_fields={"levelname": "level", "name": "logger", "process": "pid"},
            json_ensure_ascii=False,
        )
        # The library's serializer, json.dumps(data, cls=JsonEncoder, ensure_ascii=False), makes an
        # encoder per line; one made once encodes the same bytes.
        self._encode = JsonEncoder(ensure_ascii=False).encode

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        """Put ``time`` first, then the library's fields (see the class docstring)."""
        stamp = datetime.fromtimestamp(record.created, tz=UTC)
        log_data["time"] = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        super().add_fields(log_data, record, message_dict)

    def jsonify_log_record(self, log_data: dict[str, Any]) -> str:
        """Return the line's JSON text (as the library's, with one encoder for every line)."""
        return self._encode(log_data)


class StderrHandler(logging.StreamHandler):
    """A ``StreamHandler`` (stderr by default) that can hold lines: within :func:`held_lines` the
    formatted lines are kept, then written with one ``write`` (one system call for a batch of
    request lines instead of one each). Every line is written, in order.
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._held: list[str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Write the record's line now, or keep it while lines are held."""
        if self._held is None:
            super().emit(record)
            return
        try:
            self._held.append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the lines emitted inside the block; write them at its end (nested blocks: the outer
        one writes)."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            lines, self._held = self._held, None
            if lines:
                with self.lock:
                    try:
                        self.stream.write("".join(lines))
                        self.flush()
                    except Exception:  # as StreamHandler.emit: report, never raise
                        self.handleError(logging.makeLogRecord({"msg": "held lines lost"}))


@contextlib.contextmanager
def held_lines(logger: logging.Logger) -> Iterator[None]:
    """Hold the lines of every :class:`StderrHandler` that ``logger``'s records reach, and write
    them at the end of the block (see :class:`StderrHandler`)."""
    with contextlib.ExitStack() as stack:
        node: logging.Logger | None = logger
        while node is not None:
            for handler in node.handlers:
                if isinstance(handler, StderrHandler):
                    stack.enter_context(handler.held())
            node = node.parent if node.propagate else None
        yield


@functools.lru_cache(maxsize=4096)  # clients come back: hash each address once per worker
def client_hash(salt: str, peer: str | None) -> str:
    """Return the salted, truncated SHA-256 of a client's address, safe to log.

    Args:
        salt: ``CLIENT_HASH_SALT`` (the same in every worker of a server).
        peer: the client's address (``REMOTE_ADDR``), or None when unknown (hashed as "").

    Returns:
        ``CLIENT_HASH_HEX`` lower-case hex characters of ``sha256(salt + peer)``.
    """
    digest = hashlib.sha256((salt + (peer or "")).encode("utf-8")).hexdigest()
    return digest[:CLIENT_HASH_HEX]


def lighten_records() -> None:
    """Have the logging module skip what no line of :class:`JsonFormatter` shows: the caller's file,
    line and function (a walk up the stack for every record), the thread and the process's name.
    Process-wide; the pid is still recorded.

    Source: Python Logging HOWTO, "Optimization" (``logging._srcfile``, ``logThreads``,
    ``logMultiprocessing``).
    """
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False


def logging_config(level: str) -> dict[str, Any]:
    """Return the ``logging.config.dictConfig`` schema for gunicorn's ``logconfig_dict``.

    Everything goes to stderr as JSON lines: the root logger, ``gunicorn.error`` and the app's
    ``greenserve.*`` loggers. ``gunicorn.access`` only passes warnings: a ``logconfig_dict`` turns
    gunicorn's access log on, and the app already writes one richer line per request.

    Args:
        level: a level name (``debug``, ``info``, ``warning``, ``error``, ``critical``; any case).

    Raises:
        ValueError: ``level`` is not a logging level name.
    """
    name = level.upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"LOG_LEVEL must be a logging level name, got {level!r}")

    def logger(lvl: str) -> dict[str, Any]:
        return {"level": lvl, "handlers": ["stderr"], "propagate": False}

    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "telemetry.logs.JsonFormatter"}},
        "handlers": {
            "stderr": {
                "class": "telemetry.logs.StderrHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": name, "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": logger(name),
            "gunicorn.access": logger("WARNING"),
            "greenserve": logger(name),
        },
    }
