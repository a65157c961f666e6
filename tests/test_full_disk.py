"""A full disk at the first start is one line, and leaves nothing behind.

Building the packed weights cache of a GGUF on a full file system raised safetensors' own error type
(not an ``OSError``), so the master printed a raw ``SafetensorError`` traceback and left its
``greenserve-metrics-*`` directory in the temp dir at every try (a systemd restart loop fills
``/tmp``). The cache directory here is a 64 KiB tmpfs mounted in a private mount namespace
(``unshare``), too small for the tiny model's cache file.

Source: safetensors' ``save_file`` (``Error while serializing: I/O error: ... (os error 28)``).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.gguffiles import write_tiny_gguf
from tests.server import ROOT, GunicornServer


def _can_mount() -> bool:
    try:
        done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs unshare -rm (a private mount namespace)")
def test_full_disk_at_first_start_is_one_line_and_leaves_nothing(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"MODEL_DIR": str(model), "GREENSERVE_CACHE_DIR": str(cache), "TMPDIR": str(tmp)}
    srv = GunicornServer(tmp_path / "run", env)
    mount = 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"'
    for _ in range(2):  # a restart loop: every try is the same line, and leaves nothing
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", mount, str(cache), *srv.cmd],
            cwd=ROOT,
            env=srv.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and "SafetensorError" not in done.stderr
        plain = [line for line in done.stderr.splitlines() if not line.startswith("{")]
        for line in done.stderr.splitlines():
            if line.startswith("{"):
                json.loads(line)
        assert len(plain) == 1, done.stderr
        assert plain[0].startswith(f"greenserve: cannot start: MODEL_DIR ({model}): "), plain
        assert "cannot write the weights cache in" in plain[0]
        assert "No space left on device; the file needs " in plain[0]
        assert plain[0].endswith(
            "(free space there or set GREENSERVE_CACHE_DIR to another directory)"
        )
        assert list(tmp.iterdir()) == []  # no greenserve-metrics-* left behind
