"""The README's quick start: its first two commands are the ones a newcomer needs (run: installs what
running needs, not the test tools; test: installs the test extra itself), and CI runs exactly the test
command the README gives."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from tests.readme import blocks

ROOT = Path(__file__).resolve().parent.parent


def shell_blocks() -> list[str]:
    return [block.strip() for block in blocks("sh")]


def test_the_first_command_installs_only_what_running_needs_and_starts_the_server():
    run = shell_blocks()[0]
    assert run == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . "
        "&& gunicorn -c gunicorn.conf.py"
    )


def test_the_second_command_installs_the_test_extra_and_runs_the_suite():
    test = shell_blocks()[1]
    assert test == ". .venv/bin/activate && pip install -q -e '.[test]' && python -m pytest -q"


def test_ci_runs_exactly_the_readme_test_command_last():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert lines[-1] == shell_blocks()[1]


def test_the_readme_says_the_default_listens_on_every_interface_and_how_to_stay_on_loopback():
    text = (ROOT / "README.md").read_text()
    top = text[: text.index("## Contents")]
    assert "**every interface** (`HOST=0.0.0.0`)" in top
    assert "HOST=127.0.0.1 gunicorn -c gunicorn.conf.py" in top


def test_the_quick_start_chat_runs_as_written(default_server):
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    top = text[: text.index("## Contents")]
    (code,) = re.findall(r"```python\n(.*?)```", top, re.S)
    run = subprocess.run(
        [sys.executable, "-c", code.replace("http://localhost:8000", default_server.url)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",  # any name: the bigram answers as itself
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    request = urllib.request.Request(
        default_server.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        content = json.load(answer)["choices"][0]["message"]["content"]
    assert run.stdout == content + "\n"
