"""A worker gives its memory back after a burst of the largest ``logprobs`` answers.

16 parallel requests of ``n`` 8, ``max_tokens`` 4096 (plus an echoed prompt, to the edge of
``MAX_LOGPROB_ENTRIES``) with ``logprobs`` 5 make a worker hold about a hundred MiB while they are
answered (their JSON is ~6.5 MB each). Afterwards its resident memory must come back to within
``RETURN_BOUND_MIB`` of what it was before (measured after a warm-up request of the same kind, so
imports and caches are already counted): the entries are kept in typed arrays, not in millions of
small objects that pin CPython's arenas (``wsgi_app/wire/logprobs.py``), and the freed C heap is trimmed
once the worker is idle (``wsgi_app/server/heap.py``). Before both, the worker stayed ~70 MiB above.
"""

from __future__ import annotations

import json

from tests.server import concurrently, wait_until

PARALLEL = 16
RETURN_BOUND_MIB = (
    24  # after-burst RSS minus the baseline; measured: 2-3 MiB, 70 MiB before the fix
)
PROMPT = "To be, or not to be, that is the question. " * 31  # 1333 bytes: 1333 tokens
BODY = {"model": "m", "prompt": PROMPT, "n": 8, "max_tokens": 4096, "echo": True, "logprobs": 5}


def rss_mib(pid: int) -> float:
    """Return ``pid``'s resident set size in MiB (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_budget_sized_burst_leaves_no_memory_behind(serve):
    assert 8 * (4096 + len(PROMPT)) * 6 <= 262_144  # the default MAX_LOGPROB_ENTRIES
    srv = serve(REQUEST_TIMEOUT_S="600")
    pid = srv.state()["pid"]

    def ask(_: int) -> int:
        status, headers, raw = srv.complete({**BODY, "seed": 3}, timeout_s=600)
        assert status == 200, raw[:300]
        assert int(headers["content-length"]) == len(raw)
        doc = json.loads(raw)
        assert [len(c["logprobs"]["tokens"]) for c in doc["choices"]] == [4096 + len(PROMPT)] * 8
        return len(raw)

    ask(0)  # warm-up: the first big answer's imports, caches, encoder buffers
    srv.wait_idle()
    settled: list[float] = []

    def steady() -> bool:  # two reads 0.5 s apart within 1 MiB: the trim after the warm-up ran
        settled.append(rss_mib(pid))
        return len(settled) > 25 and abs(settled[-1] - settled[-26]) < 1

    wait_until(steady, 30, "the worker's RSS to settle after the warm-up")
    baseline = settled[-1]
    sizes = concurrently(ask, PARALLEL, timeout_s=600)
    assert len(set(sizes)) == 1 and sizes[0] > 6_000_000  # same seed, same answer
    srv.wait_idle()
    after: list[float] = []
    wait_until(
        lambda: after.append(rss_mib(pid)) or after[-1] - baseline <= RETURN_BOUND_MIB,
        15,
        lambda: (
            f"RSS back within {RETURN_BOUND_MIB} MiB of {baseline:.1f} MiB; last {after[-1]:.1f}"
        ),
    )
