"""Per-minute request history in SQLite, shared by every worker of a host and kept across restarts.

Each worker aggregates finished requests per minute in memory (``telemetry.recorder``, a few dict
updates per request) and a ``telemetry.flusher.Flusher`` greenlet adds them to the database every
``STATS_FLUSH_S`` seconds in one short transaction, run on the hub's thread pool so SQLite never
blocks the hub. Rows are sums, so any number of workers (and restarts) add up. The same flush writes
the worker's heartbeat row for ``/stats``. The database is in WAL mode: readers never block the
writers. Every query takes ``now`` (Unix seconds) from the caller's injectable clock.

Source: SQLite documentation, "Write-Ahead Logging" and "UPSERT"; docs/ARCHITECTURE.md §10.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

from telemetry.recorder import COLUMNS, SKETCHED, Batch
from telemetry.sketch import quantiles

__all__ = ["KEEP_MINUTES", "WEEK_S", "HistoryStore", "retry_locked"]

log = logging.getLogger("greenserve.history")

WEEK_S = 7 * 86_400
KEEP_MINUTES = 8 * 1440  # a day more than the error-budget window

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS minutes (
    minute INTEGER PRIMARY KEY,
    {", ".join(f"{c} {'REAL' if c.endswith('_s') else 'INTEGER'} NOT NULL DEFAULT 0" for c in COLUMNS)}
);
CREATE TABLE IF NOT EXISTS sketch_bins (
    minute INTEGER NOT NULL, metric TEXT NOT NULL, key INTEGER NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (minute, metric, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS workers (
    pid INTEGER PRIMARY KEY, master_pid INTEGER NOT NULL, started_at REAL NOT NULL,
    updated_at REAL NOT NULL, state TEXT NOT NULL
);
"""
_UPSERT_MINUTE = (
    f"INSERT INTO minutes (minute, {', '.join(COLUMNS)}) VALUES (?{', ?' * len(COLUMNS)}) "
    f"ON CONFLICT(minute) DO UPDATE SET {', '.join(f'{c} = {c} + excluded.{c}' for c in COLUMNS)}"
)
# DDSketch bins (telemetry.sketch) add up: a sum of counts per bin merges workers and minutes.
_UPSERT_BIN = (
    "INSERT INTO sketch_bins (minute, metric, key, n) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(minute, metric, key) DO UPDATE SET n = n + excluded.n"
)
_UPSERT_WORKER = (
    "INSERT INTO workers (pid, master_pid, started_at, updated_at, state) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT(pid) DO UPDATE SET master_pid = excluded.master_pid, "
    "started_at = excluded.started_at, updated_at = excluded.updated_at, state = excluded.state"
)


