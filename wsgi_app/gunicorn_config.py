"""gunicorn configuration for greenserve, inside the package so it loads from any folder.

``greenserve`` starts gunicorn with ``-c python:wsgi_app.gunicorn_config``; the checkout's
``gunicorn.conf.py`` imports this module, so ``gunicorn -c gunicorn.conf.py`` runs the same settings.
Plain names, each with its unit and environment override. Nothing heavy is imported here: gunicorn loads
this file in the master before gevent patches the workers, and the model is loaded per worker by the app
factory (no ``preload_app``), so each worker owns its model and its span exporter.
"""

import os
import sys
import tempfile
import time
from typing import NoReturn

from gunicorn.glogging import Logger

from telemetry.logs import lighten_records, logging_config
from wsgi_app.settings import ServerSettings, usable_cpus

_made_metrics_dir = None  # the metrics dir this process made, removed if the start fails
MODELS_SNAPSHOT = "greenserve-models.json"  # the last good models file, in that dir


def _remove_made_metrics_dir() -> None:
    """Remove the metrics dir this master made (never the operator's own directory)."""
    if _made_metrics_dir:
        import shutil

        shutil.rmtree(_made_metrics_dir, ignore_errors=True)


def _cannot_start(exc: ValueError) -> NoReturn:
    """Stop the master with one line naming the bad setting, and exit code 1 (no traceback)."""
    _remove_made_metrics_dir()
    print(f"greenserve: cannot start: {exc}", file=sys.stderr)
    sys.exit(1)


def _own_metrics_dir() -> str | None:
    """Make this master's own metrics directory and return it (None: the base is unusable, which
    the settings check then names).

    Every master gets a fresh one, whatever it inherits: a master re-executed by ``USR2`` after a
    ``SIGHUP`` reload inherits ``PROMETHEUS_MULTIPROC_DIR`` from the environment gunicorn saved at
    the reload, and sharing it would let the old master's exit delete it (and the new master's start
    empty the old workers' files). The base is what the operator set (``PROMETHEUS_MULTIPROC_DIR``,
    kept for the lineage in ``GREENSERVE_METRICS_BASE``): a ``master-*`` subdirectory of it; unset, a
    ``greenserve-metrics-*`` directory in the temp dir. Removed when the master exits.
    """
    base = os.environ.get("GREENSERVE_METRICS_BASE")
    if base is None:  # the first master of this lineage: what the operator set, or nothing
        base = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "").strip()
        os.environ["GREENSERVE_METRICS_BASE"] = base
    try:
        if base:
            return tempfile.mkdtemp(prefix="master-", dir=base)
        return tempfile.mkdtemp(prefix="greenserve-metrics-")
    except OSError:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = base  # Settings.from_env names it
        return None


# gunicorn's settings are checked as this file is read: a bad one is one line and exit code 1, not
# gunicorn's "Failed to read config file" and a traceback. The app's are checked in on_starting.
try:
    _server = ServerSettings.from_env()
    # Every log line, gunicorn's and the app's, is one JSON object on stderr (LOG_LEVEL sets the level).
    logconfig_dict = logging_config(_server.log_level)
    # No line shows the caller's file and line or the thread: the records skip finding them (the
    # workers, forked from here, too).
    lighten_records()
except ValueError as exc:
    _cannot_start(exc)

# When this master started (Unix seconds), for /stats' "since start" percentiles: one per master, as
# its metrics dir below is (kept across SIGHUP reloads, which do not re-run this file; a USR2 upgrade's
# new master counts from its own start).
os.environ["GREENSERVE_STARTED_AT"] = repr(time.time())

# numpy reads this at import; one BLAS thread per worker, the workers are the parallelism.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR): every worker writes its metrics to
# files here and /metrics sums them. prometheus_client decides at import, so this is set before any
# worker imports it. Each master has its own directory (see _own_metrics_dir), removed when it
# exits; the drain marker and the default STATS_DB live in it, so they go with their master.
_made_metrics_dir = _own_metrics_dir()
if _made_metrics_dir is not None:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _made_metrics_dir
    os.environ["GREENSERVE_OWN_METRICS_DIR"] = _made_metrics_dir


