"""What the benchmark scripts do around their measurements: a progress log stamped with elapsed
seconds, client threads run together and timed, and the figures written out (a JSON + Markdown pair
under ``bench/results/``, or a JSON report on stdout and in ``--out``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def utc_stamp() -> str:
    """Return the current UTC time as ``20250101T120000Z``, the prefix of a result file's name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


class ElapsedLog:
    """A callable that prints a progress line prefixed with the seconds since the log was made."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, line: str) -> None:
        """Print ``line`` as ``[  12.3s] line``, flushed (a long run shows its progress)."""
        print(f"[{self.elapsed_s():6.1f}s] {line}", flush=True)

    def elapsed_s(self) -> float:
        """Return the seconds since the log was made, to 0.1 s."""
        return round(time.monotonic() - self.t0, 1)


def run_together(threads: Sequence[threading.Thread]) -> float:
    """Start every thread, then join them all; return the wall time of the whole, in seconds."""
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0


def write_pair(path: Path, result: dict[str, Any], markdown: str, indent: int = 2) -> None:
    """Write ``result`` as JSON to ``path`` and ``markdown`` beside it (``path`` with ``.md`` for
    its suffix); folders are made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    path.with_suffix(".md").write_text(markdown)


def print_json(report: dict[str, Any], out: Path | None, indent: int = 2) -> None:
    """Print ``report`` as JSON, and write the same text to ``out`` when one is given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:
        out.write_text(text + "\n")
