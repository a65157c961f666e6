"""The ``greenserve`` command: start gunicorn with the packaged configuration, from any folder.

Every flag is a shorthand for an environment variable (the README's "Settings"); settings without a
flag are read from the environment as always. The command replaces itself with gunicorn
(``os.execvp``), so gunicorn is the process a service manager watches: its ``READY=1`` reaches
systemd, and signals (TERM, HUP, USR2) go straight to it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from model import __version__

CONFIG = "python:wsgi_app.gunicorn_config"

# (flag, environment variable, help): the settings an operator most often sets per host.
FLAGS = (
    ("--model-dir", "MODEL_DIR", "model directory or .gguf file (unset: embedded default model)"),
    ("--host", "HOST", "address both ports bind to (default 0.0.0.0)"),
    ("--port", "PORT", "API port (default 8000)"),
    ("--health-port", "HEALTH_PORT", "health and metrics port (default 9464; 0 disables it)"),
    (
        "--workers",
        "WEB_CONCURRENCY",
        "worker processes, 0..1024 (0 or unset: one per usable CPU)",
    ),
    ("--log-level", "LOG_LEVEL", "debug, info, warning or error (default info)"),
    ("--rate-limit", "RATE_LIMIT", "per-client limit such as 600/minute (default: none)"),
    (
        "--rate-limit-storage-uri",
        "RATE_LIMIT_STORAGE_URI",
        "where limits are counted: memory:// (per worker) or redis://host:port/db",
    ),
    ("--trusted-proxies", "TRUSTED_PROXIES", "X-Forwarded-For hops to trust (1 behind nginx)"),
)  # no flag for API_KEYS: a command line is visible to every user of the host (ps)


def parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``greenserve`` (flags named after their variables)."""
    p = argparse.ArgumentParser(
        prog="greenserve",
        description="Run the greenserve OpenAI-compatible completion server under gunicorn.",
        epilog=(
            "Every flag sets the environment variable named in brackets; every other setting "
            "(MAX_SLOTS, REQUEST_TIMEOUT_S, OTEL_EXPORTER_OTLP_ENDPOINT, ...) is read from the "
            "environment as listed in the README. Arguments after -- go to gunicorn unchanged "
            "(e.g. -- --pid /run/greenserve/gunicorn.pid)."
        ),
    )
    p.add_argument("--version", action="version", version=f"greenserve {__version__}")
    for flag, env, text in FLAGS:
        p.add_argument(flag, metavar=env, help=f"{text} [{env}]")
    p.add_argument(
        "--check-models",
        nargs="?",
        const="",
        metavar="FILE",
        help=(
            "check a models file (default: MODELS_FILE) as a reload will, loading every model, "
            "then exit: 0 when a reload would apply it, 1 with one line saying why not"
        ),
    )
    return p


def gunicorn_argv(extra: Sequence[str]) -> list[str]:
    """Return the gunicorn command line: the ``gunicorn`` script beside this Python, if any.

    gunicorn re-executes its own ``argv`` on ``SIGUSR2`` (upgrades), so the script is named by path:
    ``python -m gunicorn`` would re-execute as ``python .../gunicorn/__main__.py``, which puts
    gunicorn's package folder (and its ``http`` package) ahead of the standard library.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    program = beside if os.access(beside, os.X_OK) else "gunicorn"
    return [program, "-c", CONFIG, *extra]


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Set the flags' environment variables and exec gunicorn; never returns.

    Raises:
        SystemExit: ``--help``, or a flag argparse rejects (exit code 2); an empty flag value
            (exit code 1, one line: an empty variable would mean "unset").
        OSError: gunicorn cannot be executed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    args = parser().parse_args(argv)
    for flag, env, _ in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():
            # An empty variable means "unset" (an empty --model-dir= would serve the bigram).
            print(
                f"greenserve: cannot start: {flag} is empty (omit it for the default)",
                file=sys.stderr,
            )
            sys.exit(1)
        if value is not None:
            os.environ[env] = value  # checked by the configuration, one line naming it if bad
    if args.check_models is not None:
        check_models_file(args.check_models)
    _check_server_settings()
    command = gunicorn_argv(extra)
    os.execvp(command[0], command)


def check_models_file(path: str) -> NoReturn:
    """``--check-models``: check the models file at ``path`` (empty: ``MODELS_FILE``) exactly as
    the master checks it at start and on a reload (``wsgi_app.model_set.check_models``), print one
    line and exit.

    Raises:
        SystemExit: code 0 after ``greenserve: FILE: ok, N models (names)`` on stdout; code 1 after
            ``greenserve: not applied: …`` (the line the reload would log) on stderr.
    """
    from wsgi_app.model_set import check_models
    from wsgi_app.settings import Settings

    if path:
        os.environ["MODELS_FILE"] = path
    try:
        models = check_models(Settings.from_env())
    except ValueError as exc:
        print(f"greenserve: not applied: {exc}", file=sys.stderr)
        sys.exit(1)
    names = list(dict.fromkeys(entry.name for entry in models.entries))
    where = models.path or "MODEL_DIR"
    print(f"greenserve: {where}: ok, {len(names)} models ({', '.join(names)})")
    sys.exit(0)


def _check_server_settings() -> None:
    """Exit with one line naming a bad gunicorn setting, before gunicorn is started.

    gunicorn itself parses ``WEB_CONCURRENCY`` with ``int()`` when it is imported, before any
    configuration file is read: a value such as ``two`` would otherwise end in its traceback.

    Raises:
        SystemExit: code 1 after printing ``greenserve: cannot start: …`` to stderr.
    """
    from wsgi_app.settings import ServerSettings

    try:
        ServerSettings.from_env()
    except ValueError as exc:
        print(f"greenserve: cannot start: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
