"""W3C Trace Context ``traceparent`` parsing, formatting and id generation."""

from __future__ import annotations

import pytest

from telemetry.spans import KIND_SERVER, STATUS_ERROR, STATUS_UNSET, start_server_span
from telemetry.traceparent import (
    TraceContext,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse,
)

# The example from W3C Trace Context Level 1, §3.2.2.
W3C = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
W3C_CTX = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
TID = "4bf92f3577b34da6a3ce929d0e0e4736"
SID = "00f067aa0ba902b7"
LOWER_HEX = set("0123456789abcdef")


def test_w3c_example() -> None:
    assert parse(W3C) == W3C_CTX


def test_not_sampled_flags() -> None:
    assert parse(f"00-{TID}-{SID}-00") == TraceContext(TID, SID, 0)
    assert parse(f"00-{TID}-{SID}-ff") == TraceContext(TID, SID, 255)


@pytest.mark.parametrize("ws", [" ", "\t", " \t ", ""])
def test_optional_whitespace_around_value(ws: str) -> None:
    assert parse(f"{ws}{W3C}{ws}") == W3C_CTX


@pytest.mark.parametrize("value", [None, "", " ", "\t"])
def test_absent_or_blank(value: str | None) -> None:
    assert parse(value) is None


def test_non_string_is_none() -> None:
    assert parse(b"00-" + TID.encode()) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        W3C.upper(),
        f"00-{TID.upper()}-{SID}-01",
        f"00-{TID}-{SID.upper()}-01",
        f"00-{TID}-{SID}-0A",
        f"0A-{TID}-{SID}-01",
    ],
)
def test_upper_case_hex_rejected(value: str) -> None:
    assert parse(value) is None


def test_all_zero_ids_rejected() -> None:
    assert parse(f"00-{'0' * 32}-{SID}-01") is None
    assert parse(f"00-{TID}-{'0' * 16}-01") is None


def test_version_ff_rejected() -> None:
    assert parse(f"ff-{TID}-{SID}-01") is None
    assert parse(f"ff-{TID}-{SID}-01-extra") is None


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TID[:-1]}-{SID}-01",  # trace id 31
        f"00-{TID}0-{SID}-01",  # trace id 33
        f"00-{TID}-{SID[:-1]}-01",  # parent id 15
        f"00-{TID}-{SID}0-01",  # parent id 17
        f"00-{TID}-{SID}-1",  # flags 1
        f"00-{TID}-{SID}-001",  # flags 3
        f"0-{TID}-{SID}-01",  # version 1
        f"000-{TID}-{SID}-01",  # version 3
        f"00-{TID}-{SID}",  # missing flags
        f"00_{TID}_{SID}_01",  # wrong separators
        f"00-{TID[:-1]}g-{SID}-01",  # non-hex
        f"00-{TID}-{SID[:-1]}x-01",
        f"00-{TID}-{SID}-0x",
        f"zz-{TID}-{SID}-01",
    ],
)
def test_malformed_rejected(value: str) -> None:
    assert parse(value) is None


@pytest.mark.parametrize("suffix", ["-", "-what-the-future-will-be-like", "-00", "x"])
def test_version_00_must_have_exactly_four_fields(suffix: str) -> None:
    assert parse(W3C + suffix) is None


def test_future_version_with_extra_field_accepted() -> None:
    assert parse(f"01-{TID}-{SID}-01-what-the-future-will-be-like") == W3C_CTX
    assert parse(f"cc-{TID}-{SID}-09") == TraceContext(TID, SID, 9)


def test_future_version_needs_dash_after_flags() -> None:
    assert parse(f"01-{TID}-{SID}-01x") is None
    assert parse(f"01-{TID}-{SID}-011") is None


def test_whitespace_inside_value_rejected() -> None:
    assert parse(f"00-{TID}- {SID[1:]}-01") is None
    assert parse(f"{W3C}\n") is None  # only SP / HTAB are optional whitespace


def test_format_roundtrip() -> None:
    assert format_traceparent(W3C_CTX) == W3C
    assert format_traceparent(TraceContext(TID, SID, 0)) == f"00-{TID}-{SID}-00"
    assert parse(format_traceparent(TraceContext(TID, SID, 0x1FF))) == TraceContext(TID, SID, 255)


def test_future_version_formats_as_00() -> None:
    ctx = parse(f"7f-{TID}-{SID}-01-extra")
    assert ctx is not None and format_traceparent(ctx) == W3C


@pytest.mark.parametrize(("make", "length"), [(new_trace_id, 32), (new_span_id, 16)])
def test_new_ids(make, length: int) -> None:
    ids = {make() for _ in range(200)}
    assert len(ids) == 200  # 64+ random bits: a collision means a broken generator
    for value in ids:
        assert len(value) == length
        assert set(value) <= LOWER_HEX
        assert value != "0" * length


def test_new_ids_parse_back() -> None:
    ctx = TraceContext(new_trace_id(), new_span_id(), 1)
    assert parse(format_traceparent(ctx)) == ctx


def test_server_span_child_of_traceparent() -> None:
    span = start_server_span("POST /v1/completions", parse(W3C), {"http.request.method": "POST"})
    assert span.trace_id == TID
    assert span.parent_span_id == SID
    assert span.span_id != SID and len(span.span_id) == 16 and set(span.span_id) <= LOWER_HEX
    assert span.kind == KIND_SERVER == 2
    assert span.attributes == {"http.request.method": "POST"}
    assert span.start_ns > 1_600_000_000 * 10**9 and span.end_ns == 0


def test_server_span_root_without_parent() -> None:
    a = start_server_span("POST /v1/completions", None)
    b = start_server_span("POST /v1/completions", None)
    assert a.parent_span_id is None
    assert len(a.trace_id) == 32 and a.trace_id != b.trace_id
    assert a.attributes == {}


def test_span_attributes_copied() -> None:
    attrs = {"k": 1}
    span = start_server_span("x", None, attrs)
    span.attributes["k"] = 2
    assert attrs == {"k": 1}


def test_span_end_first_call_wins() -> None:
    span = start_server_span("x", None)
    span.end(STATUS_ERROR, "engine failed")
    end_ns = span.end_ns
    assert end_ns >= span.start_ns
    span.end(1, "ignored")
    assert (span.end_ns, span.status_code, span.status_message) == (end_ns, 2, "engine failed")


def test_span_end_without_status_keeps_unset() -> None:
    span = start_server_span("x", None)
    span.end()
    assert span.status_code == STATUS_UNSET and span.status_message == ""
    ok = start_server_span("x", None)
    ok.end(1, "not kept for OK")
    assert ok.status_code == 1 and ok.status_message == ""
