"""Server-side numbers from /proc (CPU seconds, RSS, threads) and small statistics helpers."""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable, Sequence

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def children(pid: int) -> list[int]:
    """Return the ids of ``pid``'s direct children (via /proc/<pid>/task/*/children)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def tree(pid: int) -> list[int]:
    """Return ``pid`` and all its descendants."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(children(p))
    return pids


def cpu_s(pids: Iterable[int]) -> float:
    """Return user + system CPU seconds used so far by ``pids`` (fields 14 and 15 of /proc/pid/stat)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def rss_bytes(pids: Iterable[int]) -> int:
    """Return the summed resident set size of ``pids`` in bytes (/proc/pid/statm)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except OSError:
            continue
    return total


def rss_pss_kib(pid: int) -> tuple[int, int]:
    """Return ``pid``'s resident and proportional set sizes in KiB (/proc/pid/smaps_rollup).

    PSS charges each shared page to its N mappers as 1/N of a page, so two workers mapping the same
    weight file show a PSS about half the file below their RSS.

    Raises:
        OSError: the process is gone.
    """
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f.read().splitlines()[1:]:
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0])
    return values["Rss"], values["Pss"]


def threads(pids: Iterable[int]) -> int:
    """Return the number of threads of ``pids``."""
    n = 0
    for pid in pids:
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def core_busy_s(cores: Iterable[int]) -> float:
    """Return the CPU seconds ``cores`` have spent busy (anything but idle and iowait) since boot.

    Compared with the server's own CPU seconds over a window, it shows whether anything else ran on
    the server's core meanwhile (other processes, interrupts), i.e. how clean a measurement was.
    """
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                ticks = [int(x) for x in fields[:8]]
                busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / _CLK_TCK


def own_cpu_s() -> float:
    """Return this process's user + system CPU seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def raise_nofile() -> int:
    """Raise this process's open-file soft limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def percentiles(values: Sequence[float], qs: Sequence[float], zeros: int = 0) -> list[float | None]:
    """Return the nearest-rank percentiles ``qs`` (0..1) of ``values`` plus ``zeros`` extra zeros.

    Returns None for each q when there is no value at all.
    """
    data = sorted(values)
    n = len(data) + zeros
    out: list[float | None] = []
    for q in qs:
        if n == 0:
            out.append(None)
            continue
        rank = max(1, math.ceil(q * n)) - 1
        out.append(0.0 if rank < zeros else data[rank - zeros])
    return out


def ms(values: Sequence[float], qs: Sequence[float], zeros: int = 0) -> dict[str, float | None]:
    """Return ``{"p50": …}`` in milliseconds, rounded to microseconds, for seconds ``values``."""
    names = [f"p{round(q * 100)}" if q < 1 else "max" for q in qs]
    return {
        name: None if v is None else round(v * 1000, 3)
        for name, v in zip(names, percentiles(values, qs, zeros), strict=True)
    }
