"""JSON logs: one typed line per request, gunicorn's own lines in the same shape, slow-request
timelines, per-step debug lines, and prompts only with ``LOG_PROMPTS=1``."""

from __future__ import annotations

import datetime
import decimal
import json
import logging
import re
from array import array
from types import SimpleNamespace

import pytest
from pythonjsonlogger.json import JsonFormatter as LibraryFormatter

from telemetry.logs import JsonFormatter, StderrHandler, client_hash, held_lines, logging_config
from telemetry.observer import finish_reason, is_failed, summarize
from tests.loglines import log_lines, request_line, wait_for
from tests.sse import sse_events

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SALT = "pepper"
SECRET_PROMPT = "zq-secret-prompt-zq"

# Every field of the request line and its type (None allowed where the value can be absent).
REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "time": (str,),
    "level": (str,),
    "logger": (str,),
    "pid": (int,),
    "message": (str,),
    "request_id": (str,),
    "trace_id": (str,),
    "span_id": (str,),
    "client_hash": (str,),
    "method": (str,),
    "path": (str,),
    "status": (int,),
    "model": (str, type(None)),
    "served_model": (str, type(None)),
    "variant": (str, type(None)),
    "prompt_tokens": (int,),
    "completion_tokens": (int,),
    "ttft_s": (float, type(None)),
    "latency_s": (float,),
    "itl_p50_s": (float, type(None)),
    "itl_p95_s": (float, type(None)),
    "finish_reason": (str,),
    "end_reason": (str, type(None)),
    "queue_wait_s": (float, type(None)),
    "error": (str, type(None)),
    "ignored_fields": (list, type(None)),
}


# -- pure pieces ------------------------------------------------------------------------------------


def test_formatter_writes_one_json_object_with_time_first():
    record = logging.LogRecord("greenserve.access", logging.INFO, __file__, 1, "request", (), None)
    record.created = 1_700_000_000.25
    record.process = 4242
    record.request_id = "r-1"
    record.ttft_s = 0.5
    record.texts = ["é\n"]
    line = JsonFormatter().format(record)
    assert line == (
        '{"time": "2023-11-14T22:13:20.250Z", "level": "INFO", "logger": "greenserve.access", '
        '"pid": 4242, "message": "request", "request_id": "r-1", "ttft_s": 0.5, "texts": ["é\\n"]}'
    )


def test_formatter_formats_percent_args_and_exceptions():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        exc = sys.exc_info()
    record = logging.LogRecord("gunicorn.error", logging.ERROR, __file__, 1, "x=%s", (7,), exc)
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "x=7" and out["level"] == "ERROR"
    assert out["exc_info"].startswith("Traceback") and "RuntimeError: boom" in out["exc_info"]


def test_formatter_encodes_as_the_librarys_serializer():
    # One encoder made once must give the bytes of json.dumps(cls=JsonEncoder) for every value kind.
    class Reference(JsonFormatter):
        def jsonify_log_record(self, log_data):
            return LibraryFormatter.jsonify_log_record(self, log_data)

    values = [1, 1.5, None, "é\n\x00", ["a", (1, 2)], {"k": {"n": float("inf")}}, b"x"]
    values += [datetime.datetime(2020, 1, 1), decimal.Decimal("1.1"), ValueError("e"), object]
    for value in values:
        record = logging.LogRecord("greenserve.access", 20, __file__, 1, "m %s", (1,), None)
        record.extra_value = value
        assert JsonFormatter().format(record) == Reference().format(record), value


def test_client_hash_known_answer():
    # sha256(b"pepper127.0.0.1"), first 16 hex digits.
    assert client_hash("pepper", "127.0.0.1") == "ed99cd75414fa22e"
    assert client_hash("salt2", "127.0.0.1") != client_hash("pepper", "127.0.0.1")
    assert len(client_hash("", None)) == 16


def test_logging_config_shape_and_level_check():
    cfg = logging_config("debug")
    assert cfg["root"]["level"] == "DEBUG"
    assert cfg["loggers"]["greenserve"] == {
        "level": "DEBUG",
        "handlers": ["stderr"],
        "propagate": False,
    }
    assert cfg["loggers"]["gunicorn.access"]["level"] == "WARNING"
    assert cfg["formatters"]["json"] == {"()": "telemetry.logs.JsonFormatter"}
    with pytest.raises(ValueError, match="LOG_LEVEL must be a logging level name"):
        logging_config("loud")


