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
    gevent.sleep(0.001)  # the hub got back: nothing waits, the watchers are stopped
    turns = turn._turns
    idle = turns.idle
    assert not idle.active and not turns.timer.active
    turn()
    gevent.sleep(0.001)
    assert HubTurn(1.0)._turns is None  # made on the first turn, then shared by the hub's turns
    assert turn._turns.idle is idle
    assert not idle.active and not turns.timer.active


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
        lambda: turn._turns and turn._turns.idle.active,
        5,
        "g to wait in its turn",
        sleep=gevent.sleep,
    )
    g.kill()
    h.kill()
    assert not turn._turns.waiting
    assert not turn._turns.idle.active and not turn._turns.timer.active


def test_new_connections_wait_for_the_poll_budget_not_a_round_of_every_stream():
    # 100 streams of 1 ms slices: a round takes ~100 ms, but the hub polls every ~POLL_S (2 ms), so a
    # timer (a new connection, a probe) fires within a few ms of its due time.
    stop = []

    def stream() -> None:
        turn = HubTurn(1.0)
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


def test_no_stream_waits_much_past_the_cap_when_the_hub_is_rarely_idle():
    # The hub goes idle only every ~10 ms (a closed loop of short requests keeps it busy), and an
    # idle turn serves only POLL_S of streams: 20 streams of 1 ms would wait ~100 ms for their next
    # turn; once the oldest has waited the cap (30 ms), a forced round serves them all.
    stop = []
    gaps: list[float] = []

    def busy() -> None:
        while not stop:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.01:
                gevent.sleep(0)  # pending work all along: no idle turn
            gevent.sleep(0.0005)  # a moment with nothing pending

    def stream() -> None:
        turn = HubTurn(0.03)
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
    assert gaps[int(0.99 * len(gaps))] < 0.075, gaps[-5:]  # cap + a round of 20 ms + slack


def test_streams_take_turns_in_order():
    order = []
    stop = []

    def stream(i: int) -> None:
        turn = HubTurn(1.0)
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
