"""The default history belongs to one server's start.

The default ``STATS_DB`` was ``greenserve-stats-<PORT>.db`` in the temp dir, so ``/status`` and
``/stats/history`` mixed in the history of an earlier server that used the same port. It is now a file
in the master's own metrics directory, removed when it exits; a configured ``STATS_DB`` (the
deploy's, under ``/var/lib``) still persists across restarts.

Source: docs/ARCHITECTURE.md §10 (history).
"""

from __future__ import annotations

import json

from tests.server import GunicornServer, wait_until


def served(srv: GunicornServer) -> int:
    """The requests ``/stats/history`` counts over its whole window."""
    status, _, raw = srv.get("/stats/history")
    assert status == 200, raw
    return sum(m.get("requests", 0) for m in json.loads(raw)["minutes"])


def run_twice(tmp_path, succ_dir, stats_db: str | None) -> tuple[int, int]:
    """Two servers one after the other on the same port; return what each saw at its start and
    after serving 3 requests."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    seen = []
    for i in range(2):
        srv = GunicornServer(tmp_path / f"run{i}", {"MODEL_DIR": str(succ_dir), "TMPDIR": str(tmp)})
        srv.env.pop("STATS_DB")
        if stats_db:
            srv.env["STATS_DB"] = stats_db
        with srv:
            seen.append(served(srv))
            for _ in range(3):
                assert srv.complete({"model": "m", "prompt": "A", "max_tokens": 1})[0] == 200
            wait_until(lambda srv=srv: served(srv) >= 3, 15, "the history to hold them")
    return seen[0], seen[1]


def test_a_new_server_starts_with_no_history(tmp_path, succ_dir):
    assert run_twice(tmp_path, succ_dir, None) == (0, 0)
    assert list((tmp_path / "tmp").iterdir()) == []  # the history went with its master


def test_a_configured_stats_db_persists_across_restarts(tmp_path, succ_dir):
    first, second = run_twice(tmp_path, succ_dir, str(tmp_path / "stats.db"))
    assert first == 0 and second >= 3
