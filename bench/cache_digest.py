"""What checking the GGUF weights cache's digest costs a master at start .

Times, in fresh processes pinned to one CPU set: ``load_model`` of the SmolLM2 GGUF with its cache
file already built (the master's start: hash the GGUF, read its header, map and check the cache),
and the digest alone over the mapped tensors (``gguf_cache.tensors_digest``). The check is paid
once per file per process tree; the workers inherit the master's verdict.

Run: ``python -m bench.cache_digest [--cpus 0,1] [--repeat 3]``; writes
``bench/results/<UTC time>-cache-digest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF = Path.home() / ".cache" / "greenserve" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

PROBE = """
import json, sys, time
from pathlib import Path
from model.llama.formats import gguf_cache
from model.loader import load_model
t = time.perf_counter()
m = load_model(sys.argv[1], sys.argv[2])
load_s = time.perf_counter() - t
path = gguf_cache.cache_path(Path(sys.argv[2]), m.checksum)
tensors = gguf_cache._map(path)
t = time.perf_counter()
gguf_cache.tensors_digest(tensors)
digest_s = time.perf_counter() - t
print(json.dumps({"load_model_s": load_s, "digest_s": digest_s, "bytes": path.stat().st_size}))
"""


def main() -> None:
    """Measure and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", default="0,1", help="taskset CPU list")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="greenserve-digest-bench-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["taskset", "-c", args.cpus, sys.executable, "-c", PROBE, str(GGUF), str(cache)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)  # builds the cache file once
    runs = []
    for _ in range(args.repeat):
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    result = {
        "bench": "cache-digest",
        "model": GGUF.name,
        "cpus": args.cpus,
        "loadavg": os.getloadavg(),
        "runs": runs,
        "digest_s_min": min(r["digest_s"] for r in runs),
        "load_model_s_min": min(r["load_model_s"] for r in runs),
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = ROOT / "bench" / "results" / f"{stamp}-cache-digest.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