# The API port (HOST, PORT), then the health port for probes and scrapes (HEALTH_PORT; 0 disables it).
bind = _server.bind
# Worker processes (WEB_CONCURRENCY); 0 or unset: one per usable CPU.
workers = _server.workers or usable_cpus()
# Every connection is a greenlet: gunicorn's gevent worker with a cheaper sendall (wsgi_app.server.worker).
worker_class = "wsgi_app.server.worker.GeventWorker"
# Simultaneous connections per worker (WORKER_CONNECTIONS), streams and idle keep-alives alike.
worker_connections = _server.worker_connections
# The app factory runs in each worker, after gevent's monkey-patching.
wsgi_app = "wsgi_app:create_app()"
preload_app = False
# Seconds a worker may go without notifying the arbiter. Under gevent this bounds hub stalls (CPU work
# that never yields), not request length: requests have their own deadline (REQUEST_TIMEOUT_S).
timeout = _server.timeout_s
# Seconds in-flight streams get to finish after SIGTERM before the worker is killed.
graceful_timeout = _server.graceful_timeout_s
# Seconds an idle keep-alive connection is held open.
keepalive = _server.keepalive_s
# Worker recycling would cut in-flight streams.
max_requests = 0
# gunicorn's own log to stderr; the app writes one JSON line per request, so no access log.
errorlog = "-"
loglevel = _server.log_level
accesslog = None


class AppLogsRequests(Logger):
    """gunicorn's logger without its access log: the app writes a fuller JSON line per request, and
    with ``logconfig_dict`` set gunicorn would otherwise build (then drop) access fields every time."""

    def access(self, resp, req, environ, request_time):
        """Do nothing: the request line is the app's (``telemetry.observer``)."""


logger_class = AppLogsRequests
# Request line and header limits (bytes, count); the body limit is MAX_BODY_BYTES in the app.
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190


# gunicorn's control socket, one per API port so two servers on a host never take over each other's
# (GUNICORN_CONTROL_SOCKET; the default is one shared path per user).
control_socket = os.environ.get("GUNICORN_CONTROL_SOCKET") or os.path.join(
    tempfile.gettempdir(), f"greenserve-{_server.port}.ctl"
)


def _check_config_or_exit():
    """Fail fast, once, in the master: a bad setting, model directory or models file, or models
    over ``MEMORY_BUDGET_MB``, is one clear line on stderr and exit code 1, not a traceback from
    every worker. Workers load the models again for themselves (memory-mapped, so this costs
    little). The history database is checked, not created: the workers may run as another user
    (gunicorn's ``user``)."""
    import socket

    from wsgi_app.models_file import write_snapshot
    from wsgi_app.setting_checks import check_stats_db
    from wsgi_app.settings import Settings

    try:
        settings = Settings.from_env()  # also RATE_LIMIT, its storage and the OTLP endpoint
        if settings.faults:
            from wsgi_app.generation.faults import Faults

            Faults.parse(settings.faults)
        try:
            socket.getaddrinfo(_server.host.strip("[]"), None)  # gunicorn binds to each address
        except socket.gaierror as exc:
            raise ValueError(f"HOST cannot be resolved: {_server.host!r} ({exc.strerror})") from exc
        check_stats_db(settings.stats_db)
        if not settings.responses_redis_url:
            check_stats_db(settings.responses_db, "RESPONSES_DB")
        models = _checked_models(settings)
        if models.path is not None and _made_metrics_dir is not None:
            # The workers serve from the last good file, which a reload replaces only once checked.
            snapshot = os.path.join(_made_metrics_dir, MODELS_SNAPSHOT)
            write_snapshot(models, snapshot)
            os.environ["GREENSERVE_MODELS_SNAPSHOT"] = snapshot
    except ValueError as exc:
        _cannot_start(exc)


def _checked_models(settings):
    """Check the models as a worker will load them (``wsgi_app.model_set.check_models``), logging
    before each GGUF loads; return the models.

    Raises:
        ValueError: one line naming the setting, the file and the entry.
    """
    from wsgi_app.model_set import check_models

    return check_models(settings, before_load=_log_gguf_loading)


def on_reload(server):
    """On ``SIGHUP``, before the new workers start: number their generation, so that they take
    over from the old ones without a gap (``wsgi_app.server.handoff``); check the models file again
    and apply it (the new workers serve it) only when every check passes; otherwise log one line
    saying why and let the new workers serve the last good one, so that a bad edit never stops the
    server (gunicorn halts when a new worker fails to boot). Without ``MODELS_FILE`` no file is
    checked.

    Source: gunicorn's arbiter, ``reload`` (``on_reload`` runs before it spawns the new workers).
    """
    import logging

    from wsgi_app.models_file import write_snapshot
    from wsgi_app.server.handoff import next_generation
    from wsgi_app.settings import Settings

    log = logging.getLogger("greenserve.start")
    if _made_metrics_dir is not None:  # the new workers take over from the old (server.handoff)
        try:
            current = ServerSettings.from_env().generation
            generation = next_generation(_made_metrics_dir, current)
            os.environ["GREENSERVE_GENERATION"] = str(generation)
        except OSError as exc:  # the old workers then stop at once, as gunicorn's own reload
            log.error("no hand-off to the new workers: %s", exc)
    snapshot = os.environ.get("GREENSERVE_MODELS_SNAPSHOT")
    if not snapshot:
        return
    try:
        models = _checked_models(Settings.from_env())
        write_snapshot(models, snapshot)
    except (ValueError, OSError) as exc:
        log.error("models file not applied, the last good one is served: %s", exc)
        return
    log.info(
        "models file applied", extra={"models": list(dict.fromkeys(e.name for e in models.entries))}
    )


