"""The worker's per-request set-up made cheaper without changing a byte: a response's head
leaves in one ``send`` with its first body bytes; the base environ, gunicorn's settings and a peer's
trust are worked out once per worker; the same bytes and answers as gunicorn's own."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
from gunicorn import util
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.message import Request as GunicornRequest

from tests.server import wait_until
from wsgi_app.server import response
from wsgi_app.server.request_head import BoundedRequest
from wsgi_app.server.worker import freeze_settings

DATE = "Tue, 01 Dec 2026 20:54:50 GMT"


class _Recorder:
    """A connection that records every ``sendall``."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    def sendall(self, data) -> None:
        self.sends.append(bytes(data))


class _Req:
    """The parts of gunicorn's request its response reads."""

    def __init__(self, method: str = "POST") -> None:
        self.version = (1, 1)
        self.method = method

    def should_close(self) -> bool:
        return False


def _answer(cls, headers, body_items, method="POST"):
    sock = _Recorder()
    resp = cls(_Req(method), sock, SimpleNamespace(protocol="http"))
    resp.start_response("200 OK", headers)
    for item in body_items:
        resp.write(item)
    resp.close()
    return sock.sends


@pytest.fixture(autouse=True)
def _fixed_date(monkeypatch):
    monkeypatch.setattr(util, "http_date", lambda *a: DATE)


def test_a_json_answer_is_one_send_of_gunicorns_bytes():
    headers = [("Content-Type", "application/json"), ("Content-Length", "2")]
    ours = _answer(response.Response, headers, [b"{}"])
    theirs = _answer(wsgi.Response, headers, [b"{}"])
    assert len(theirs) == 2
    assert ours == [b"".join(theirs)]
    assert ours[0] == (
        b"HTTP/1.1 200 OK\r\nServer: gunicorn\r\nDate: " + DATE.encode() + b"\r\n"
        b"Connection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )


def test_a_stream_sends_its_head_with_the_first_chunk_then_each_chunk_at_once():
    headers = [("Content-Type", "text/event-stream")]
    items = [b": ok\n\n", b"data: 1\n\n", b"data: [DONE]\n\n"]
    ours = _answer(response.Response, headers, items)
    theirs = _answer(wsgi.Response, headers, items)
    assert b"".join(ours) == b"".join(theirs)
    assert ours[0] == theirs[0] + theirs[1]
    assert ours[0].endswith(
        b"Transfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n6\r\n: ok\n\n\r\n"
    )
    assert (
        ours[1:]
        == theirs[2:]
        == [b"9\r\ndata: 1\n\n\r\n", b"E\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"]
    )


def test_an_empty_body_is_its_head_and_last_chunk_in_one_send():
    ours = _answer(response.Response, [("Content-Type", "text/plain")], [])
    theirs = _answer(wsgi.Response, [("Content-Type", "text/plain")], [])
    assert ours == [b"".join(theirs)] and ours[0].endswith(b"\r\n\r\n0\r\n\r\n")


def test_a_body_item_that_is_not_bytes_still_sends_the_head_first():
    sock = _Recorder()
    resp = response.Response(_Req(), sock, SimpleNamespace(protocol="http"))
    resp.start_response("200 OK", [("Content-Length", "2")])
    with pytest.raises(TypeError):
        resp.write("{}")
    assert len(sock.sends) == 1 and sock.sends[0].endswith(b"Content-Length: 2\r\n\r\n")
    assert resp.headers_sent and resp.sock is sock


def test_the_base_environ_is_made_once_and_copied_until_the_logs_reopen():
    made = []

    def make(cfg):
        made.append(cfg)
        return {"wsgi.errors": object(), "wsgi.version": (1, 0)}

    base = response.BaseEnviron(make)
    first, second = base("cfg"), base("cfg")
    assert first == second and first is not second and len(made) == 1
    first["PATH_INFO"] = "/x"
    assert "PATH_INFO" not in base("cfg")
    base.forget()
    assert base("cfg")["wsgi.errors"] is not second["wsgi.errors"] and len(made) == 2


def test_frozen_settings_read_as_gunicorns():
    cfg = Config()
    cfg.set("keepalive", 7)
    cfg.set("forwarded_allow_ips", "10.0.0.0/8,127.0.0.1")
    before = {name: getattr(cfg, name) for name in cfg.settings}
    ssl, address = cfg.is_ssl, cfg.address
    freeze_settings(cfg)
    assert {name: getattr(cfg, name) for name in cfg.settings} == before
    assert "keepalive" in vars(cfg) and cfg.keepalive == 7
    assert (cfg.is_ssl, cfg.address) == (ssl, address)


@pytest.mark.parametrize(
    ("allowed", "peer"),
    [
        ("127.0.0.1,::1", ("127.0.0.1", 5000)),
        ("127.0.0.1,::1", ("10.1.2.3", 5000)),
        ("10.0.0.0/8", ("10.1.2.3", 5000)),
        ("10.0.0.0/8", ("not-an-ip", 5000)),
        ("*", ("192.0.2.1", 5000)),
        ("127.0.0.1", "/run/greenserve.sock"),
    ],
)
def test_a_peers_trust_is_gunicorns_and_kept_per_address_and_allow_list(allowed, peer):
    cfg = Config()
    cfg.set("forwarded_allow_ips", allowed)
    ours = object.__new__(BoundedRequest)
    theirs = object.__new__(GunicornRequest)
    for req in (ours, theirs):
        req.cfg, req.peer_addr = cfg, peer
    expected = theirs._peer_is_trusted_proxy()
    assert ours._peer_is_trusted_proxy() is expected
    assert ours._peer_is_trusted_proxy() is expected  # the kept answer
    if isinstance(peer, tuple):
        assert BoundedRequest._trusted_peers[(peer[0], tuple(cfg.forwarded_allow_ips))] is expected


def _same_completion(a: bytes, b: bytes) -> bool:
    """True when two JSON answers are the same completion but for their id and creation time."""
    x, y = json.loads(a), json.loads(b)
    for answer in (x, y):
        del answer["id"], answer["created"]
    return x == y


def test_a_log_reopen_keeps_the_worker_serving_with_a_fresh_base_environ(serve):
    srv = serve()
    body = {"model": "bigram", "prompt": "ROMEO:", "max_tokens": 4, "seed": 7}
    status, _, first = srv.complete(body)
    assert status == 200
    pid = srv.state()["pid"]
    os.kill(pid, signal.SIGUSR1)  # gunicorn's "reopen the log files", handled by the worker
    wait_until(
        lambda: f"Worker reopened its log files (pid:{pid})" in srv.log_text(),
        10.0,
        lambda: f"the worker's reopen; log:\n{srv.log_tail()}",
    )
    status, _, again = srv.complete(body)
    assert status == 200 and _same_completion(first, again)
    assert srv.state()["pid"] == pid  # the same worker, still serving
    wait_until(
        lambda: srv.log_text().count('"message": "request"') >= 2,
        5.0,
        lambda: "both requests' log lines",
    )
