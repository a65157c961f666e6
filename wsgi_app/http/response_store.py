"""Stored responses (the Responses API's ``store``): kept for ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``, bounded in count and bytes, expiring.

A stored response is one JSON record: the response object as answered and its conversation's items
(the stored conversation it continued, its input, its output as items), so a follow-up needs one
read whatever the length of the chain. Each record belongs to an owner, the API key that made it
(its digest): a lookup by another owner finds nothing, exactly as an unknown id. With no
``API_KEYS`` the server is open to every client, and so is its store: every request is the one
owner ``""``.

Two backends, the same behaviour:

- :class:`SqliteResponseStore` (the default): a SQLite file (``RESPONSES_DB``) every worker of a
  host shares, in WAL mode, each call a short connection on the hub's thread pool, as
  ``telemetry.history`` keeps ``STATS_DB``. A write (one transaction, the file's write lock taken
  first) drops the expired records, then the oldest until the count and the bytes, which triggers
  keep in a totals row, are within bounds.
- :class:`RedisResponseStore` (``RESPONSES_REDIS_URL``): shared by every host; a record is a key
  with a TTL, and one Lua script (atomic on the server) adds it to an index by time and evicts the
  expired and the oldest beyond the bounds.

Source: OpenAI API reference, "Responses" (``store``, retrieve, delete); SQLite documentation,
"Write-Ahead Logging"; Redis documentation, "Scripting with Lua" (``EVALSHA``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import gevent

from telemetry.history import retry_locked

log = logging.getLogger("greenserve.responses")
T = TypeVar("T")

# The totals row is kept by triggers, so a write checks the bounds without scanning the table.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, bytes INTEGER NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_time ON responses (created);
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 1), count INTEGER NOT NULL, bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses BEGIN
    UPDATE totals SET count = count + 1, bytes = bytes + new.bytes;
END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses BEGIN
    UPDATE totals SET count = count - 1, bytes = bytes - old.bytes;
END;
"""


class ResponseStore(Protocol):
    """Where stored responses live (every method is called from a request's greenlet)."""

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (JSON-encodable) under ``(owner, response_id)``, evicting as needed."""

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """Return the record, or None when unknown, expired, evicted or another owner's."""

    def delete(self, owner: str, response_id: str) -> bool:
        """Delete the record; return whether it was there (this owner's)."""


def encode_record(record: dict[str, Any]) -> bytes:
    """Return ``record`` as compact UTF-8 JSON (what a store keeps and counts)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()


def _on_pool(func: Callable[..., T], *args: Any) -> T:
    """Run ``func(*args)`` on the hub's thread pool: SQLite's file I/O never blocks the hub."""
    return gevent.get_hub().threadpool.apply(func, args)


class SqliteResponseStore:
    """Stored responses in a SQLite file shared by the workers of a host.

    Args:
        path: the database file (created with its table if missing).
        max_count: the most records kept (``RESPONSES_MAX_COUNT``).
        max_bytes: the most bytes of records kept (``RESPONSES_MAX_MB``).
        ttl_s: seconds a record is kept (``RESPONSES_TTL_S``).
        clock: Unix time in seconds (tests step it).

    Raises:
        sqlite3.Error: the file cannot be opened or created.
    """

    def __init__(
        self,
        path: str,
        max_count: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        # One connection for the worker's life, used by one pool thread at a time: a connection
        # per call costs two fsyncs (the last one to close checkpoints the WAL, the next one's
        # first commit starts it again), ~15 ms a stored response against ~0.1 ms. The lock is
        # taken by the calling greenlet, around the whole trip to the pool (:meth:`_call`): a
        # monkey-patched lock taken inside pool threads can leave its waiters asleep for good.
        self._lock = threading.Lock()
        self._conn = _on_pool(retry_locked, self._open)

    def _call(self, func: Callable[..., T], *args: Any) -> T:
        """Run ``func(*args)`` on the pool, one call of this worker's at a time."""
        with self._lock:
            return _on_pool(func, *args)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, fast commits
        with conn:
            conn.executescript(_SCHEMA)
        return conn

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with self._conn as conn:  # one transaction, committed on success (under _call's lock)
            yield conn

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record``, then evict the expired and the oldest beyond the bounds."""
        self._call(self._put, owner, response_id, encode_record(record), self.clock())

    def _put(self, owner: str, response_id: str, body: bytes, now: float) -> None:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")  # one writer at a time: the bounds hold across workers
            conn.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
            conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))  # (never, in use)
            conn.execute(
                "INSERT INTO responses (id, owner, created, bytes, body) VALUES (?, ?, ?, ?, ?)",
                (response_id, owner, now, len(body), body),
            )
            count, total = conn.execute("SELECT count, bytes FROM totals").fetchone()
            if count <= self.max_count and total <= self.max_bytes:
                return
            doomed = []
            for rid, size in conn.execute("SELECT id, bytes FROM responses ORDER BY created, id"):
                if count <= self.max_count and total <= self.max_bytes:
                    break
                doomed.append((rid,))
                count, total = count - 1, total - size
            conn.executemany("DELETE FROM responses WHERE id = ?", doomed)

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """Return the record, or None (unknown, expired, evicted, another owner's)."""
        body = self._call(self._get, owner, response_id, self.clock())
        return None if body is None else json.loads(body)

    def _get(self, owner: str, response_id: str, now: float) -> bytes | None:
        with self._connect() as conn:
            row = conn.execute(
                "SELECT body FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                (response_id, owner, now - self.ttl_s),
            ).fetchone()
        return None if row is None else row[0]

    def delete(self, owner: str, response_id: str) -> bool:
        """Delete the record; return whether this owner had it (expired ones count as gone)."""
        return self._call(self._delete, owner, response_id, self.clock())

    def _delete(self, owner: str, response_id: str, now: float) -> bool:
        with self._connect() as conn:
            cur = conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                (response_id, owner, now - self.ttl_s),
            )
        return cur.rowcount > 0


