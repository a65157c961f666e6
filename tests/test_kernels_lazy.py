"""numba in a gunicorn server: never loaded for the bigram, compiled by the master for a Llama.

The bigram (the zero-set-up default) must start as fast as before the kernels: neither its master
nor its workers may load numba or llvmlite. A Llama model's kernels are compiled (or loaded from
numba's cache) by the master when it loads the model at the first start (every kernel: the model
imports them all), and handed compiled to every worker it forks, a reload's included: no worker ever
compiles (model/kernels/jit.py). Checked on real servers through ``/proc``: a process
that imported numba has llvmlite's shared library mapped.
"""

from __future__ import annotations

import signal
from pathlib import Path

from tests.server import GunicornServer, wait_until


def children(pid: int) -> set[int]:
    """Return the pids of a process's children (gunicorn's workers, for the master)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found.update(int(p) for p in text.split())
    return found


def maps_llvm(pid: int) -> bool:
    """Return True when the process has llvmlite's library mapped (it imported numba)."""
    return "llvmlite" in Path(f"/proc/{pid}/maps").read_text()


def test_a_bigram_server_never_loads_numba(tmp_path):
    with GunicornServer(tmp_path, workers=2) as srv:
        workers = srv.wait_workers(2)
        status, _, _ = srv.complete({"model": "m", "prompt": "To be", "max_tokens": 4})
        assert status == 200
        assert workers <= children(srv.proc.pid)
        assert [maps_llvm(p) for p in (srv.proc.pid, *sorted(workers))] == [False, False, False]


def test_a_llama_servers_workers_never_compile_not_even_after_a_reload(tmp_path, stories_dir):
    cache = tmp_path / "numba"
    env = {"MODEL_DIR": str(stories_dir), "GREENSERVE_NUMBA_CACHE_DIR": str(cache)}
    srv = GunicornServer(tmp_path, env, workers=2).start(timeout_s=180)  # compiles: ~25 s idle
    try:
        first = srv.wait_workers(2)
        # the master compiled every kernel (numba's index file per kernel) and holds them
        compiled = {p.name.split("-")[0] for p in cache.rglob("*.nbi")}
        assert {"products._q8", "attention.attend", "mathf.rmsnorm", "mathf.silu_mul"} <= compiled
        assert maps_llvm(srv.proc.pid) and first <= children(srv.proc.pid)
        for path in cache.rglob("*"):
            if path.is_file():
                path.unlink()
        srv.signal(signal.SIGHUP)  # new workers, forked from a master holding the kernels
        wait_until(lambda: len(srv.wait_workers(2) - first) == 2 or None, 60, lambda: "2 new")
        for _ in range(4):  # both new workers answer, on the kernels' path
            status, _, body = srv.complete({"model": "m", "prompt": "Once", "max_tokens": 4})
            assert status == 200, body
        assert [p for p in cache.rglob("*") if p.is_file()] == []  # nothing was compiled again
    finally:
        srv.stop()


def test_an_unwritable_kernels_cache_falls_back_to_a_temporary_one_removed_at_exit(
    tmp_path, stories_dir
):
    blocker = tmp_path / "afile"
    blocker.write_text("a file where the setting expects a directory")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        "MODEL_DIR": str(stories_dir),
        "GREENSERVE_NUMBA_CACHE_DIR": str(blocker / "numba"),
        "TMPDIR": str(temp),
    }
    srv = GunicornServer(tmp_path / "server", env).start(timeout_s=180)  # compiles: ~25 s
    try:
        status, _, body = srv.complete({"model": "m", "prompt": "Once", "max_tokens": 4})
        assert status == 200, body
        made = [p.name for p in temp.iterdir() if p.name.startswith("greenserve-numba-")]
        assert len(made) == 1  # one for the server: the master's, its workers use it
        warnings = [
            line for line in srv.log_text().splitlines() if "cannot write compiled kernels" in line
        ]
        assert len(warnings) == 1 and "GREENSERVE_NUMBA_CACHE_DIR" in warnings[0]
    finally:
        assert srv.stop() == 0
    assert [p.name for p in temp.iterdir() if p.name.startswith("greenserve-numba-")] == []
