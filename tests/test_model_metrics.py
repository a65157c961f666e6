"""Every answer names the model and variant that gave it, in the metrics (``model`` and ``variant``
labels), ``/stats``' ``models``, the request's span and its log line; a request that picked no
model is counted under empty labels and in no model's row.

One server (two workers: the counts are sums over both) serves model ``loop`` (a bigram trained on
``xyz``, the default) with a canary ``v2`` (trained on ``xzy``) and model ``other`` (the packaged
bigram); ``X-Model-Variant`` pins put exact numbers of requests on each variant. The engine fails
every choice before its 20th token (``fail_at=20``), so one long request is ``loop/v2``'s error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from model.bigram.model import default_model_dir
from model.bigram.train import train_bigram, write_model
from telemetry.quantiles import histogram_quantile
from tests.loglines import request_line
from tests.modelfiles import version
from tests.server import GunicornServer, wait_until
from tests.sse import EventReader, sse_json

MODELS_TOML = """
default = "loop"

[models.loop]
source = "xyz"

[models.loop.variants.v2]
source = "xzy"
weight = 40

[models.other]
source = "bigram"
"""
FAIL_AT = 20  # the engine raises before every choice's 20th token: 19 tokens, then the error
GREEDY = {"prompt": "x", "temperature": 0}
PIN = "X-Model-Variant"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model-metrics")
    for text in ("xyz", "xzy"):
        write_model(root / text, train_bigram([text.encode() * 200]), {"trained_on": [text]})
    (root / "models.toml").write_text(MODELS_TOML)
    return root


@pytest.fixture(scope="module")
def server(models_dir, collector, serve_module) -> GunicornServer:
    srv = serve_module(
        workers=2,
        MODELS_FILE=str(models_dir / "models.toml"),
        GREENSERVE_FAULTS=f"fail_at={FAIL_AT}",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
    )
    srv.wait_workers(2)
    return srv


@pytest.fixture(scope="module")
def traffic(server: GunicornServer) -> Iterator[dict[str, tuple]]:
    """Send the module's requests once; return each one's ``(status, headers, body)`` by id."""
    sent: dict[str, tuple] = {}

    def send(rid: str, path: str, body, pin: str | None = None) -> None:
        headers = {"X-Request-Id": rid} | ({PIN: pin} if pin else {})
        sent[rid] = server.post(path, body, headers=headers)

    loop = {"model": "loop", **GREEDY}
    for n in range(3):
        send(f"primary-{n}", "/v1/completions", loop | {"max_tokens": 5}, "primary")
    # A name the file does not know: the default model, and no client key: its primary.
    send("unknown-name", "/v1/completions", {"model": "gpt-4o", **GREEDY, "max_tokens": 5})
    send("v2-json", "/v1/completions", loop | {"max_tokens": 4}, "v2")
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    send("v2-stream", "/v1/completions", loop | {"max_tokens": 4} | stream, "v2")
    send("v2-fails", "/v1/completions", loop | {"max_tokens": 2 * FAIL_AT}, "v2")
    chat = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    send("other-chat", "/v1/chat/completions", chat)
    send("other-invalid", "/v1/completions", {"model": "other", "prompt": ""})  # picked, then 400
    # Refused before a model was picked: an unreadable body, a pin the model does not have.
    send("no-model-body", "/v1/completions", b"{not json")
    send("no-model-pin", "/v1/completions", loop | {"max_tokens": 1}, "v3")

    def counted() -> bool:
        status, _, body = server.get("/stats")
        return status == 200 and json.loads(body)["totals"]["requests"] == len(sent)

    # Each worker counts a request a loop turn after its last byte.
    wait_until(counted, 10, "every request counted")
    yield sent


def metric_lines(server: GunicornServer, name: str) -> set[str]:
    """The ``/metrics`` lines (health port) of the series ``name`` (a sample's full name)."""
    _, _, body = server.get("/metrics", port=server.health_port)
    return {line for line in body.decode().splitlines() if line.startswith(name + "{")}


def test_every_answer_names_its_variant(server, traffic, models_dir):
    xyz, xzy = version(models_dir / "xyz"), version(models_dir / "xzy")
    assert {rid: answer[0] for rid, answer in traffic.items()} == {
        "primary-0": 200,
        "primary-1": 200,
        "primary-2": 200,
        "unknown-name": 200,
        "v2-json": 200,
        "v2-stream": 200,
        "v2-fails": 500,
        "other-chat": 200,
        "other-invalid": 400,
        "no-model-body": 400,
        "no-model-pin": 400,
    }
    versions = {rid: headers["x-model-version"] for rid, (_, headers, _) in traffic.items()}
    assert versions["unknown-name"] == versions["primary-0"] == xyz
    assert versions["v2-json"] == versions["v2-stream"] == versions["v2-fails"] == xzy
    other = version(default_model_dir())
    assert versions["other-chat"] == versions["other-invalid"] == other
    assert json.loads(traffic["other-chat"][2])["system_fingerprint"] == versions["other-chat"]
    assert [c["text"] for c in json.loads(traffic["v2-json"][2])["choices"]] == ["zyxz"]
    assert sse_json(traffic["v2-stream"][2])[-1]["usage"]["completion_tokens"] == 4
    # Picked none: the default model's version, as every answer carries one.
    assert versions["no-model-body"] == versions["no-model-pin"] == xyz


def test_metrics_are_labelled_by_model_and_variant(server, traffic):
    failed = request_line(server, "v2-fails")["completion_tokens"]
    assert failed == FAIL_AT - 1
    chat = json.loads(traffic["other-chat"][2])["usage"]["completion_tokens"]
    assert chat == 3
    c, f, p = "/v1/completions", "/v1/chat/completions", "primary"
    expected = [
        ("finished", c, "length", "loop", "200", p, 4),
        ("finished", c, "length", "loop", "200", "v2", 2),
        ("engine_error", c, "error", "loop", "500", "v2", 1),
        ("finished", f, "length", "other", "200", p, 1),
        ("none", c, "none", "other", "400", p, 1),
        ("none", c, "none", "", "400", "", 2),  # picked no model: empty labels
    ]
    labels = ("end_reason", "endpoint", "finish_reason", "model", "status", "variant")
    assert metric_lines(server, "greenserve_requests_total") == {
        "greenserve_requests_total{"
        + ",".join(f'{k}="{v}"' for k, v in zip(labels, row[:-1], strict=True))
        + f"}} {float(row[-1])}"
        for row in expected
    }
    assert metric_lines(server, "greenserve_generation_tokens_total") == {
        f'greenserve_generation_tokens_total{{model="loop",variant="primary"}} {4 * 5.0}',
        f'greenserve_generation_tokens_total{{model="loop",variant="v2"}} {4 + 4 + failed:.1f}',
        f'greenserve_generation_tokens_total{{model="other",variant="primary"}} {chat:.1f}',
    }
    ttft = "greenserve_time_to_first_token_seconds"
    assert metric_lines(server, ttft + "_count") == {
        f'{ttft}_count{{model="loop",variant="primary"}} 4.0',
        f'{ttft}_count{{model="loop",variant="v2"}} 3.0',
        f'{ttft}_count{{model="other",variant="primary"}} 1.0',
    }
    # The per-job rules' sums still see every request, and the TTFT objective's bucket is there.
    buckets = metric_lines(server, ttft + "_bucket")
    assert len(buckets) == 3 * 15  # 14 bounds and +Inf, per model and variant
    assert f'{ttft}_bucket{{le="1.0",model="loop",variant="v2"}} 3.0' in buckets


def test_stats_has_each_models_traffic_ttft_and_errors(server, traffic):
    failed = request_line(server, "v2-fails")["completion_tokens"]
    stats = json.loads(server.get("/stats")[2])
    assert (stats["totals"]["requests"], stats["totals"]["failed"]) == (11, 1)
    rows = {
        model: {
            v: {k: r[k] for k in ("requests", "errors", "generation_tokens")} for v, r in m.items()
        }
        for model, m in stats["models"].items()
    }
    assert rows == {  # the two requests that picked no model are in the totals only
        "loop": {
            "primary": {"requests": 4, "errors": 0, "generation_tokens": 20},
            "v2": {"requests": 3, "errors": 1, "generation_tokens": 8 + failed},
        },
        "other": {"primary": {"requests": 2, "errors": 0, "generation_tokens": 3}},
    }
    assert list(stats["models"]["loop"]) == ["primary", "v2"]  # the primary first
    # TTFT: the count, the mean and the bucket quantiles of the same histogram /metrics shows.
    ttft = "greenserve_time_to_first_token_seconds"
    _, _, body = server.get("/metrics", port=server.health_port)
    text = body.decode()
    for model, variant, count in (
        ("loop", "primary", 4),
        ("loop", "v2", 3),
        ("other", "primary", 1),
    ):
        series = f'model="{model}",variant="{variant}"'
        got = stats["models"][model][variant]["ttft"]
        total = float(re.search(rf"^{ttft}_sum{{{series}}} (\S+)$", text, re.M)[1])
        buckets = [
            (math.inf if le == "+Inf" else float(le), float(n))
            for le, n in re.findall(rf'^{ttft}_bucket{{le="([^"]+)",{series}}} (\S+)$', text, re.M)
        ]
        assert got == {
            "count": count,
            "mean": pytest.approx(total / count, rel=1e-12),
            "p50": histogram_quantile(0.5, buckets),
            "p90": histogram_quantile(0.9, buckets),
        }
        assert 0 < got["p50"] <= got["p90"]


def test_the_span_names_the_served_model_and_variant(server, traffic, collector, models_dir):
    for rid, model, variant, model_dir in (
        ("unknown-name", "loop", "primary", "xyz"),
        ("v2-stream", "loop", "v2", "xzy"),
        ("v2-fails", "loop", "v2", "xzy"),
    ):
        attrs = collector.span_for(rid)["attrs"]
        named = ("gen_ai.request.model", "gen_ai.response.", "greenserve.model.")
        assert {k: attrs[k] for k in attrs if k.startswith(named)} == {
            "gen_ai.request.model": {"stringValue": "gpt-4o" if rid == "unknown-name" else "loop"},
            "gen_ai.response.model": {"stringValue": model},
            # The failed choice never finished.
            "gen_ai.response.finish_reasons": {
                "stringValue": "none" if rid == "v2-fails" else "length"
            },
            "greenserve.model.variant": {"stringValue": variant},
            "greenserve.model.version": {"stringValue": version(models_dir / model_dir)},
        }
    attrs = collector.span_for("no-model-pin")["attrs"]
    assert not [k for k in attrs if k.startswith(("gen_ai.response", "greenserve.model"))]


def test_the_log_line_names_the_served_model_and_variant(server, traffic, models_dir):
    line = request_line(server, "unknown-name")
    assert (line["model"], line["served_model"], line["variant"], line["model_version"]) == (
        "gpt-4o",  # the client's string, echoed as the answer does
        "loop",
        "primary",
        version(models_dir / "xyz"),
    )
    line = request_line(server, "v2-fails")
    assert (line["served_model"], line["variant"], line["status"]) == ("loop", "v2", 500)
    line = request_line(server, "no-model-pin")
    assert (line["served_model"], line["variant"], line["status"]) == (None, None, 400)
    assert "model_version" not in line


def test_the_load_gauges_are_per_model_and_variant(models_dir, serve):
    # A server of its own: a slow engine and no failing step, so that a stream holds its slot.
    srv = serve(MODELS_FILE=str(models_dir / "models.toml"), GREENSERVE_FAULTS="slow_step_s=0.02")
    series = [("loop", "primary"), ("loop", "v2"), ("other", "primary")]

    def lines(name: str, held: tuple[str, str] | None) -> set[str]:
        return {
            f'{name}{{model="{m}",variant="{v}"}} {1.0 if (m, v) == held else 0.0}'
            for m, v in series
        }

    running, queued = "greenserve_requests_running", "greenserve_requests_queued"
    # Every model's series, at 0, from the worker's start.
    assert metric_lines(srv, running) == lines(running, None)
    assert metric_lines(srv, queued) == lines(queued, None)
    body = {"model": "loop", "prompt": "x", "max_tokens": 3000, "stream": True}
    reader = EventReader(srv.port, body, headers={PIN: "v2"})
    reader.open()
    try:
        assert reader.next_frame() == b": ok\n"
        wait_until(lambda: metric_lines(srv, running) == lines(running, ("loop", "v2")), 10)
        assert metric_lines(srv, queued) == lines(queued, None)
        stats = json.loads(srv.get("/stats")[2])
        assert stats["load"] == {"running": 1, "queued": 0}
        assert {
            (m, v): (row["running"], row["queued"])
            for m, rows in stats["models"].items()
            for v, row in rows.items()
        } == {("loop", "primary"): (0, 0), ("loop", "v2"): (1, 0), ("other", "primary"): (0, 0)}
    finally:
        reader.close()
    wait_until(lambda: metric_lines(srv, running) == lines(running, None), 10)
