"""A reload's hand-off between two generations of workers (``wsgi_app.server.handoff``), in one
process: ``flock`` locks belong to each open file description, so two ``Handoff`` objects conflict as
two workers would. The hand-off over real servers is tested in ``tests/test_models_reload.py``."""

from __future__ import annotations

import subprocess
import sys

from wsgi_app.server.handoff import Handoff, next_generation


def test_an_old_worker_hands_off_once_a_new_one_is_ready(tmp_path):
    old, new = Handoff(str(tmp_path), 0), Handoff(str(tmp_path), 1)
    old.ready()
    assert old.accepting and not old.reloading()  # a stop now is not a reload's: at once
    assert next_generation(str(tmp_path), 0) == 1
    assert old.newest() == 1 and old.reloading() and not old.newer_ready()
    assert new.older_accepting()  # the new worker waits for the old one's listeners
    new.ready()
    assert old.newer_ready()  # the old one stops now...
    assert new.older_accepting()
    old.stopped_accepting()  # ...and once its listeners are closed the new one accepts
    assert not old.accepting and not new.older_accepting()
    assert not new.reloading()  # the newest generation: its stop is at once


def test_a_worker_that_died_holds_nobody_up(tmp_path):
    code = (
        "import sys; from wsgi_app.server.handoff import Handoff; "
        f"Handoff({str(tmp_path)!r}, 0).ready(); sys.exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not Handoff(str(tmp_path), 1).older_accepting()


def test_a_worker_not_accepting_never_waits_for_a_reload(tmp_path):
    booting = Handoff(str(tmp_path), 0)  # stopped by a reload before its models were loaded
    next_generation(str(tmp_path), 0)
    assert not booting.reloading()
