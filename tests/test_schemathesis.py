"""schemathesis against a live server, from its own ``/openapi.json``: no 5xx, no contract violation.

The CLI runs in a subprocess (its own event loop and Hypothesis state, as in CI) with a fixed seed and a
bounded number of examples per operation, over every phase (coverage, fuzzing, stateful). Checked: every
check schemathesis has (server errors, status codes, content types, headers, response and SSE event
schemas, negative data rejected, 405 with ``Allow`` for undocumented methods, …) except
``positive_data_acceptance``, which expects every schema-valid request to be accepted, and so flags
two things the document cannot say in JSON Schema: integers must be written as integers (JSON Schema
counts ``75.0`` as an integer; the server refuses it with a 400 naming the field, as for every integer),
and schemathesis 4.32 labels a case positive while its ``Last-Event-ID`` header is a negative value.

``POST /debug/drain`` is left out: it turns readiness off for the rest of the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

MAX_EXAMPLES = 100  # per operation and phase; the run makes well over 500 requests
SEED = 20260429


def _interactions(ndjson: Path) -> Counter:
    """Count the responses of a run by status code (None: no response, e.g. a timeout)."""
    statuses: Counter = Counter()
    for line in ndjson.read_text().splitlines():
        ((kind, event),) = json.loads(line).items()
        if kind != "ScenarioFinished":
            continue
        for interaction in event["recorder"].get("interactions", {}).values():
            statuses[(interaction.get("response") or {}).get("status_code")] += 1
    return statuses


def schemathesis_cmd(url: str, reports: Path) -> list[str]:
    """The schemathesis CLI run against ``url``'s OpenAPI document, its reports written to ``reports``."""
    return [
        sys.executable,
        "-c",
        "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "run",
        f"{url}/openapi.json",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance",
        f"--max-examples={MAX_EXAMPLES}",
        f"--seed={SEED}",
        # One worker thread: CPython 3.11.7 can raise a spurious "AST constructor recursion depth
        # mismatch" SystemError when hypothesis parses source in several threads (cpython#106905).
        "--workers=1",
        "--exclude-path=/debug/drain",
        # EventSource's header; the JSON endpoints ignore Accept.
        "--header=Accept: text/event-stream",
        "--request-timeout=30",
        "--report=json,ndjson",
        f"--report-dir={reports}",
        "--no-color",
    ]


def test_schemathesis_finds_no_server_error_and_no_violation(tmp_path, serve):
    reports = tmp_path / "reports"
    srv = serve(workers=2, health_port=False)
    run = subprocess.run(
        schemathesis_cmd(srv.url, reports),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    srv.stop()  # its log is complete before the checks below
    output = run.stdout[-8000:] + run.stderr[-4000:]
    (summary,) = reports.glob("*.json")
    (events,) = reports.glob("*.ndjson")
    report = json.loads(summary.read_text())
    statuses = _interactions(events)
    print(f"schemathesis: {report['test_cases']}, responses by status: {dict(statuses)}")
    assert run.returncode == 0, output
    assert report["failures"] == [] and report["errors"] == [], output
    assert report["test_cases"]["generated"] >= 500
    assert sum(statuses.values()) >= 500
    assert not [s for s in statuses if s is None or s >= 500], statuses
    assert "Traceback" not in srv.log_text()
