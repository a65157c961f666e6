"""The ceiling of our stack: a bare ``gevent.pywsgi`` app writing canned SSE frames, no model work.

``POST /v1/completions`` reads ``model``, ``max_tokens`` and ``stream`` from the JSON body and answers with
frames of the same shape and size as greenserve's (one ``data:`` event per token, the last one with
``"finish_reason":"length"``, then ``[DONE]``), pre-formatted once per request. Like greenserve it
gives the hub a turn once a stream has run for its slice (``REF_HUB_SLICE_S``, shrunk to
``REF_HUB_ROUND_S`` divided by the running streams) with greenserve's own
``wsgi_app.server.hubturn.HubTurn`` (``REF_HUB_POLL_S``; the benchmark passes greenserve's values), so the
comparison is the same scheduling with no model, no Flask and no gunicorn. ``GET /healthz`` answers
``{"status":"ok"}``.

Run: ``python -m bench.ref_pywsgi PORT`` (one process, one core).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from gevent.pywsgi import WSGIHandler, WSGIServer

from wsgi_app.server.hubturn import POLL_S, HubTurn

HUB_SLICE_S = float(os.environ.get("REF_HUB_SLICE_S", "0.0005"))
HUB_ROUND_S = float(os.environ.get("REF_HUB_ROUND_S", "0.02"))
HUB_POLL_S = float(os.environ.get("REF_HUB_POLL_S", str(POLL_S)))
_running = [0]  # streams in progress (greenserve reads its busy slots)
_ID = b'{"id":"cmpl-000000000000000000000000","object":"text_completion","created":1700000000,'
_OK = b'{"status":"ok"}'


def _frames(model: str) -> tuple[bytes, bytes]:
    """Return the running and the final chunk event for ``model`` (text ``"e"``)."""
    head = _ID + b'"model":' + json.dumps(model, ensure_ascii=False).encode()
    choice = b',"choices":[{"index":0,"text":"e","logprobs":null,"finish_reason":'
    return (
        b"data: " + head + choice + b"null}]}\n\n",
        b"data: " + head + choice + b'"length"}]}\n\n',
    )


def _stream(model: str, max_tokens: int):
    running, final = _frames(model)
    _running[0] += 1
    try:
        yield b": ok\n\n"
        since = time.perf_counter()
        slice_s = min(HUB_SLICE_S, HUB_ROUND_S / _running[0])
        turn = HubTurn(HUB_POLL_S)
        for _ in range(max_tokens - 1):
            yield running
            if time.perf_counter() - since >= slice_s:
                turn()
                since = time.perf_counter()
                slice_s = min(HUB_SLICE_S, HUB_ROUND_S / _running[0])
        yield final
        yield b"data: [DONE]\n\n"
    finally:
        _running[0] -= 1


def _plain(model: str, max_tokens: int) -> bytes:
    body = {
        "id": "cmpl-000000000000000000000000",
        "object": "text_completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {"index": 0, "text": "e" * max_tokens, "logprobs": None, "finish_reason": "length"}
        ],
        "usage": {
            "prompt_tokens": 6,
            "completion_tokens": max_tokens,
            "total_tokens": 6 + max_tokens,
        },
    }
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def app(environ, start_response):
    """The WSGI app: canned completions and ``/healthz``."""
    path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
    if path == "/healthz" and method == "GET":
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", "15")])
        return [_OK]
    if path != "/v1/completions" or method != "POST":
        start_response("404 Not Found", [("Content-Length", "0")])
        return [b""]
    length = int(environ.get("CONTENT_LENGTH") or 0)
    req = json.loads(environ["wsgi.input"].read(length))
    model, max_tokens = req["model"], int(req.get("max_tokens", 16))
    if req.get("stream"):
        start_response(
            "200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
        )
        return _stream(model, max_tokens)
    body = _plain(model, max_tokens)
    start_response(
        "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    )
    return [body]


class NoDelayHandler(WSGIHandler):
    """Send each event at once, as greenserve does (TCP_NODELAY)."""

    def handle(self):
        """Set TCP_NODELAY on the connection, then serve it."""
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return super().handle()


def main() -> None:
    """Serve on 127.0.0.1:PORT until killed."""
    port = int(sys.argv[1])
    server = WSGIServer(
        ("127.0.0.1", port),
        app,
        handler_class=NoDelayHandler,
        log=None,
        spawn="default",
        backlog=2048,
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
