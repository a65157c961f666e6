"""HubTurn: a generating greenlet lets pending work go first, and is never starved for long."""

import time

import gevent
import pytest

from tests.server import wait_until
from wsgi_app.hubturn import HubTurn
from wsgi_app.pacer import HUB_ROUND_S, HUB_SLICE_S, hub_slice


def test_pending_greenlets_run_before_the_turn_returns():
    order = []
    gevent.spawn(order.append, "new request")
    gevent.spawn(order.append, "probe")
    HubTurn(1.0)()
    order.append("stream")
    assert order == ["new request", "probe", "stream"]


def test_a_turn_comes_even_while_other_work_keeps_the_hub_busy():
    spins = []
    stop = []

    def busy() -> None:  # never lets the hub go idle
        while not stop:
            spins.append(1)
            gevent.sleep(0)

    g = gevent.spawn(busy)
    gevent.sleep(0)
    turn = HubTurn(0.02)
    turn()  # an idle watcher alone would wait for as long as busy() runs
    stop.append(True)
    g.join()
    assert len(spins) > 1


def test_a_reused_turn_still_waits_its_full_cap_for_a_busy_hub():
    # libev keeps only the remaining time of a stopped timer: a reused one must be restarted whole.
    turn = HubTurn(0.05)
    stop = []

    def other_stream() -> None:  # runs 5 ms per turn, so each of our turns ends after ~5 ms
        while not stop:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.005:
                pass
            gevent.idle()

    s = gevent.spawn(other_stream)
    for _ in range(20):
        turn()  # ends when the hub is idle, well before the cap: the timer is stopped early
    stop.append(True)
    s.join()
    stop = []

    def hog() -> None:
        while not stop:
            gevent.sleep(0)

    h = gevent.spawn(hog)
    gevent.sleep(0)
    started = time.perf_counter()
    turn()
    waited = time.perf_counter() - started
    stop.append(True)
    h.join()
    assert waited >= 0.025  # the cap (50 ms), not what was left of it (nearly 0)


def test_watchers_are_stopped_between_turns_and_reused():
    turn = HubTurn(1.0)
    turn()
    idle, timer = turn._idle, turn._timer
    assert not idle.active and not timer.active
    turn()
    assert turn._idle is idle and turn._timer is timer
    assert not idle.active and not timer.active


def test_a_killed_greenlet_stops_its_watchers():
    turn = HubTurn(10.0)

    def wait_forever() -> None:
        while True:
            turn()

    def hog() -> None:
        while True:
            gevent.sleep(0)

    h = gevent.spawn(hog)
    g = gevent.spawn(wait_forever)
    # The hog keeps the loop busy, so g's turn stays pending with its watchers started.
    wait_until(
        lambda: turn._idle and turn._idle.active, 5, "g to wait in its turn", sleep=gevent.sleep
    )
    g.kill()
    h.kill()
    assert not turn._idle.active and not turn._timer.active


@pytest.mark.parametrize(
    ("busy", "expected"),
    [(0, HUB_SLICE_S), (1, HUB_SLICE_S), (20, HUB_SLICE_S), (128, HUB_ROUND_S / 128)],
)
def test_the_slice_shrinks_with_the_busy_slots(busy, expected):
    assert hub_slice(busy) == expected
    assert hub_slice(1000) == HUB_ROUND_S / 1000
