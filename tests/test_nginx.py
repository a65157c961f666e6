"""greenserve behind the real nginx, running the example site ``deploy/nginx/greenserve.conf``.

Events pass through one at a time while the model is still generating; gzip (on globally, as in Debian's
nginx.conf, and here for every type) stays off for them; the client's address reaches the rate limiter
through ``X-Forwarded-For`` with ``TRUSTED_PROXIES=1``; a client that hangs up on nginx stops generation.
The server's own view (``/debug/state``) is read on the gunicorn port: it refuses forwarded requests.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.collector import FakeCollector
from tests.server import ROOT, GunicornServer, wait_until
from tests.services import NGINX_SITE, NginxServer
from tests.sse import EventReader

STEP_S = 0.2  # GREENSERVE_FAULTS slow step: each token takes at least this long


@pytest.fixture(scope="module")
def stack(
    succ_dir, collector, serve_module, tmp_path_factory
) -> Iterator[tuple[NginxServer, GunicornServer, FakeCollector]]:
    """nginx -> gunicorn (1 worker, slow steps, 3 requests/minute per client) -> a span collector."""
    srv = serve_module(
        MODEL_DIR=str(succ_dir),
        GREENSERVE_FAULTS=f"slow_step_s={STEP_S}",
        TRUSTED_PROXIES="1",
        RATE_LIMIT="3/minute",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
    )
    # NginxServer skips (or fails under CI) without nginx: the upstream stops then too.
    with NginxServer(tmp_path_factory.mktemp("nginx"), srv.port) as nginx:
        yield nginx, srv, collector


@pytest.mark.services
def test_each_event_arrives_before_the_next_token(stack):
    nginx, srv, _ = stack
    reader = EventReader(
        nginx.port,
        {"model": "m", "prompt": "a", "max_tokens": 6, "temperature": 0, "stream": True},
        headers={"X-Request-Id": "via-nginx", "Accept-Encoding": "gzip"},
    )
    resp = reader.open()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("Content-Encoding") is None  # gzip would hold events back
    assert reader.next_frame() == b": ok\n"
    texts, arrivals = [], []
    for i in range(1, 7):
        frame = reader.next_frame()
        arrivals.append(time.monotonic())
        assert frame.startswith(b"data: {"), frame
        texts.append(json.loads(frame[len(b"data: ") :])["choices"][0]["text"])
        if i < 6:
            # The server is at most one token ahead of what the client has: nothing is buffered.
            entry = srv.in_flight("via-nginx")
            assert entry is not None and entry["tokens"] <= i + 1, (i, entry)
    assert reader.next_frame() == b"data: [DONE]\n"
    assert reader.next_frame() == b""
    reader.close()
    assert "".join(texts) == "bcdefg"
    # Spread over the generation (5 steps of >= 0.2 s between the first and last token), not
    # delivered together at the end.
    assert arrivals[-1] - arrivals[0] >= 2.5 * STEP_S


@pytest.mark.services
def test_client_address_reaches_the_limiter(stack):
    nginx, _, _ = stack
    body = json.dumps({"model": "m", "prompt": "a", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}

    def post(source: str, xff: str | None = None) -> tuple[int, str | None]:
        h = {**headers, **({"X-Forwarded-For": xff} if xff else {})}
        status, resp_headers, _ = nginx.request("POST", "/v1/completions", body, h, source=source)
        return status, resp_headers.get("x-ratelimit-remaining")

    # 127.0.0.2 spends its 3 requests; a forged X-Forwarded-For does not give it a fresh bucket
    # (nginx appends the real peer, and only that last entry is trusted).
    assert [post("127.0.0.2") for _ in range(2)] == [(200, "2"), (200, "1")]
    assert post("127.0.0.2", xff="127.0.0.4") == (200, "0")
    assert post("127.0.0.2", xff="127.0.0.5")[0] == 429
    # Another client behind the same proxy has its own bucket: the proxy's address is not the key.
    assert post("127.0.0.3") == (200, "2")


@pytest.mark.services
def test_disconnect_at_nginx_stops_generation(stack):
    nginx, srv, collector = stack
    reader = EventReader(
        nginx.port,
        {"model": "m", "prompt": "a", "max_tokens": 2000, "stream": True},
        headers={"X-Request-Id": "nginx-hangup"},
    )
    assert reader.open().status == 200
    assert reader.next_frame() == b": ok\n"
    for _ in range(3):
        assert reader.next_frame().startswith(b"data: {")
    assert srv.in_flight("nginx-hangup") is not None
    reader.close()
    wait_until(lambda: srv.in_flight("nginx-hangup") is None, what="generation to stop")

    attrs = collector.span_for("nginx-hangup")["attrs"]
    generated = int(attrs["gen_ai.usage.output_tokens"]["intValue"])
    # Stopped within a couple of tokens of the hang-up, nowhere near max_tokens.
    assert 3 <= generated <= 6, generated
    status, _, _ = srv.get("/debug/state")
    assert status == 200


@pytest.mark.services
def test_debug_endpoints_are_not_reachable_through_nginx(stack):
    nginx, _, _ = stack
    status, _, body = nginx.request("GET", "/debug/state")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def _seconds(value: str) -> int:
    match = re.fullmatch(r"(\d+)s?", value)
    assert match, value
    return int(match.group(1))


def test_example_site_has_the_streaming_directives():
    site = NGINX_SITE.read_text()
    directives = {
        line.split("#")[0].strip() for line in site.splitlines() if line.split("#")[0].strip()
    }
    for required in (
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_buffering off;",
        "gzip off;",
    ):
        assert required in directives, required
    read_timeout = re.search(r"proxy_read_timeout (\S+);", site).group(1)
    # Above the SSE heartbeat (HEARTBEAT_S, 15 s) and the request deadline (REQUEST_TIMEOUT_S, 60 s).
    assert _seconds(read_timeout) > 60
    keepalive = re.search(r"keepalive_timeout (\S+);", site).group(1)
    assert _seconds(keepalive) < 5  # below gunicorn's KEEPALIVE_S


def test_readme_shows_the_tested_configuration():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Deploying behind nginx", 1)[1].split("\n## ", 1)[0]
    block = section.split("```nginx", 1)[1].split("```", 1)[0]
    site_lines = {ln.strip() for ln in Path(NGINX_SITE).read_text().splitlines()}
    shown = [ln.strip() for ln in block.splitlines() if ln.strip() and ln.strip() != "..."]
    assert len(shown) >= 10
    for line in shown:
        assert line in site_lines, (
            f"README shows {line!r}, which deploy/nginx/greenserve.conf lacks"
        )
