"""gunicorn configuration for greenserve: ``gunicorn -c gunicorn.conf.py``.

Plain names, each with its unit and environment override. Nothing heavy is imported here: gunicorn loads
this file in the master before gevent patches the workers, and the model is loaded per worker by the app
factory (no ``preload_app``), so each worker owns its model and its span exporter.
"""

import os
import tempfile

from gunicorn.glogging import Logger

from telemetry.logs import logging_config

# numpy reads this at import; one BLAS thread per worker, the workers are the parallelism.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR): every worker writes its metrics to
# files here and /metrics sums them. prometheus_client decides at import, so this is set before any
# worker imports it; when unset, a private temp dir is made and removed when the master exits.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="greenserve-metrics-")
    os.environ["GREENSERVE_OWN_METRICS_DIR"] = os.environ["PROMETHEUS_MULTIPROC_DIR"]


def _usable_cpus() -> int:
    """CPUs this container may really use: the cgroup CPU quota first, then the affinity mask."""
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]  # cgroup v2
        if quota != "max":
            return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read())  # cgroup v1
        period = int(open("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read())
        if quota > 0 and period > 0:
            return max(1, -(-quota // period))
    except (OSError, ValueError):
        pass
    return len(os.sched_getaffinity(0)) or 1


_host = os.environ.get("HOST", "0.0.0.0")
_port = int(os.environ.get("PORT", "8000"))
_health_port = int(os.environ.get("HEALTH_PORT", "9464"))

# The API port, and the health port for probes and scrapes (HEALTH_PORT=0 disables it).
bind = [f"{_host}:{_port}"] + ([f"{_host}:{_health_port}"] if _health_port else [])
# Worker processes (WEB_CONCURRENCY); default: the usable CPUs.
workers = int(os.environ.get("WEB_CONCURRENCY", "0")) or _usable_cpus()
# Every connection is a greenlet: gunicorn's gevent worker with a cheaper sendall (wsgi_app.worker).
worker_class = "wsgi_app.worker.GeventWorker"
# Simultaneous connections per worker (WORKER_CONNECTIONS), streams and idle keep-alives alike.
worker_connections = int(os.environ.get("WORKER_CONNECTIONS", "1000"))
# The app factory runs in each worker, after gevent's monkey-patching.
wsgi_app = "wsgi_app:create_app()"
preload_app = False
# Seconds a worker may go without notifying the arbiter. Under gevent this bounds hub stalls (CPU work
# that never yields), not request length: requests have their own deadline (REQUEST_TIMEOUT_S).
timeout = int(os.environ.get("GUNICORN_TIMEOUT_S", "30"))
# Seconds in-flight streams get to finish after SIGTERM before the worker is killed.
graceful_timeout = int(os.environ.get("GRACEFUL_TIMEOUT_S", "30"))
# Seconds an idle keep-alive connection is held open.
keepalive = int(os.environ.get("KEEPALIVE_S", "5"))
# Worker recycling would cut in-flight streams.
max_requests = 0
# gunicorn's own log to stderr; the app writes one JSON line per request, so no access log.
errorlog = "-"
loglevel = os.environ.get("LOG_LEVEL", "info")
accesslog = None
# Every log line, gunicorn's and the app's, is one JSON object on stderr (LOG_LEVEL sets the level).
logconfig_dict = logging_config(loglevel)


class AppLogsRequests(Logger):
    """gunicorn's logger without its access log: the app writes a fuller JSON line per request, and
    with ``logconfig_dict`` set gunicorn would otherwise build (then drop) access fields every time."""

    def access(self, resp, req, environ, request_time):
        """Do nothing: the request line is the app's (``wsgi_app.observe``)."""


logger_class = AppLogsRequests
# Request line and header limits (bytes, count); the body limit is MAX_BODY_BYTES in the app.
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190


# gunicorn's control socket, one per API port so two servers on a host never take over each other's
# (GUNICORN_CONTROL_SOCKET; the default is one shared path per user).
control_socket = os.environ.get("GUNICORN_CONTROL_SOCKET") or os.path.join(
    tempfile.gettempdir(), f"greenserve-{_port}.ctl"
)


def _check_config_or_exit():
    """Fail fast, once, in the master: a bad setting or model directory is one clear line on stderr
    and exit code 1, not a traceback from every worker. Workers load the model again for themselves
    (memory-mapped, so this costs little)."""
    import sys

    from model.loader import load_model
    from wsgi_app.settings import Settings

    try:
        settings = Settings.from_env()
        load_model(settings.model_dir)
    except ValueError as exc:
        print(f"greenserve: cannot start: {exc}", file=sys.stderr)
        sys.exit(1)


def on_starting(server):
    """Check the settings and the model, start from empty metrics (counters count from this start)
    and pick the client-hash salt that every worker shares (CLIENT_HASH_SALT, else a new random one
    per server start)."""
    import glob
    import secrets

    _check_config_or_exit()

    for path in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
        os.remove(path)
    os.environ.setdefault("CLIENT_HASH_SALT", secrets.token_hex(16))


def child_exit(server, worker):
    """Drop a dead worker's live gauges (running, queued) from /metrics, however it died."""
    from prometheus_client import multiprocess

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
        state.exporter.shutdown(5.0)
        if state.observer is not None:
            state.observer.close()


def post_worker_init(worker):
    """Chain the worker's SIGTERM handler so the app learns of the stop and can end its streams with
    a final event before ``graceful_timeout`` runs out (gunicorn only flips ``worker.alive``); then
    freeze the start-up objects out of the garbage collector's generations."""
    import signal

    state = worker.wsgi.extensions["greenserve"]
    from wsgi_app.wire_errors import install_json_errors

    install_json_errors(state.model_version)  # requests gunicorn cannot parse: JSON, not HTML
    if state.observer is not None:
        state.observer.flusher.start()  # history and the /stats heartbeat, from the first second
    gunicorn_handler = worker.handle_exit

    def handle_exit(sig, frame):
        state.begin_shutdown(worker.cfg.graceful_timeout)
        gunicorn_handler(sig, frame)

    signal.signal(signal.SIGTERM, handle_exit)
    # Everything loaded so far (modules, Flask, numpy, the model) lives as long as the worker: move it
    # out of the collector's reach, so each full collection no longer walks ~55,000 objects (~7 ms).
    import gc

    gc.freeze()
