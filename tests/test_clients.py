"""Client identity, API-key parsing and rate-limit settings: pure functions, known answers."""

from __future__ import annotations

import hashlib

import pytest

from wsgi_app.http.auth import bearer_token, key_matches
from wsgi_app.http.client_identity import forwarded_client, key_digest
from wsgi_app.http.ratelimit import parse_rate_limit, redacted, retry_after_s, storage_options
from wsgi_app.settings import Settings


@pytest.mark.parametrize(
    ("remote", "xff", "trusted", "expected"),
    [
        # Nothing trusted: the header is ignored, whatever it says.
        ("10.0.0.9", "1.2.3.4", 0, "10.0.0.9"),
        ("10.0.0.9", None, 1, "10.0.0.9"),
        # One proxy: the entry it appended, the last one; the client's own entries are ignored.
        ("10.0.0.9", "1.2.3.4", 1, "1.2.3.4"),
        ("10.0.0.9", "6.6.6.6, 1.2.3.4", 1, "1.2.3.4"),
        ("10.0.0.9", "6.6.6.6,1.2.3.4", 1, "1.2.3.4"),
        # Two proxies: the second entry from the right.
        ("10.0.0.9", "6.6.6.6, 1.2.3.4, 10.0.0.8", 2, "1.2.3.4"),
        # Fewer entries than trusted proxies: the request bypassed one; use the peer (ProxyFix).
        ("10.0.0.9", "1.2.3.4", 2, "10.0.0.9"),
        # A trusted entry that is not an address: the peer.
        ("10.0.0.9", "6.6.6.6, unknown", 1, "10.0.0.9"),
        ("10.0.0.9", "6.6.6.6, ", 1, "10.0.0.9"),
        # IPv6 is normalised, so one client is one bucket however it is spelled.
        ("10.0.0.9", "2001:DB8:0:0::1", 1, "2001:db8::1"),
        ("::1", None, 0, "::1"),
        (None, None, 0, "unknown"),
    ],
)
def test_forwarded_client(remote, xff, trusted, expected):
    assert forwarded_client(remote, xff, trusted, ("10.0.0.0/8", "::1")) == expected


@pytest.mark.parametrize(
    ("remote", "xff", "trusted", "allowed", "expected"),
    [
        # A peer that is not a proxy of ours: the header is its own invention, ignored.
        ("203.0.113.5", "1.2.3.4", 1, ("127.0.0.1", "::1"), "203.0.113.5"),
        ("10.0.0.9", "1.2.3.4", 1, ("127.0.0.1", "::1"), "10.0.0.9"),  # the default: loopback only
        ("10.0.0.9", "1.2.3.4", 1, ("10.0.0.0/24",), "1.2.3.4"),  # a CIDR network
        ("::ffff:10.0.0.9", "1.2.3.4", 1, ("10.0.0.0/24",), "::ffff:a00:9"),  # v6 is not v4
        ("203.0.113.5", "1.2.3.4", 1, ("*",), "1.2.3.4"),  # "*": any peer (gunicorn's meaning)
        # Two hops: the inner proxy's entry must be a proxy of ours too, else it is the client.
        ("10.0.0.9", "6.6.6.6, 1.2.3.4, 10.0.0.8", 2, ("10.0.0.0/24",), "1.2.3.4"),
        ("10.0.0.9", "6.6.6.6, 1.2.3.4, 198.51.100.1", 2, ("10.0.0.0/24",), "198.51.100.1"),
    ],
)
def test_forwarded_for_only_from_allowed_peers(remote, xff, trusted, allowed, expected):
    assert forwarded_client(remote, xff, trusted, allowed) == expected


def test_key_digest_is_a_sha256_prefix():
    assert key_digest("sk-test") == "f3abf2a6cc4f00987743db5f544ba345"
    assert key_digest("sk-test") == hashlib.sha256(b"sk-test").hexdigest()[:32]


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),
        ("BEARER   sk-1  ", "sk-1"),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic dXNlcjpwYXNz", None),
        ("sk-1", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_key_matches_every_configured_key_and_nothing_else():
    digests = [hashlib.sha256(k.encode()).digest() for k in ("alpha", "beta")]
    assert key_matches("alpha", digests) is True
    assert key_matches("beta", digests) is True
    assert key_matches("alph", digests) is False
    assert key_matches("alphaa", digests) is False
    assert key_matches("", digests) is False
    assert key_matches("é", digests) is False  # non-ASCII never raises (compare_digest on bytes)


def test_settings_for_limits_keys_and_proxies():
    s = Settings.from_env(
        {
            "RATE_LIMIT": "600/minute",
            "RATE_LIMIT_STORAGE_URI": "redis://:secret@cache:6379/0",
            "TRUSTED_PROXIES": "1",
            "API_KEYS": " k1, k2 ,,k3 ",
        }
    )
    assert s.rate_limit == "600/minute"
    assert s.rate_limit_storage_uri == "redis://:secret@cache:6379/0"
    assert s.trusted_proxies == 1
    assert s.api_keys == ("k1", "k2", "k3")
    assert "secret" not in repr(s) and "k1" not in repr(s)  # secrets stay out of logs
    d = Settings.from_env({})
    assert (d.rate_limit, d.rate_limit_storage_uri, d.trusted_proxies, d.api_keys) == (
        "",
        "memory://",
        0,
        (),
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"API_KEYS": " , ,"}, "API_KEYS must list at least one non-empty key"),
        ({"TRUSTED_PROXIES": "-1"}, "TRUSTED_PROXIES must be in 0..32, got -1"),
        ({"TRUSTED_PROXIES": "one"}, "TRUSTED_PROXIES must be an integer, got 'one'"),
    ],
)
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError) as exc:
        Settings.from_env(env)
    assert str(exc.value) == message


def test_parse_rate_limit():
    (item,) = parse_rate_limit("600/minute")
    assert (item.amount, item.get_expiry(), str(item)) == (600, 60, "600 per 1 minute")
    assert [str(i) for i in parse_rate_limit("10/second; 1000/hour")] == [
        "10 per 1 second",
        "1000 per 1 hour",
    ]
    for bad in ("600 a minute", "fast", "/minute"):
        with pytest.raises(ValueError) as exc:
            parse_rate_limit(bad)
        assert str(exc.value) == f"RATE_LIMIT must look like '600/minute', got {bad!r}"


def test_retry_after_is_whole_seconds_and_never_zero():
    assert retry_after_s(1000.0, 940.0) == 60
    assert retry_after_s(1000.0, 940.5) == 60  # rounds up: never invites an early retry
    assert retry_after_s(1000.0, 999.9) == 1
    assert retry_after_s(1000.0, 1000.0) == 1
    assert retry_after_s(1000.0, 1005.0) == 1


def test_storage_helpers():
    assert redacted("redis://:secret@cache:6379/0") == "redis://cache:6379/0"
    assert redacted("redis://user:pw@10.0.0.5/2") == "redis://10.0.0.5/2"
    assert redacted("memory://") == "memory://"
    assert storage_options("memory://") == {}
    assert storage_options("redis://cache:6379/0") == {
        "socket_connect_timeout": 0.25,
        "socket_timeout": 0.25,
    }
    assert storage_options("rediss://cache:6380/0")["socket_timeout"] == 0.25