def _check_ports_free(addresses):
    """Fail fast when a port to bind is taken: one line naming the port and its setting, exit code 1.

    gunicorn itself retries a busy address five times, a second apart, and then logs "Can't connect
    to ...". Skipped when the listeners are inherited (``GUNICORN_FD`` in a SIGUSR2 upgrade, systemd's
    ``LISTEN_FDS``): the old master still holds them. Port 0 and Unix sockets are never busy here.

    Args:
        addresses: gunicorn's parsed binds (``server.cfg.address``): ``(host, port)`` tuples or paths.
    """
    import errno
    import socket

    if os.environ.get("GUNICORN_FD") or os.environ.get("LISTEN_FDS"):
        return
    for address in addresses:
        if not isinstance(address, tuple) or not address[1]:
            continue
        host, port = address[0], address[1]
        setting = {_server.port: "PORT", _server.health_port: "HEALTH_PORT"}.get(port, "--bind")
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue  # named in the HOST check below
        family, kind, proto, _, sockaddr = infos[0]
        probe = socket.socket(family, kind, proto)
        try:
            # The same option gunicorn binds with, so a port in TIME_WAIT is not taken for busy.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"already in use; stop what listens there or set {setting} to a free port"
            else:
                why = f"cannot be bound ({exc.strerror}); check HOST and {setting}"
            _cannot_start(ValueError(f"port {port} on {host or '*'} ({setting}={port}) {why}"))
        finally:
            probe.close()


def _log_gguf_loading(path):
    """Log one line before a GGUF loads in the master: hashing it and, on the first start only,
    building its float32 weights cache take seconds (SmolLM2-135M: ~18 s on one core), and the
    workers then map that cache file. Nothing is logged for a model directory (``path`` None)."""
    if path is None:
        return
    import logging

    from model.loader import default_cache_dir

    logging.getLogger("greenserve.start").info(
        "loading %s: hashing, packed weights cache at %s",
        path,
        default_cache_dir() / "gguf",
        extra={"model_file": str(path), "weights_cache_dir": str(default_cache_dir() / "gguf")},
    )


def on_starting(server):
    """Check the settings and the model, clear what earlier servers left in the operator's metrics
    directory, and pick the client-hash salt that every worker shares (CLIENT_HASH_SALT, else a new
    random one per server start). Whatever fails, the metrics dir this master made is removed (a
    restart loop must not fill the temp dir)."""
    import secrets

    try:
        _check_ports_free(server.cfg.address)
        _check_config_or_exit()
        _clear_metrics_base()
    except BaseException:
        _remove_made_metrics_dir()
        raise
    os.environ.setdefault("CLIENT_HASH_SALT", secrets.token_hex(16))


def _clear_metrics_base() -> None:
    """On a fresh start (not a ``USR2`` upgrade, whose old master still serves beside this one),
    remove what earlier servers left in the operator's ``PROMETHEUS_MULTIPROC_DIR``: other masters'
    ``master-*`` directories and files of the older flat layout (``*.db``, the drain marker). This
    master's counters count from its start in its own directory whatever it finds."""
    import glob
    import shutil

    base = os.environ.get("GREENSERVE_METRICS_BASE")
    if not base or os.environ.get("GUNICORN_PID") or not os.path.isdir(base):
        return
    for path in glob.glob(os.path.join(base, "master-*")):
        if path != _made_metrics_dir:
            shutil.rmtree(path, ignore_errors=True)
    for path in [*glob.glob(os.path.join(base, "*.db")), os.path.join(base, "greenserve-drained")]:
        if os.path.isfile(path):
            os.remove(path)


def post_fork(server, worker):
    """Hold the stop signals in the new worker until its own handlers are in place: one sent before
    (the master stopping as the worker boots) is then delivered to them
    (``wsgi_app.server.early_signals``)."""
    hold = getattr(worker, "hold_stop_signals", None)  # a worker class that also releases them
    if hold is not None:
        hold(server)


