"""HubTurn: a generating greenlet lets pending work go first, and is never starved."""

import time

import gevent
import pytest

from tests.server import wait_until
from wsgi_app.generation.hubturn import HubTurn
from wsgi_app.generation.pacer import HUB_ROUND_S, HUB_SLICE_S, hub_slice


def test_pending_greenlets_run_before_the_turn_returns():
    order = []
    gevent.spawn(order.append, "new request")
    gevent.spawn(order.append, "probe")
    HubTurn()()
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
    turn = HubTurn()
    turn()  # an idle watcher would wait for as long as busy() runs: the check watcher runs each poll
    stop.append(True)
    g.join()
    assert len(spins) > 1


def test_watchers_are_stopped_between_turns_and_reused():
    turn = HubTurn()
    turn()
    gevent.sleep(0.001)  # the hub got back: nothing waits, the watchers are stopped
    turns = turn._turns
    check, idle = turns.check, turns.idle
    assert not check.active and not idle.active
    turn()
    gevent.sleep(0.001)
    assert HubTurn()._turns is None  # made on the first turn, then shared by the hub's turns
    assert turn._turns.check is check and turn._turns.idle is idle
    assert not check.active and not idle.active


def test_a_killed_greenlet_stops_its_watchers():
    turn = HubTurn()

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
        lambda: turn._turns and turn._turns.check.active,
        5,
        "g to wait in its turn",
        sleep=gevent.sleep,
    )
    g.kill()
    h.kill()
    assert not turn._turns.waiting
    assert not turn._turns.check.active and not turn._turns.idle.active


def test_new_connections_wait_for_the_poll_budget_not_a_round_of_every_stream():
    # 100 streams of 1 ms slices: a round takes ~100 ms, but the hub polls after every ~POLL_S (one
    # slice here), so a timer (a new connection, a probe) fires within a few ms of its due time.
    stop = []

    def stream() -> None:
        turn = HubTurn()
        while not stop:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.001:
                pass
            turn()

    streams = [gevent.spawn(stream) for _ in range(100)]
    gevent.sleep(0.3)  # past the start, when every new greenlet runs its first slice at once
    late = []
    for _ in range(10):
        due = time.perf_counter() + 0.01
        gevent.sleep(0.01)
        late.append(time.perf_counter() - due)
    stop.append(True)
    gevent.joinall(streams)
    assert max(late) < 0.03, late  # a full round would be ~0.1 s


def test_streams_keep_their_turns_while_every_poll_finds_pending_work():
    # A closed loop of short requests leaves some event pending at every poll, so an idle watcher
    # would starve the streams: the check watcher still serves POLL_S of them after every poll, and
    # a round of 20 streams of 1 ms takes ~20 ms plus the busy work between polls.
    stop = []
    gaps: list[float] = []

    def busy() -> None:
        while not stop:
            gevent.sleep(0)  # pending work all along

    def stream() -> None:
        turn = HubTurn()
        last = time.perf_counter()
        while not stop:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.001:
                pass
            turn()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    gs = [gevent.spawn(busy)] + [gevent.spawn(stream) for _ in range(20)]
    gevent.sleep(0.5)
    stop.append(True)
    gevent.joinall(gs)
    gaps.sort()
    assert len(gaps) > 200  # ~25 rounds of 20 streams in 0.5 s, not a few forced ones
    assert gaps[int(0.99 * len(gaps))] < 0.05, gaps[-5:]  # a round of 20 ms + slack


def test_streams_take_turns_in_order():
    order = []
    stop = []

    def stream(i: int) -> None:
        turn = HubTurn()
        while not stop:
            order.append(i)
            turn()

    gs = [gevent.spawn(stream, i) for i in range(4)]
    while len(order) < 40:
        gevent.sleep(0.001)
    stop.append(True)
    gevent.joinall(gs)
    assert order[:40] == [0, 1, 2, 3] * 10


@pytest.mark.parametrize(
    ("busy", "expected"),
    [(0, HUB_SLICE_S), (1, HUB_SLICE_S), (20, HUB_SLICE_S), (128, HUB_ROUND_S / 128)],
)
def test_the_slice_shrinks_with_the_busy_slots(busy, expected):
    assert hub_slice(busy) == expected
    assert hub_slice(1000) == HUB_ROUND_S / 1000
