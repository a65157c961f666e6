"""``X-Forwarded-For`` is believed only from ``FORWARDED_ALLOW_IPS`` and never on the health port.

With ``TRUSTED_PROXIES=1`` a client that reaches the port directly used to get a fresh rate-limit
budget by inventing the header each time. A real gunicorn with a 2/minute limit: from a peer outside
``FORWARDED_ALLOW_IPS`` every invented address is the one peer's bucket; on the health port too, even
from a listed peer; from a listed peer on the API port the proxy's entry is still the client.

Source: gunicorn ``forwarded_allow_ips``; RFC 7239 §5.2.
"""

from __future__ import annotations

import pytest

BODY = {"model": "m", "prompt": "a", "max_tokens": 1, "temperature": 0}


@pytest.fixture
def limited(succ_dir, serve):
    def make(**env: str):
        return serve(MODEL_DIR=str(succ_dir), RATE_LIMIT="2/minute", TRUSTED_PROXIES="1", **env)

    return make


def spoofed(srv, port: int | None = None) -> list[int]:
    return [
        srv.complete(BODY, headers={"X-Forwarded-For": f"203.0.113.{i}"}, port=port)[0]
        for i in range(4)
    ]


def test_a_peer_outside_forwarded_allow_ips_cannot_choose_its_address(limited):
    srv = limited(FORWARDED_ALLOW_IPS="10.9.9.9,192.0.2.0/24")  # the test's 127.0.0.1 is not listed
    assert spoofed(srv) == [200, 200, 429, 429]


def test_the_health_port_never_takes_the_header(limited):
    srv = limited()  # 127.0.0.1 is a listed proxy (the default), yet not on the health port
    assert spoofed(srv, port=srv.health_port) == [200, 200, 429, 429]
    # On the API port the same peer's entries are believed: each invented address its own bucket.
    assert spoofed(srv) == [200, 200, 200, 200]


def test_a_bad_entry_is_refused():
    from wsgi_app.settings import Settings

    # (gunicorn reads the same variable and refuses it first, at start, with its own line.)
    with pytest.raises(ValueError) as err:
        Settings.from_env({"FORWARDED_ALLOW_IPS": "127.0.0.1,proxy.local"})
    assert str(err.value) == (
        "FORWARDED_ALLOW_IPS must list IP addresses or CIDR networks (or be '*'), got 'proxy.local'"
    )
    assert Settings.from_env({}).forwarded_allow_ips == ("127.0.0.1", "::1")
    assert Settings.from_env({"FORWARDED_ALLOW_IPS": "10.0.0.0/8, *"}).forwarded_allow_ips == ("*",)
