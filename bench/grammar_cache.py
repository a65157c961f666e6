"""What one compiled grammar keeps resident: RSS per cache entry against its text's bytes.

llguidance's ``LLMatcher`` reports no size, so ``model.grammar.compile`` charges each cache entry a
proxy (``GrammarCompiler.entry_bytes``: a fixed cost plus a factor times the bytes of llguidance's
grammar text); this measures what the proxy stands for. In this process, with the served
tokenizer's bridge built first: for each kind and size, ``--variants`` distinct constraints (each
string or name carries the variant's number, so none shares a compiled grammar) are compiled as the
server compiles them (``GrammarCompiler.result``: grammar, template matcher, satisfiability check)
and kept; the RSS growth divided by their number is the entry's cost, ``malloc_trim`` first at
each reading. Then each entry's matcher walks ``--walk`` random allowed tokens (its lexer states
are built lazily and kept with the template), and the growth again. Reports per case the text bytes
(the constraint's canonical JSON and llguidance's grammar text), the RSS per entry after compiling
and after the walk, and what the cache charges them (the proxy).

    python -m bench.grammar_cache [--model smollm2|bigram] [--variants 8] [--walk 64]

Writes ``bench/results/<UTC time>-grammar-cache-<model>.json`` and ``.md`` with the CPU and the
load average. With ``--server``, a worker instead: one SmolLM2 greenserve of ``--checkout``
(``bench.servers``) answers ``--requests`` requests, each with a choice list of its own (1,024
random strings of 56 letters: 60 kB), ``max_tokens`` 8; the worker's RSS is read 1 s after every
fifth (at rest), and its growth per request reported
(``bench/results/<UTC time>-grammar-cache-server[-LABEL].json``).
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import random
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import procstat, servers
from bench.grammar_cost import cpu_model, run_header
from bench.harness import RESULTS, print_json, utc_stamp, write_pair
from model.fetch import fetch
from model.grammar.compile import Constraint, GrammarCompiler, grammar_text
from model.loader import load_model
from model.tokenizer import ByteTokenizer

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def case(kind: str, size: int, v: int) -> Constraint:
    """Return variant ``v`` of the constraint of ``kind`` and ``size``."""
    rng = random.Random(size * 1000 + v)
    if kind == "choice":  # size strings of ~60 bytes
        return Constraint("choice", tuple(f"{v}-{i} {_phrase(rng, 8)}"[:60] for i in range(size)))
    if kind == "schema":  # an object of size properties of mixed types
        types = ({"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "boolean"})
        props = {f"p{v}_{i}_{rng.choice(WORDS)}": types[i % 3] for i in range(size)}
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        return Constraint("json_schema", {**schema, "required": list(props)[:8]})
    if kind == "enum":  # one property whose value is one of size strings
        values = [f"{v}-{i} {_phrase(rng, 3)}" for i in range(size)]
        schema = {"type": "object", "properties": {"c": {"enum": values}}, "required": ["c"]}
        return Constraint("json_schema", {**schema, "additionalProperties": False})
    if kind == "regex":  # y{size}, the variant's letter first: a forced run
        return Constraint("regex", f"{chr(97 + v % 26)}{v}y{{{size}}}")
    if kind == "class":  # [a-z]{1,size}: as long, not forced
        return Constraint("regex", f"{chr(97 + v % 26)}{v}[a-z]{{1,{size}}}")
    raise ValueError(kind)


CASES = [
    ("choice", 16),
    ("choice", 128),
    ("choice", 1024),
    ("schema", 4),
    ("schema", 40),
    ("schema", 400),
    ("enum", 100),
    ("enum", 2000),
    ("regex", 600),
    ("regex", 6000),
    ("class", 3000),
]


def rss_bytes() -> int:
    """Return this process's resident set size, after giving freed heap back (glibc)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def walk(grammar: Any, steps: int, rng: random.Random) -> None:
    """Feed ``grammar``'s matcher up to ``steps`` random allowed tokens."""
    m = grammar.matcher()
    for _ in range(steps):
        try:
            ids = np.flatnonzero(m.allowed())
            if m.consume(int(rng.choice(ids))):
                return
        except ValueError:  # ConstraintError: the walk found an end it cannot pass
            return