def retry_locked(fn: Callable[[], Any], attempts: int = 50) -> Any:
    """Return ``fn()``, called again (up to ``attempts`` times, backing off 20 ms more each time)
    while SQLite says the database is locked: two processes opening a new file at once (both
    switching it to WAL) collide there, whatever ``busy_timeout`` says.

    Raises:
        sqlite3.OperationalError: another error, or still locked after ``attempts`` calls.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except sqlite3.OperationalError as exc:  # e.g. two workers switching to WAL at once
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.02 * (attempt + 1))
    return None


class HistoryStore:
    """The SQLite database at ``STATS_DB``; every method opens its own short connection.

    Args:
        path: database file (created with its tables if missing).
        busy_timeout_s: how long a statement waits for another writer's lock, seconds.

    Raises:
        sqlite3.Error: the file cannot be opened or created.
    """

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        retry_locked(self._create)

    def _create(self) -> None:
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")  # persistent: recorded in the file
            conn.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, check_same_thread=False)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, fast commits
            with conn:  # one transaction, committed on success
                yield conn
        finally:
            conn.close()

    def write(self, batch: Batch, worker: dict[str, Any] | None = None) -> None:
        """Add ``batch``'s sums and upsert the worker's heartbeat, in one transaction.

        Args:
            batch: per-minute sums (see :class:`Batch`).
            worker: ``{"pid", "master_pid", "started_at", "updated_at", "state": {...}}`` or None.
        """
        with self._connect() as conn:
            conn.executemany(
                _UPSERT_MINUTE,
                [(m, *(row[c] for c in COLUMNS)) for m, row in sorted(batch.rows.items())],
            )
            conn.executemany(_UPSERT_BIN, [(*k, n) for k, n in sorted(batch.bins.items())])
            if worker is not None:
                conn.execute(
                    _UPSERT_WORKER,
                    (
                        worker["pid"],
                        worker["master_pid"],
                        worker["started_at"],
                        worker["updated_at"],
                        json.dumps(worker["state"], separators=(",", ":")),
                    ),
                )

    def remove_worker(self, pid: int) -> None:
        """Delete a worker's heartbeat row (the worker is exiting)."""
        with self._connect() as conn:
            conn.execute("DELETE FROM workers WHERE pid = ?", (pid,))

    def prune(self, now: float) -> None:
        """Delete minutes older than ``KEEP_MINUTES`` before ``now`` (Unix seconds)."""
        oldest = int(now // 60) - KEEP_MINUTES
        with self._connect() as conn:
            conn.execute("DELETE FROM minutes WHERE minute < ?", (oldest,))
            conn.execute("DELETE FROM sketch_bins WHERE minute < ?", (oldest,))

    def _sums(self, conn: sqlite3.Connection, first: int, last: int) -> dict[str, float]:
        row = conn.execute(
            f"SELECT {', '.join(f'COALESCE(SUM({c}), 0)' for c in COLUMNS)} FROM minutes "
            "WHERE minute BETWEEN ? AND ?",
            (first, last),
        ).fetchone()
        return dict(zip(COLUMNS, row, strict=True))

    def series(self, now: float, minutes: int = 60) -> list[dict[str, Any]]:
        """Return one entry per minute for the last ``minutes`` minutes (oldest first, zeros filled).

        Each entry: ``t`` (Unix seconds at the minute's start), the counts of ``COLUMNS`` except the
        sums, ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p95_s``, ``e2e_mean_s``, ``e2e_p95_s`` (None when
        the minute has no such observation; quantiles from the minute's sketch, within 1 %).
        """
        last = int(now // 60)
        first = last - minutes + 1
        with self._connect() as conn:
            rows = {
                r[0]: dict(zip(COLUMNS, r[1:], strict=True))
                for r in conn.execute(
                    f"SELECT minute, {', '.join(COLUMNS)} FROM minutes WHERE minute BETWEEN ? AND ?",
                    (first, last),
                )
            }
            bins: dict[tuple[int, str], list[tuple[int, int]]] = {}
            for minute, metric, key, n in conn.execute(
                "SELECT minute, metric, key, n FROM sketch_bins WHERE minute BETWEEN ? AND ? "
                "AND metric IN ('ttft', 'e2e')",
                (first, last),
            ):
                bins.setdefault((minute, metric), []).append((key, n))
        out = []
        for minute in range(first, last + 1):
            row = rows.get(minute, dict.fromkeys(COLUMNS, 0))
            entry: dict[str, Any] = {"t": minute * 60}
            entry.update({c: int(row[c]) for c in COLUMNS if not c.endswith("_s")})
            for metric, qs in (("ttft", (0.5, 0.95)), ("e2e", (0.95,))):
                n = row[f"{metric}_count"]
                entry[f"{metric}_mean_s"] = row[f"{metric}_sum_s"] / n if n else None
                values = quantiles(bins.get((minute, metric), ()), qs)
                for q, value in zip(qs, values, strict=True):
                    entry[f"{metric}_p{round(q * 100)}_s"] = value
            out.append(entry)
        return out

    def latency(self, since: float, now: float) -> dict[str, dict[str, float | None]]:
        """Return p50, p90 and p99 (seconds) of each sketched latency (``ttft``, ``e2e``,
        ``queue_wait``, ``itl``) over the minutes from ``since`` to ``now`` (Unix seconds), merged
        over every worker: within 1 % of the observed order statistics (``telemetry.sketch``)."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT metric, key, SUM(n) FROM sketch_bins WHERE minute BETWEEN ? AND ? "
                "GROUP BY metric, key",
                (int(since // 60), int(now // 60)),
            ).fetchall()
        bins: dict[str, list[tuple[int, int]]] = {m: [] for m in SKETCHED}
        for metric, key, n in rows:
            bins.setdefault(metric, []).append((key, n))
        out = {}
        for metric in SKETCHED:
            p50, p90, p99 = quantiles(bins[metric], (0.5, 0.9, 0.99))
            out[metric] = {"p50": p50, "p90": p90, "p99": p99}
        return out

    def budget(self, now: float, target: float, window_s: int = WEEK_S) -> dict[str, Any]:
        """Return the error budget over the ``window_s`` seconds up to ``now``.

        A request is bad when it failed (5xx, or an error after the first byte) or its first token came
        later than ``SLO_TTFT_S``. With ``N`` requests the budget allows ``(1 - target) * N`` bad ones;
        ``remaining`` is ``1 - bad / allowed`` (1.0 with no traffic, negative once overspent) and
        ``burn_rate_1h`` is the last hour's bad fraction over ``1 - target``.

        Args:
            now: Unix seconds.
            target: the fraction of good requests promised (``SLO_TARGET``), below 1.
        """
        last = int(now // 60)
        with self._connect() as conn:
            week = self._sums(conn, last - window_s // 60 + 1, last)
            hour = self._sums(conn, last - 59, last)
        allowed = (1.0 - target) * week["requests"]
        hour_rate = hour["bad"] / hour["requests"] if hour["requests"] else 0.0
        return {
            "window_s": window_s,
            "target": target,
            "requests": int(week["requests"]),
            "bad": int(week["bad"]),
            "failed": int(week["failed"]),
            "slow_ttft": int(week["slow_ttft"]),
            "allowed_bad": allowed,
            "remaining": 1.0 - week["bad"] / allowed if allowed else 1.0,
            "burn_rate_1h": hour_rate / (1.0 - target),
        }

    def rates(self, now: float) -> dict[str, float]:
        """Return per-second rates over the last 60 s, from the current and the previous minute.

        The previous minute is weighted by the part of it still inside the window (the sliding-window
        estimate), so the rate does not drop to zero when a new minute starts.
        """
        minute = int(now // 60)
        weight = 1.0 - (now - minute * 60) / 60.0
        with self._connect() as conn:
            cur = self._sums(conn, minute, minute)
            prev = self._sums(conn, minute - 1, minute - 1)
        names = ("requests", "failed", "prompt_tokens", "completion_tokens")
        return {f"{c}_per_s": (cur[c] + prev[c] * weight) / 60.0 for c in names}

    def workers(self, master_pid: int, now: float, max_age_s: float) -> list[dict[str, Any]]:
        """Return the live workers of the server whose master is ``master_pid``, by pid.

        A row counts when its heartbeat is at most ``max_age_s`` old and its process still exists.
        """
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT pid, started_at, updated_at, state FROM workers "
                "WHERE master_pid = ? AND updated_at >= ? ORDER BY pid",
                (master_pid, now - max_age_s),
            ).fetchall()
        out = []
        for pid, started_at, updated_at, state in rows:
            if not _alive(pid):
                continue
            out.append(
                {
                    "pid": pid,
                    "uptime_s": round(now - started_at, 3),
                    "heartbeat_age_s": round(max(0.0, now - updated_at), 3),
                    **json.loads(state),
                }
            )
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
