"""Start-up (README "Settings"): a bad setting stops the server before it binds, with one line naming
the variable and exit code 1, never a traceback; a good start logs one line per worker saying which
model it serves and which address is the API port and which the health port.

Each failing start is a real ``python -m gunicorn -c gunicorn.conf.py`` that exits in well under a
second: the settings of ``gunicorn.conf.py`` fail while it is read, the app's in the master's
``on_starting`` hook, before any worker is forked.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from model.files import file_sha256
from model.llama.formats.gguf_cache import FORMAT_VERSION
from model.loader import load_model
from tests.gguffiles import write_tiny_gguf
from tests.server import ROOT, GunicornServer, failed_start, wait_until
from wsgi_app.generation.faults import Faults
from wsgi_app.setting_checks import check_rate_limit_storage
from wsgi_app.settings import ServerSettings, Settings, usable_cpus

RL = {"RATE_LIMIT": "5/minute"}
BAD = [
    # gunicorn's own settings, read while gunicorn.conf.py loads
    ({"KEEPALIVE_S": "abc"}, "KEEPALIVE_S must be an integer, got 'abc'"),
    ({"PORT": "http"}, "PORT must be an integer, got 'http'"),
    ({"HEALTH_PORT": "70000"}, "HEALTH_PORT must be in 0..65535, got 70000"),
    ({"WEB_CONCURRENCY": "2000"}, "WEB_CONCURRENCY must be in 0..1024, got 2000"),
    ({"WORKER_CONNECTIONS": "0"}, "WORKER_CONNECTIONS must be in 1..1000000, got 0"),
    ({"GUNICORN_TIMEOUT_S": "1.5"}, "GUNICORN_TIMEOUT_S must be an integer, got '1.5'"),
    ({"GRACEFUL_TIMEOUT_S": "-1"}, "GRACEFUL_TIMEOUT_S must be in 0..86400, got -1"),
    ({"LOG_LEVEL": "loud"}, "LOG_LEVEL must be a logging level name, got 'loud'"),
    ({"HOST": "a b"}, "HOST must be an IP address or a host name, got 'a b'"),
    ({"HOST": "[::1"}, "HOST must be an IP address or a host name, got '[::1'"),
    ({"LOG_PROMPTS": "2"}, "LOG_PROMPTS must be in 0..1, got 2"),
    (
        {"PROMETHEUS_MULTIPROC_DIR": "/nonexistent/metrics"},
        "PROMETHEUS_MULTIPROC_DIR must be an existing writable directory, got '/nonexistent/metrics'",
    ),
    ({"PORT": "8123", "HEALTH_PORT": "8123"}, "PORT and HEALTH_PORT must differ, both are 8123"),
    # the model, loaded once in the master before the workers start
    (
        {"MODEL_DIR": "/nonexistent/greenserve/model"},
        "MODEL_DIR (/nonexistent/greenserve/model): /nonexistent/greenserve/model: does not exist",
    ),
    # the app's settings, checked in the master before the workers start
    ({"RATE_LIMIT": "lots"}, "RATE_LIMIT must look like '600/minute', got 'lots'"),
    (  # the URL may hold a password: only its scheme is shown
        {"RESPONSES_REDIS_URL": "http://user:secret@h:1/0"},
        "RESPONSES_REDIS_URL must be a redis://host:port/db URL, got a 'http://' URL",
    ),
    (
        {"RESPONSES_DB": "/nonexistent/responses.db"},
        "RESPONSES_DB must be a file in a writable directory, got '/nonexistent/responses.db'",
    ),
    ({"RESPONSES_MAX_COUNT": "0"}, "RESPONSES_MAX_COUNT must be in 1..100000000, got 0"),
    ({"RESPONSES_TTL_S": "0"}, "RESPONSES_TTL_S must be in 1.0..31536000.0, got 0"),
    (
        {**RL, "RATE_LIMIT_STORAGE_URI": "bogus://x"},
        "RATE_LIMIT_STORAGE_URI must be memory:// or redis://host:port/db, got a 'bogus://' URI",
    ),
    (  # memcached has no moving window: the limiter would fail in every worker
        {**RL, "RATE_LIMIT_STORAGE_URI": "memcached://127.0.0.1:11211"},
        "RATE_LIMIT_STORAGE_URI must be memory:// or redis://host:port/db, "
        "got a 'memcached://' URI",
    ),
    (
        {**RL, "RATE_LIMIT_STORAGE_URI": "redis://:pw@cache:six/0"},
        "RATE_LIMIT_STORAGE_URI: Port could not be cast to integer value as 'six'",
    ),
    (
        {"GREENSERVE_FAULTS": "bogus=1"},
        "GREENSERVE_FAULTS: unknown key 'bogus' (known: slow_step_s, fail_at, oom_at, "
        "matcher_fail_at, mask_spin_s, compile_spin_s, shadow_step_s, shadow_fail_at, fatal)",
    ),
    (
        {"GREENSERVE_FAULTS": "fail_at=x"},
        "GREENSERVE_FAULTS: fail_at must be an integer >= 0, got 'x'",
    ),
    (
        {"STATS_DB": "/nonexistent/dir/x.db"},
        "STATS_DB must be a file in a writable directory, got '/nonexistent/dir/x.db'",
    ),
    (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "notaurl"},
        "OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL with a host, got 'notaurl'",
    ),
    (
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector/v1/traces"},
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be an http:// or https:// URL with a host, "
        "got 'ftp://collector/v1/traces'",
    ),
]


@pytest.mark.parametrize(("env", "message"), BAD, ids=[",".join(env) for env, _ in BAD])
def test_bad_setting_stops_the_start_with_one_line(tmp_path, env, message):
    _, plain = failed_start(tmp_path, env)
    assert plain == [f"greenserve: cannot start: {message}"]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"WEB_CONCURRENCY": "two"}, [], "WEB_CONCURRENCY must be an integer, got 'two'"),
        ({}, ["--workers", "-1"], "WEB_CONCURRENCY must be in 0..1024, got -1"),
        ({"PORT": "http"}, [], "PORT must be an integer, got 'http'"),
        ({}, ["--workers", "abc"], "WEB_CONCURRENCY must be an integer, got 'abc'"),
        ({}, ["--model-dir="], "--model-dir is empty (omit it for the default)"),
        ({}, ["--workers", " "], "--workers is empty (omit it for the default)"),
    ],
)
def test_greenserve_command_refuses_a_bad_worker_count_with_one_line(tmp_path, env, args, message):
    """gunicorn parses WEB_CONCURRENCY with int() as it is imported (a traceback for "two"): the
    ``greenserve`` command checks gunicorn's settings before starting it."""
    srv = GunicornServer(tmp_path, env)
    done = subprocess.run(
        [sys.executable, "-m", "wsgi_app.cli", *args],
        cwd=tmp_path,
        env={**srv.env, "WEB_CONCURRENCY": env.get("WEB_CONCURRENCY", "1")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"greenserve: cannot start: {message}\n"


def test_web_concurrency_zero_starts_one_worker_per_usable_cpu(succ_dir, serve):
    srv = serve(workers=0, MODEL_DIR=str(succ_dir))
    assert len(srv.wait_workers(usable_cpus())) == usable_cpus()
    assert srv.log_text().count("Booting worker with pid") == usable_cpus()


def test_stats_db_that_is_a_directory_stops_the_start(tmp_path):
    _, plain = failed_start(tmp_path, {"STATS_DB": str(tmp_path)})
    assert plain == [
        f"greenserve: cannot start: STATS_DB must be a file in a writable directory, "
        f"got '{tmp_path}'"
    ]


def test_storage_uri_message_never_shows_the_password():
    with pytest.raises(ValueError) as info:
        check_rate_limit_storage("rediss+bogus://:hunter2@cache:6380/0")
    assert str(info.value) == (
        "RATE_LIMIT_STORAGE_URI must be memory:// or redis://host:port/db, "
        "got a 'rediss+bogus://' URI"
    )
    check_rate_limit_storage("redis://:hunter2@cache:6379/0")  # valid, and nothing connects
    check_rate_limit_storage("memory://")


def test_server_settings_defaults_and_binds():
    assert ServerSettings.from_env({}) == ServerSettings()
    assert ServerSettings().bind == ["0.0.0.0:8000", "0.0.0.0:9464"]
    v6 = ServerSettings.from_env({"HOST": "::1", "PORT": "0", "HEALTH_PORT": "0"})
    assert v6.bind == ["[::1]:0"]
    named = ServerSettings.from_env(
        {"HOST": "api.example.com", "PORT": "80", "HEALTH_PORT": "81", "LOG_LEVEL": "DEBUG"}
    )
    assert (named.bind, named.log_level) == (["api.example.com:80", "api.example.com:81"], "debug")


def test_otlp_endpoint_and_faults_parse_when_valid():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/"}
    assert Settings.from_env(env).otlp_endpoint == "https://collector:4318/v1/traces"
    assert Faults.parse(" slow_step_s=0.5 , fail_at=3, fatal=1") == Faults(0.5, 3, 0, True)


@pytest.mark.parametrize(("workers", "health_port"), [(2, True), (1, False)])
def test_each_worker_logs_what_it_serves_and_where(succ_dir, serve, workers, health_port):
    srv = serve(MODEL_DIR=str(succ_dir), workers=workers, health_port=health_port)
    status, headers, body = srv.get("/v1/models")
    assert status == 200

    def start_lines():
        lines = [json.loads(line) for line in srv.log_text().splitlines() if "{" in line]
        found = [line for line in lines if line["logger"] == "greenserve.start"]
        return found if len(found) == workers else None

    lines = wait_until(start_lines, what=f"{workers} start lines")
    checksum = load_model(str(succ_dir)).checksum
    expected = {
        "level": "INFO",
        "logger": "greenserve.start",
        "message": "serving",
        "model": json.loads(body)["data"][0]["id"],
        "model_kind": "bigram",
        "model_version": headers["x-model-version"],
        "models": [succ_dir.name],  # MODEL_DIR alone: its one model
        "api_address": f"http://127.0.0.1:{srv.port}",
        "health_address": f"http://127.0.0.1:{srv.health_port}" if health_port else None,
    }
    assert expected["model"] == succ_dir.name
    assert expected["model_version"].startswith(checksum[:16] + "+greenserve-")
    for line in lines:
        assert {k: line[k] for k in expected} == expected
    assert len({line["pid"] for line in lines}) == workers  # one line per worker


def test_a_gguf_start_logs_one_loading_line_from_the_master(tmp_path, serve):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    srv = serve(MODEL_DIR=str(gguf), GREENSERVE_CACHE_DIR=str(cache), workers=2)
    assert srv.get("/v1/models")[0] == 200

    def start_lines():
        lines = [json.loads(line) for line in srv.log_text().splitlines() if "{" in line]
        found = [line for line in lines if line["logger"] == "greenserve.start"]
        return found if len(found) == 3 else None

    loading, *serving = wait_until(start_lines, what="a loading line and 2 serving lines")
    assert {k: loading[k] for k in ("level", "message", "model_file", "weights_cache_dir")} == {
        "level": "INFO",
        "message": f"loading {gguf}: hashing, packed weights cache at {cache / 'gguf'}",
        "model_file": str(gguf),
        "weights_cache_dir": str(cache / "gguf"),
    }
    assert loading["pid"] == srv.proc.pid  # the master, before any worker is forked
    assert [line["message"] for line in serving] == ["serving", "serving"]
    assert len(list((cache / "gguf").glob("*.safetensors"))) == 1  # built once, by the master
    # and it says so before the two silent steps of a first start: packing, loading the kernels
    lines = [json.loads(line) for line in srv.log_text().splitlines() if "{" in line]
    model_lines = [
        (line["pid"], line["message"]) for line in lines if line["logger"] == "greenserve.model"
    ]
    packed = cache / "gguf" / f"{file_sha256(gguf)}.v{FORMAT_VERSION}.safetensors"
    kernels = [m for pid, m in model_lines if m.startswith("loading greenserve's kernels from ")]
    assert (
        srv.proc.pid,
        f"packing the GGUF's weights into {packed} (once per GGUF)",
    ) in model_lines
    assert len(kernels) == 1 and ("compiled there first when missing" in kernels[0])


def test_greenserve_help_says_what_zero_workers_means():
    done = subprocess.run(
        [sys.executable, "-m", "wsgi_app.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    assert "worker processes, 0..1024 (0 or unset: one per usable CPU)" in " ".join(
        done.stdout.split()
    )


@pytest.mark.parametrize("setting", ["PORT", "HEALTH_PORT"])
def test_a_busy_port_stops_the_start_with_one_line_naming_the_port_and_setting(tmp_path, setting):
    # Someone else listens there already (no SO_REUSEADDR games: a plain listener).
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        ports = {"PORT": "0", "HEALTH_PORT": "0", setting: str(port)}
        stderr, plain = failed_start(tmp_path, {"HOST": "127.0.0.1", **ports}, own_binds=True)
    # gunicorn's own five retries ("Connection in use", "Retrying in 1 second") never start.
    assert "Retrying" not in stderr and "Connection in use" not in stderr
    assert plain == [
        f"greenserve: cannot start: port {port} on 127.0.0.1 ({setting}={port}) already in use; "
        f"stop what listens there or set {setting} to a free port"
    ]