def main() -> None:
    """Measure and write the result files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "bigram"), default="smollm2")
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--walk", type=int, default=64)
    parser.add_argument("--server", action="store_true", help="a worker's RSS over requests")
    parser.add_argument("--checkout", default=str(servers.ROOT), help="the code the server runs")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--label", default="", help="added to the result file's name")
    args = parser.parse_args()
    if args.server:
        serve(Path(args.checkout).resolve(), args.requests, args.label)
        return
    started, load_start = utc_stamp(), os.getloadavg()
    if args.model == "smollm2":
        tokenizer = load_model(fetch("smollm2")).tokenizer
    else:
        tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer, cache_bytes=1 << 40)  # keeps every entry measured
    compiler.lltokenizer  # noqa: B018 - the bridge, built before any reading
    compiler.result(case("schema", 4, 999))  # first-use allocations, outside every case
    rows = []
    for kind, size in CASES:
        constraints = [case(kind, size, v) for v in range(args.variants)]
        texts = [len(grammar_text(c).encode()) for c in constraints]
        keys = [len(c.key().encode()) for c in constraints]
        before, charged = rss_bytes(), compiler.cache.bytes
        kept = [compiler.result(c) for c in constraints]
        compiled, charged = rss_bytes(), compiler.cache.bytes - charged
        rng = random.Random(7)
        for g in kept:
            if hasattr(g, "matcher"):
                walk(g, args.walk, rng)
        walked = rss_bytes()
        row = {
            "kind": kind,
            "size": size,
            "refused": sum(not hasattr(g, "matcher") for g in kept),
            "key_bytes": int(np.mean(keys)),
            "text_bytes": int(np.mean(texts)),
            "rss_per_entry_kib": round((compiled - before) / len(kept) / 1024, 1),
            "rss_per_entry_walked_kib": round((walked - before) / len(kept) / 1024, 1),
            "proxy_kib": round(charged / len(kept) / 1024, 1),
        }
        rows.append(row)
        print(row, flush=True)
        del kept  # (the compiler's cache keeps them: each case's growth is its own)
    result = {
        "bench": "grammar-cache",
        "started": started,
        "model": args.model,
        "cpu": cpu_model(),
        "variants": args.variants,
        "walk": args.walk,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    write_pair(RESULTS / f"{started}-grammar-cache-{args.model}.json", result, markdown(result))
    print(markdown(result))


def serve(checkout: Path, requests: int, label: str) -> None:
    """Measure a SmolLM2 worker's RSS over ``requests`` distinct 60 kB choice lists."""
    _, client = servers.cores()
    os.sched_setaffinity(0, client)
    started, load_start = utc_stamp(), os.getloadavg()
    env = {"MODEL_DIR": str(fetch("smollm2")), "REQUEST_TIMEOUT_S": "600"}
    logdir = Path(tempfile.mkdtemp(prefix="greenserve-grammar-cache-"))
    srv = servers.start("greenserve", logdir, env, ready_s=300, root=checkout)
    rng = random.Random(1)

    def post(body: dict) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return resp.status

    def rss_mib() -> float:
        time.sleep(1.0)  # at rest: the worker gives its freed heap back when idle
        return procstat.rss_bytes(srv.serving_pids()) / 2**20

    readings = []
    try:
        body = {"model": "m", "prompt": "Pick one", "max_tokens": 8}
        post({**body, "structured_outputs": {"regex": "[a-z]+"}})  # the tokenizer bridge
        base = rss_mib()
        for i in range(1, requests + 1):
            letters = string.ascii_lowercase
            choices = ["".join(rng.choice(letters) for _ in range(56)) for _ in range(1024)]
            assert post({**body, "structured_outputs": {"choice": choices}}) == 200
            if i % 5 == 0:
                readings.append({"requests": i, "rss_mib": round(rss_mib(), 1)})
                print(readings[-1], flush=True)
    finally:
        srv.stop()
    grown = readings[-1]["rss_mib"] - base
    report = {
        **run_header("grammar-cache-server", started, label, checkout, load_start),
        "base_rss_mib": round(base, 1),
        "readings": readings,
        "mib_per_request": round(grown / requests, 3),
        "most_mib_above_base": round(max(r["rss_mib"] for r in readings) - base, 1),
    }
    suffix = f"-{label}" if label else ""
    print_json(report, RESULTS / f"{started}-grammar-cache-server{suffix}.json")


def markdown(r: dict[str, Any]) -> str:
    """Return the results as a Markdown table."""
    lines = [
        f"# RSS per compiled grammar, {r['model']} ({r['started']})",
        "",
        f"CPU {r['cpu']}; {r['variants']} distinct constraints a case, kept; then each matcher "
        f"walked {r['walk']} random allowed tokens. Load average {r['loadavg_start']} at the "
        f"start, {r['loadavg_end']} at the end.",
        "",
        "| kind | size | key bytes | grammar text bytes | RSS / entry (KiB) | after the walk | "
        "charged (KiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['kind']} | {x['size']} | {x['key_bytes']} | {x['text_bytes']} | "
            f"{x['rss_per_entry_kib']} | {x['rss_per_entry_walked_kib']} | {x['proxy_kib']} |"
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()