def test_gap_summary_known_answer():
    # Tokens at 0, 1, 3, 6, 10 s: gaps 1, 2, 3, 4; 1 s is the top bound, the rest go to +Inf.
    gaps = summarize(array("d", [0.0, 1.0, 3.0, 6.0, 10.0]))
    assert (gaps.p50_s, gaps.sum_s) == (2.5, 10.0)
    assert gaps.p95_s == pytest.approx(3.85, abs=1e-12)  # linear: 3 + 0.85 * (4 - 3)
    assert gaps.counts == [0] * 14 + [1, 3]
    assert gaps.top == [(4, 4.0), (3, 3.0), (2, 2.0)]
    # 2e-5 s gaps land in the (1e-5, 2.5e-5] bucket; a gap equal to a bound belongs to that bucket.
    small = summarize(array("d", [0.0, 0.00002, 0.00004, 0.00005]))
    assert small.counts[:3] == [1, 2, 0]
    assert summarize(array("d", [1.0])) is None and summarize(array("d")) is None


@pytest.mark.parametrize(
    ("status", "error", "reasons", "label", "failed"),
    [
        (200, None, ["length"], "length", False),
        (200, None, ["stop", "length", "stop"], "length,stop", False),
        (200, "timed out", ["length", None], "error", True),
        (500, None, [None], "error", True),
        (499, "client disconnected while queued", [None], "abort", False),
        (200, None, [None, "stop"], "abort", False),
        (400, None, [], "none", False),
    ],
)
def test_finish_reason_label(status, error, reasons, label, failed):
    record = SimpleNamespace(status=status, error=error, finish_reasons=reasons)
    assert (finish_reason(record), is_failed(record)) == (label, failed)


# -- against a real gunicorn ------------------------------------------------------------------------


def check_types(line: dict) -> None:
    assert set(REQUEST_FIELDS) <= set(line), set(REQUEST_FIELDS) - set(line)
    for name, types in REQUEST_FIELDS.items():
        assert type(line[name]) in types, (name, line[name])


@pytest.fixture(scope="module")
def logged(succ_dir, serve_module):
    return serve_module(
        MODEL_DIR=str(succ_dir), CLIENT_HASH_SALT=SALT, GREENSERVE_FAULTS="fail_at=40"
    )


