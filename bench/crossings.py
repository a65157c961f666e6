"""Count the files a streamed token crosses and the ``wsgi_app`` modules one request crosses.

Starts greenserve (one gevent worker, the bigram) under a gunicorn config that chains the project's
and turns on ``sys.setprofile`` in the worker once it is ready, counting Python function calls per
source file; the worker writes the counts when it exits. Two runs that differ only in one request
(or in the number of tokens of one stream) give, by difference, what that request (or each token)
costs in calls, file by file.

- A token: one stream of ``--tokens`` tokens, then one of twice as many; a file whose calls grew by
  one or more per extra token (0.9, for the noise of the idle loop) is on every token's path, and so
  is every file on the stack of a token's socket write.
- A request: a warm-up request, then the same request once more; every ``wsgi_app`` module whose
  calls grew is one the request crossed (the streamed chat request by default).

Run: ``python -m bench.crossings`` (prints JSON; ``--out`` writes it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench.harness import print_json

ROOT = Path(__file__).resolve().parent.parent

CONFIG = textwrap.dedent(
    """
    import collections, json, os, sys
    from wsgi_app.gunicorn_config import *  # noqa: F403
    import wsgi_app.gunicorn_config as _base

    _calls = collections.Counter()
    _stacks = collections.Counter()

    def _count(frame, event, arg):
        if event == "call":
            code = frame.f_code
            _calls[code.co_filename] += 1
            if code.co_name == "sendall" and code.co_filename.endswith("stream_socket.py"):
                files, f = [], frame
                while f is not None:
                    if f.f_code.co_filename not in files:
                        files.append(f.f_code.co_filename)
                    f = f.f_back
                _stacks[tuple(files)] += 1

    def post_worker_init(worker):
        _base.post_worker_init(worker)
        sys.setprofile(_count)

    def worker_exit(server, worker):
        sys.setprofile(None)
        with open(os.environ["CROSSINGS_OUT"], "w") as f:
            json.dump({"calls": dict(_calls), "send_stacks": [[list(k), n] for k, n in _stacks.items()]}, f)
        _base.worker_exit(server, worker)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    data = conn.getresponse().read()
    conn.close()
    return data


def calls_after(requests: list[tuple[str, dict]], workdir: Path) -> dict:
    """Start a server, send ``requests`` one after the other, stop it; return its calls per file
    (``calls``) and the files on the stack of each socket write (``send_stacks``: files, count)."""
    config = workdir / "crossings_conf.py"
    config.write_text(CONFIG)
    out = workdir / "calls.json"
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{workdir}",
        "WEB_CONCURRENCY": "1",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "HEALTH_PORT": str(_free_port()),
        "CROSSINGS_OUT": str(out),
        "LOG_LEVEL": "warning",
    }
    argv = [sys.executable, "-m", "gunicorn", "-c", str(config), "--no-control-socket"]
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((workdir / "server.log").read_text()[-3000:])
            time.sleep(0.2)
        for path, body in requests:
            _post(port, path, body)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
    return json.loads(out.read_text())


def _short(path: str) -> str:
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        parts = p.parts
        return (
            "/".join(parts[parts.index("site-packages") + 1 :])
            if "site-packages" in parts
            else path
        )


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls per file added between two runs (files whose count grew)."""
    out = {}
    for path, n in after.items():
        extra = n - before.get(path, 0)
        if extra > 0:
            out[_short(path)] = extra
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def completion(tokens: int) -> tuple[str, dict]:
    """A streamed completion of exactly ``tokens`` tokens."""
    body = {"model": "m", "prompt": "ROMEO:", "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "seed": 1}  # fmt: skip
    return "/v1/completions", body


def chat() -> tuple[str, dict]:
    """A streamed chat completion of 16 tokens."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
            "stream": True, "seed": 1}  # fmt: skip
    return "/v1/chat/completions", body


def main() -> None:
    """Measure and print both counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        n = args.tokens
        one = calls_after([completion(8), completion(n)], work)
        two = calls_after([completion(8), completion(2 * n)], work)
        per_token = {
            f: round(k / n, 2) for f, k in grown(one["calls"], two["calls"]).items() if k >= 0.9 * n
        }
        # The files on the stack when a token's event is written (the most frequent write stack).
        stack = [_short(f) for f in max(two["send_stacks"], key=lambda s: s[1])[0]]
        warm = calls_after([chat()], work)
        again = calls_after([chat(), chat()], work)
        request = {
            f: k
            for f, k in grown(warm["calls"], again["calls"]).items()
            if f.startswith("wsgi_app/")
        }
    crossed = sorted(set(per_token) | set(stack))
    report = {
        "token_files": len(crossed),
        "token_files_list": crossed,
        "token_calls_per_file": per_token,
        "token_send_stack": stack,
        "chat_stream_wsgi_app_modules": len(request),
        "chat_stream_calls_per_module": request,
    }
    print_json(report, args.out)


if __name__ == "__main__":
    main()