def child_exit(server, worker):
    """Count the requests a worker that died without its exit hook was serving (one log line, and
    ``greenserve_requests_total{end_reason="worker_lost"}``: ``telemetry.lost``), then drop its
    live gauges (running, queued) from /metrics, however it died."""
    from prometheus_client import multiprocess

    from telemetry.lost import count_lost
    from wsgi_app.server.end_reason import WORKER_LOST

    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:
        count_lost(metrics_dir, worker.pid, WORKER_LOST)
    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    """Remove the metrics dir this config made (never one the operator provided)."""
    import shutil

    own = os.environ.get("GREENSERVE_OWN_METRICS_DIR")
    if own and own == os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(own, ignore_errors=True)


def worker_exit(server, worker):
    """Flush the worker's pending spans and history before it exits (generators' ``finally`` may
    never run)."""
    app = getattr(worker, "wsgi", None)
    state = getattr(app, "extensions", {}).get("greenserve") if app is not None else None
    if state is not None:
        # Within what is left of the grace period (wsgi_app.server.worker keeps some for this hook).
        budget = getattr(worker, "exit_budget_s", lambda cap_s: cap_s)
        state.exporter.shutdown(budget(5.0))
        if state.observer is not None:
            state.observer.close()
            # Every request of a worker that reaches this hook was answered or logged: none is
            # lost with it (the master counts a dead worker's last running and queued gauges).
            state.observer.metrics.clear_load()


def _address(sock, scheme):
    """Name a bound socket as gunicorn's "Listening at" does: ``http://host:port`` or ``unix:path``."""
    import socket

    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _health_port(worker):
    """Return the port of the health socket (the second bind), or None (no second TCP bind)."""
    if len(worker.sockets) < 2:
        return None
    name = worker.sockets[1].getsockname()
    return name[1] if isinstance(name, tuple) else None


def _log_serving(worker, state):
    """Log one line saying which models this worker serves (the default one first), and which
    address is which port (the first bind is the API port, the second the health port)."""
    import logging

    scheme = "https" if worker.cfg.is_ssl else "http"
    addresses = [_address(sock, scheme) for sock in worker.sockets]
    default = state.models.default
    logging.getLogger("greenserve.start").info(
        "serving",
        extra={
            "model": default.name,  # the id /v1/models lists
            "model_kind": default.model.engine_kind,
            "model_version": default.model_version,  # X-Model-Version
            "models": [served.name for served in state.models.primaries],
            "api_address": addresses[0] if addresses else None,
            "health_address": addresses[1] if len(addresses) > 1 else None,
        },
    )


def _announce_new_master() -> None:
    """After an upgrade (``kill -USR2``), tell systemd that the new master is the service's main
    process once its first worker serves: gunicorn re-executes as a child of the old master and only
    sends ``READY=1``, so without ``MAINPID`` systemd would stop the service when the old master exits.

    Only a worker of a re-executed master that is not yet promoted has ``GUNICORN_PID`` (the old
    master's pid) in its environment. Needs ``NotifyAccess=all`` in the unit.

    Source: sd_notify(3), ``MAINPID=``.
    """
    if os.environ.get("GUNICORN_PID") and os.environ.get("NOTIFY_SOCKET"):
        import logging

        from gunicorn import systemd

        systemd.sd_notify(f"MAINPID={os.getppid()}", logging.getLogger("greenserve.start"))


def post_worker_init(worker):
    """Have the app learn of the worker's stop, so that it can end its streams with a final event
    before ``graceful_timeout`` runs out (gunicorn only flips ``worker.alive``); give the worker the
    app's answers to health probes; log what the worker serves; then freeze the start-up objects out
    of the garbage collector's generations."""
    state = worker.wsgi.extensions["greenserve"]
    from wsgi_app.server.gunicorn_errors import install_json_errors

    install_json_errors(state.model_version)  # requests gunicorn cannot parse: JSON, not HTML
    from wsgi_app.http.probes import AppProbes

    # The worker answers plain health probes itself, with the app's answers (wsgi_app.server.probes).
    worker.probes = AppProbes(state)
    if state.observer is not None:
        state.observer.flusher.start()  # history and the /stats heartbeat, from the first second
        # Finished requests are observed in batches on the event loop's next turn, off their path.
        from gevent import get_hub

        state.observer.defer = get_hub().loop.run_callback
    # The app stops when the worker's graceful stop begins: at SIGTERM, or for a reload's SIGTERM
    # once a new worker is ready (wsgi_app.server.handoff).
    worker.when_stopping(lambda: state.begin_shutdown(worker.cfg.graceful_timeout))
    state.health_port = _health_port(worker)
    _log_serving(worker, state)
    _announce_new_master()
    # Everything loaded so far (modules, Flask, numpy, the model) lives as long as the worker: move it
    # out of the collector's reach, so each full collection no longer walks ~55,000 objects (~7 ms).
    import gc

    gc.freeze()