def test_request_line_has_every_field_typed_and_no_prompt(logged, succ_dir):
    srv = logged
    status, headers, _ = srv.complete(
        {"model": "m", "prompt": SECRET_PROMPT, "max_tokens": 3, "temperature": 0},
        headers={"X-Request-Id": "log-ok-1", "traceparent": PARENT},
    )
    assert status == 200
    line = request_line(srv, "log-ok-1")
    check_types(line)
    assert (line["level"], line["logger"], line["message"]) == (
        "INFO",
        "greenserve.access",
        "request",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert re.fullmatch(r"[0-9a-f]{16}", line["span_id"]) and line["span_id"] != "00f067aa0ba902b7"
    assert line["client_hash"] == client_hash(SALT, "127.0.0.1") == "ed99cd75414fa22e"
    assert (line["method"], line["path"], line["status"], line["model"]) == (
        "POST",
        "/v1/completions",
        200,
        "m",
    )
    assert (line["served_model"], line["variant"]) == (succ_dir.name, "primary")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (len(SECRET_PROMPT), 3)
    assert (line["finish_reason"], line["error"]) == ("length", None)
    assert 0 < line["ttft_s"] <= line["latency_s"]
    assert 0 <= line["itl_p50_s"] <= line["itl_p95_s"]
    assert 0 <= line["queue_wait_s"] <= line["ttft_s"]
    assert line["pid"] == srv.state()["pid"]  # the one worker
    assert "prompt" not in line and "texts" not in line
    assert SECRET_PROMPT not in srv.log_text()


def test_gunicorns_own_lines_are_json(logged):
    lines = log_lines(logged)  # every line parses (checked inside log_lines)
    booting = [x for x in lines if x["message"].startswith("Booting worker with pid")]
    assert booting and booting[0]["logger"] == "gunicorn.error" and booting[0]["level"] == "INFO"
    listening = [x for x in lines if x["message"].startswith("Listening at:")]
    assert listening and isinstance(listening[0]["pid"], int)
    # No second, gunicorn-format access line: the app's request line is the access log.
    assert not [x for x in lines if x["logger"] == "gunicorn.access"]


def test_rejected_and_failed_requests(logged):
    srv = logged
    srv.complete({"model": "m", "prompt": ""}, headers={"X-Request-Id": "log-400"})
    line = request_line(srv, "log-400")
    check_types(line)
    assert (line["status"], line["model"], line["finish_reason"]) == (400, None, "none")
    assert (line["ttft_s"], line["itl_p50_s"], line["queue_wait_s"]) == (None, None, None)
    # An engine failure after the first byte: status 200, an error and finish_reason "error".
    status, _, body = srv.complete(
        {"model": "m", "prompt": "a", "max_tokens": 50, "stream": True},
        headers={"X-Request-Id": "log-500"},
    )
    assert status == 200 and b"engine_error" in sse_events(body)[-2]
    line = request_line(srv, "log-500")
    check_types(line)
    assert (line["finish_reason"], line["completion_tokens"]) == ("error", 39)
    assert line["error"] == "Generation failed: EngineFailure."


def test_log_prompts_logs_prompt_and_texts(succ_dir, serve):
    srv = serve(MODEL_DIR=str(succ_dir), LOG_PROMPTS="1")
    srv.complete(
        {"model": "m", "prompt": "ab", "max_tokens": 3, "temperature": 0, "n": 2},
        headers={"X-Request-Id": "log-prompts"},
    )
    line = request_line(srv, "log-prompts")
    check_types(line)
    assert (line["prompt"], line["texts"]) == ("ab", ["cde", "cde"])


def test_debug_steps_and_slow_timeline(succ_dir, serve):
    srv = serve(
        MODEL_DIR=str(succ_dir),
        LOG_LEVEL="debug",
        SLOW_REQUEST_S="0.05",
        GREENSERVE_FAULTS="slow_step_s=0.02",
    )
    srv.complete({"model": "m", "prompt": "a", "max_tokens": 5}, headers={"X-Request-Id": "dbg"})
    request_line(srv, "dbg")
    steps = [x for x in log_lines(srv) if x["message"] == "step" and x.get("request_id") == "dbg"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert {s["logger"] for s in steps} == {"greenserve.step"}
    assert steps[0]["gap_s"] is None and all(s["gap_s"] >= 0.015 for s in steps[1:])
    assert all(a["t_s"] < b["t_s"] for a, b in zip(steps, steps[1:], strict=False))
    (slow,) = wait_for(
        srv, lambda x: x["message"] == "slow request" and x.get("request_id") == "dbg"
    )
    assert (slow["level"], slow["logger"]) == ("WARNING", "greenserve.slow")
    names = [event for event, _ in slow["timeline"]]
    assert names == ["arrived", "slot", "first_token", "last_token", "closed"]
    times = [t for _, t in slow["timeline"]]
    assert times == sorted(times) and times[-1] == slow["latency_s"] > 0.05
    assert len(slow["longest_gaps"]) == 3
    assert all(1 <= i <= 4 and gap >= 0.015 for i, gap in slow["longest_gaps"])
    # A quick request is not slow: no timeline for it.
    srv.complete({"model": "m", "prompt": "a", "max_tokens": 1}, headers={"X-Request-Id": "q"})
    request_line(srv, "q")
    assert not [
        x for x in log_lines(srv) if x["message"] == "slow request" and x.get("request_id") == "q"
    ]


def test_held_lines_leave_in_one_write_in_order():
    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    handler = StderrHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    parent = logging.getLogger("held-test")
    parent.addHandler(handler)
    parent.propagate = False
    child = logging.getLogger("held-test.access")
    child.setLevel(logging.INFO)
    try:
        child.info("before")
        with held_lines(child):
            child.info("one")
            with held_lines(child):  # nested: the outer block writes
                child.info("two")
            assert stream.writes == ["held-test.access before\n"]
        child.info("after")
    finally:
        parent.removeHandler(handler)
    assert stream.writes == [
        "held-test.access before\n",
        "held-test.access one\nheld-test.access two\n",
        "held-test.access after\n",
    ]
    assert logging_config("info")["handlers"]["stderr"]["class"] == "telemetry.logs.StderrHandler"


def test_a_plain_options_is_logged_with_the_204_it_is_answered_with(logged):
    # Not a CORS preflight (no Access-Control-Request-Method): Flask's automatic answer, made a 204.
    status, headers, body = logged.request(
        "OPTIONS", "/v1/completions", headers={"X-Request-Id": "log-options-1"}
    )
    assert (status, body) == (204, b"")
    assert headers["allow"] == "GET, HEAD, OPTIONS, POST"
    line = request_line(logged, "log-options-1")
    assert (line["method"], line["status"]) == ("OPTIONS", 204)
