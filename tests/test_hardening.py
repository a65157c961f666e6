"""Regressions from the adversarial review: each attack that once hurt the server, now answered well."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from tests.collector import FakeCollector
from tests.server import HUB_MONITOR_ENV, GunicornServer, assert_hub_never_blocked, wait_until


@pytest.fixture(scope="module")
def watched(succ_dir, tmp_path_factory):
    """The succ model under gevent's monitor thread, with a slow-step twin for disconnect tests."""
    with FakeCollector() as collector:
        env = {
            "MODEL_DIR": str(succ_dir),
            **HUB_MONITOR_ENV,
            "REQUEST_TIMEOUT_S": "2",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "MAX_LOGPROB_ENTRIES": str(8 * 32768 * 6),  # the huge echo answer below
        }
        with GunicornServer(tmp_path_factory.mktemp("watched"), env) as srv:
            yield srv, collector
        assert_hub_never_blocked(srv)


def test_huge_echo_logprobs_answer_never_blocks_the_hub(watched):
    srv, _ = watched
    prompt = "ab" * 16384  # 32768 tokens, the MAX_PROMPT_TOKENS default
    status, headers, raw = srv.complete(
        {"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5, "n": 8},
        timeout_s=120,
    )
    assert status == 200
    assert int(headers["content-length"]) == len(raw)  # exact, though written in slices
    doc = json.loads(raw)
    first = doc["choices"][0]["logprobs"]
    assert len(first["tokens"]) == 32768 and first["tokens"][:3] == ["a", "b", "a"]
    assert first["token_logprobs"][0] is None and first["text_offset"][-1] == 32767
    assert all(c["logprobs"] == first for c in doc["choices"])
    assert doc["usage"] == {"prompt_tokens": 32768, "completion_tokens": 0, "total_tokens": 32768}


@pytest.mark.parametrize("key", ["01", "+1", " 1", "1.0", "0" * 5000 + "1", "256"])
def test_logit_bias_key_must_be_a_canonical_token_id(watched, key):
    srv, _ = watched
    status, _, raw = srv.complete({"model": "m", "prompt": "a", "logit_bias": {key: 1}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "logit_bias"


def test_model_name_is_bounded(watched):
    srv, _ = watched
    assert srv.complete({"model": "m" * 256, "prompt": "a", "max_tokens": 1})[0] == 200
    status, _, raw = srv.complete({"model": "m" * 257, "prompt": "a", "max_tokens": 1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "model"


def test_double_slash_is_a_json_404_not_a_redirect(watched):
    srv, _ = watched
    status, headers, raw = srv.request(
        "POST", "/v1//completions", body={"model": "m"}, headers={"Host": "evil.example"}
    )
    assert status == 404 and "location" not in headers
    assert json.loads(raw)["error"]["type"] == "not_found_error"


def test_debug_endpoints_refuse_requests_from_a_page(watched):
    srv, _ = watched
    status, _, _ = srv.post("/debug/drain", b"", headers={"Origin": "https://evil.example"})
    assert status == 404
    assert srv.get("/ready")[0] == 200


def test_slow_body_is_cut_by_the_deadline(watched):
    srv, _ = watched
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 100\r\n\r\n{"
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_plain_request_stops_when_its_client_leaves(succ_dir, serve):
    with FakeCollector() as collector:
        srv = serve(
            MODEL_DIR=str(succ_dir),
            GREENSERVE_FAULTS="slow_step_s=0.02",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        body = json.dumps({"model": "m", "prompt": "a", "max_tokens": 500}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: leaver\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        wait_until(
            lambda: (srv.in_flight("leaver") or {}).get("tokens", 0) >= 5, what="tokens to flow"
        )
        sock.close()
        srv.wait_idle(5)
        span = collector.span_for("leaver")
        assert span["attrs"]["http.response.status_code"] == {"intValue": "499"}
        assert int(span["attrs"]["gen_ai.usage.output_tokens"]["intValue"]) < 100


def test_reload_serves_every_request(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), workers=2)
    statuses: list[int] = []
    reloaded = threading.Event()

    def client():
        # Requests before, during and after the reload, until the new workers have served some.
        while not reloaded.is_set():
            body = {"model": "m", "prompt": "a", "max_tokens": 4, "temperature": 0}
            statuses.append(srv.complete(body)[0])
            time.sleep(0.02)

    def booted() -> int:
        return srv.log_text().count("Booting worker")

    t = threading.Thread(target=client)
    t.start()
    wait_until(lambda: len(statuses) >= 5, what="requests before the reload")
    srv.signal(signal.SIGHUP)  # reload: new workers, old ones stop gracefully
    wait_until(lambda: booted() == 4, 30, lambda: f"two new workers; log:\n{srv.log_tail()}")
    after = len(statuses)
    wait_until(lambda: len(statuses) >= after + 10, what="requests after the reload")
    reloaded.set()
    t.join(60)
    assert statuses == [200] * len(statuses)