# KEYS: the index (a sorted set of record keys by time), the sizes (a hash of record key -> bytes),
# the total bytes, the record's key. ARGV: the record, the TTL (s), now (s), the most records, the
# most bytes. The index and the sizes may name records Redis already expired: they count until
# this script evicts them as expired (their time) or as the oldest.
_PUT = """
local index, sizes, total, key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttl, now = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', index, member)
  redis.call('DEL', member)
  redis.call('DECRBY', total, size)
end
if redis.call('EXISTS', key) == 1 then drop(key) end
redis.call('SET', key, ARGV[1], 'EX', ttl)
redis.call('ZADD', index, now, key)
redis.call('HSET', sizes, key, #ARGV[1])
redis.call('INCRBY', total, #ARGV[1])
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl)) do drop(member) end
while redis.call('ZCARD', index) > max_count
    or tonumber(redis.call('GET', total) or '0') > max_bytes do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
return 1
"""
_DELETE = """
local index, sizes, total, key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local size = tonumber(redis.call('HGET', sizes, key) or '0')
redis.call('HDEL', sizes, key)
redis.call('ZREM', index, key)
redis.call('DECRBY', total, size)
return redis.call('DEL', key)
"""


class RedisResponseStore:
    """Stored responses in Redis, shared by every host that names the same server and prefix.

    Args:
        url: the Redis URL (``RESPONSES_REDIS_URL``, ``redis://host:6379/0``).
        prefix: the prefix of every key (``RESPONSES_REDIS_PREFIX``).
        max_count, max_bytes, ttl_s, clock: as :class:`SqliteResponseStore`'s.
        timeout_s: the socket timeout of each command, seconds.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        max_count: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
    ) -> None:
        import redis  # only a worker with a Redis store imports the client

        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = prefix
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._meta = [f"{prefix}index", f"{prefix}sizes", f"{prefix}bytes"]
        self._put = self.client.register_script(_PUT)
        self._delete = self.client.register_script(_DELETE)

    def _key(self, owner: str, response_id: str) -> str:
        return f"{self.prefix}r:{owner or '-'}:{response_id}"

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` with its TTL, then evict the expired and the oldest beyond the bounds."""
        args = [encode_record(record), max(1, round(self.ttl_s)), self.clock()]
        self._put(
            keys=[*self._meta, self._key(owner, response_id)],
            args=[*args, self.max_count, self.max_bytes],
        )

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """Return the record, or None (unknown, expired, evicted, another owner's)."""
        body = self.client.get(self._key(owner, response_id))
        return None if body is None else json.loads(body)

    def delete(self, owner: str, response_id: str) -> bool:
        """Delete the record; return whether this owner had it."""
        return bool(self._delete(keys=[*self._meta, self._key(owner, response_id)]))
