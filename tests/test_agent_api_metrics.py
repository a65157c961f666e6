"""``/v1/responses`` and ``/v1/messages`` are generation routes like the other two: every answer is
counted in ``/metrics`` (by endpoint, with its tokens, TTFT and latency) and in ``/stats``; a
``count_tokens`` call generates nothing and is not. Through a real gunicorn serving the bigram."""

from __future__ import annotations

import json

from tests.scrape import scrape, value
from tests.server import wait_until

MESSAGE = {"role": "user", "content": "ROMEO:"}
SERVED = {"model": "bigram", "variant": "primary"}  # the packaged model, whatever a body names


def test_responses_and_messages_are_counted_by_endpoint(serve):
    srv = serve()
    status, _, raw = srv.post(
        "/v1/responses",
        {"model": "m", "input": "ROMEO:", "max_output_tokens": 5, "seed": 1, "store": False},
    )
    assert status == 200, raw
    responses_usage = json.loads(raw)["usage"]
    status, _, raw = srv.post(
        "/v1/messages", {"model": "m", "max_tokens": 7, "messages": [MESSAGE], "seed": 1}
    )
    assert status == 200, raw
    messages_usage = json.loads(raw)["usage"]
    status, _, raw = srv.post("/v1/messages/count_tokens", {"model": "m", "messages": [MESSAGE]})
    assert status == 200, raw

    def counted() -> dict | None:
        m = scrape(srv)
        return m if sum(m["greenserve_requests"].values()) == 2 else None

    m = wait_until(counted, 5, "both answers counted")  # observed a loop turn after the last byte
    for endpoint in ("/v1/responses", "/v1/messages"):
        assert (
            value(
                m,
                "greenserve_requests",
                "greenserve_requests_total",
                endpoint=endpoint,
                status="200",
                finish_reason="length",
                end_reason="finished",
                **SERVED,
            )
            == 1
        )
    assert (
        value(m, "greenserve_generation_tokens", "greenserve_generation_tokens_total", **SERVED)
        == (responses_usage["output_tokens"] + messages_usage["output_tokens"])
        == 5 + 7
    )
    assert value(m, "greenserve_prompt_tokens", "greenserve_prompt_tokens_total") == (
        responses_usage["input_tokens"] + messages_usage["input_tokens"]
    )
    ttft = "greenserve_time_to_first_token_seconds"
    assert value(m, ttft, ttft + "_count", **SERVED) == 2
    status, _, raw = srv.get("/stats")
    assert status == 200
    assert json.loads(raw)["totals"]["by_endpoint"] == {"/v1/messages": 1, "/v1/responses": 1}
