"""HubTurn: a generating greenlet lets pending work go first, and is never starved; new connections'
set-ups (setup_turn) go first in each pass, a poll's share at a time."""

import time

import gevent
import pytest

from telemetry.spans import start_server_span
from tests.server import wait_until
from wsgi_app.generation.admission import Admission
from wsgi_app.generation.context import StopClock
from wsgi_app.generation.pacer import HUB_ROUND_S, HUB_SLICE_S, Pacer, hub_slice
from wsgi_app.generation.record import RequestRecord
from wsgi_app.server.hubturn import MAX_SHARE_S, SETUP_SHARE_S, HubTurn, setup_turn


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


def spin(slice_s: float) -> None:
    """Hold the hub for ``slice_s`` seconds of wall time (a slice of token work)."""
    started = time.perf_counter()
    while time.perf_counter() - started < slice_s:
        pass


# The checks below count slices, not seconds: a slice lasts 1 ms of wall time however busy the
# machine is (it spins on the clock), so how many slices run before something is served measures the
# hub's order, and another process taking the CPU meanwhile lengthens one slice, not the count.
SLICE_S = 0.001


def test_new_connections_wait_for_the_poll_budget_not_a_round_of_every_stream():
    # 100 streams of 1 ms slices: a round is 100 slices, but the hub polls after every POLL_S of
    # them (one slice here, up to MAX_SHARE_S: 10), so a timer (a new connection, a probe) due in
    # 10 ms fires after about 10 slices plus one poll's share, never after a round.
    stop = []
    slices = [0]

    def stream() -> None:
        turn = HubTurn()
        while not stop:
            spin(SLICE_S)
            slices[0] += 1
            turn()

    streams = [gevent.spawn(stream) for _ in range(100)]
    # Past the start, when every new greenlet runs its first slice at once.
    wait_until(lambda: slices[0] >= 300, 30, "three rounds of slices", sleep=gevent.sleep)
    waited = []
    for _ in range(10):
        before = slices[0]
        gevent.sleep(0.01)
        waited.append(slices[0] - before)
    stop.append(True)
    gevent.joinall(streams)
    # 10 slices are due; at most one MAX_SHARE_S share (10 slices) more per poll: a round is 100.
    assert max(waited) <= 10 + 2 * MAX_SHARE_S / SLICE_S, waited


def test_streams_keep_their_turns_while_every_poll_finds_pending_work():
    # A closed loop of short requests leaves some event pending at every poll, so an idle watcher
    # would starve the streams (no turn until the busy work stops): the check watcher serves the
    # waiting streams after every poll, in their FIFO order, and the busy work still runs between.
    stop = []
    order: list[int | str] = []

    def busy() -> None:
        while not stop:
            order.append("busy")
            gevent.sleep(0)  # pending work all along

    def stream(i: int) -> None:
        turn = HubTurn()
        while not stop:
            spin(SLICE_S)
            order.append(i)
            turn()

    gs = [gevent.spawn(busy)] + [gevent.spawn(stream, i) for i in range(20)]
    rounds = 10
    wait_until(
        lambda: order.count(19) >= rounds,  # starved streams never get there
        30,
        lambda: (
            f"{rounds} rounds of 20 streams; turns per stream: "
            f"{[order.count(i) for i in range(20)]}"
        ),
        sleep=gevent.sleep,
    )
    stop.append(True)
    gevent.joinall(gs)
    turns = [x for x in order if x != "busy"][: 20 * rounds]
    assert turns == list(range(20)) * rounds  # every stream in every round, in FIFO order
    # The pending work was served in every round too (the streams did not take the hub over).
    starts = [k for k, x in enumerate(order) if x == 0][: rounds + 1]
    assert all("busy" in order[a:b] for a, b in zip(starts, starts[1:], strict=False)), starts


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


def test_set_ups_run_a_poll_share_at_a_time_not_all_between_two_polls():
    # 60 new connections whose set-up takes 1 ms each, and a timer (a probe, another connection's
    # I/O) due 5 ms in: started straight from the hub's callbacks, as gevent starts a spawned
    # greenlet, at least 50 set-ups run before the loop looks at its timers again (gevent checks the
    # time every 50 callbacks); queued with setup_turn, the hub polls after each share.
    done: list[int] = []
    fired_after: list[int] = []

    def connection(i: int) -> None:
        setup_turn()
        spin(SLICE_S)
        done.append(i)

    timer = gevent.spawn_later(0.005, lambda: fired_after.append(len(done)))
    gs = [gevent.spawn(connection, i) for i in range(60)]
    gevent.joinall([*gs, timer])
    assert done == list(range(60))  # in arrival order
    # 5 set-ups are due; at most one MAX_SHARE_S share more per poll, never the 50 of a callback run.
    assert fired_after[0] <= 5 + 2 * MAX_SHARE_S / SLICE_S, fired_after


def test_set_ups_go_before_the_streams_in_a_pass():
    order: list[str] = []
    stop = []

    def stream(i: int) -> None:
        turn = HubTurn()
        while not stop:
            order.append(f"stream {i}")
            turn()

    def connection(i: int) -> None:
        setup_turn()
        order.append(f"set-up {i}")

    streams = [gevent.spawn(stream, i) for i in range(3)]
    wait_until(lambda: len(order) >= 6, 5, "two rounds of the streams", sleep=gevent.sleep)
    first = len(order)
    connections = [gevent.spawn(connection, i) for i in range(2)]
    gevent.joinall(connections)
    stop.append(True)
    gevent.joinall(streams)
    # The next pass served both, in arrival order, before any stream's next turn (in a queue of
    # their own; behind the streams' they would come after a round of all three).
    assert order[first : first + 2] == ["set-up 0", "set-up 1"], order[first:]


def test_a_stream_gives_the_hub_a_turn_right_after_its_first_token():
    # A burst of new connections must wait only for each earlier one's set-up, not for its first
    # slice of tokens too: the first token's pacer call yields; later ones wait for their slice.
    ran: list[str] = []
    record = RequestRecord("r", start_server_span("POST /v1/completions", None, {}))
    pacer = Pacer(record, time.perf_counter() + 60, StopClock(), Admission(4, 4), 60.0)
    pacer.start_stream(None)
    gevent.spawn(ran.append, "other")
    pacer()  # the first token
    assert ran == ["other"]
    gevent.spawn(ran.append, "later")
    pacer()  # the second, well inside its slice: no turn
    assert ran == ["other"]
    gevent.sleep(0)
    assert ran == ["other", "later"]


def test_streams_keep_a_share_of_every_pass_while_connections_keep_arriving():
    # A flood of set-ups (each 1 ms, a new one arriving as soon as one is served) must not stop the
    # streams: after each pass's arrivals (up to SETUP_SHARE_S) the streams get at least POLL_S.
    stop = []
    counts = {"set-up": 0, "stream": 0}

    def connection() -> None:
        setup_turn()
        if stop:
            return
        gevent.spawn(connection)  # the next one arrives while this one is set up
        spin(SLICE_S)
        counts["set-up"] += 1

    def stream() -> None:
        turn = HubTurn()
        while not stop:
            spin(SLICE_S)
            counts["stream"] += 1
            turn()

    streams = [gevent.spawn(stream) for _ in range(3)]
    flood = [gevent.spawn(connection) for _ in range(4)]
    wait_until(lambda: counts["set-up"] >= 200, 30, "200 set-ups", sleep=gevent.sleep)
    stop.append(True)
    gevent.joinall(streams + flood)
    # Per pass: at most SETUP_SHARE_S of set-ups (plus the one that crosses it), then >= one slice
    # of the streams.
    most_setups_per_slice = SETUP_SHARE_S / SLICE_S + 1
    assert counts["stream"] >= counts["set-up"] / most_setups_per_slice - 3, counts


def test_while_set_ups_wait_the_streams_get_only_the_poll_share():
    # A burst of 60 set-ups (1 ms each) beside 3 streams, while other work takes 8 ms of every
    # loop iteration (a new connection's head parse, the observation of finished requests: work in
    # the hub's callbacks). Once all arrivals are served, the streams get as long as that rest took
    # (up to MAX_SHARE_S); while arrivals still wait they get only POLL_S (one slice here), so the
    # burst's last first token is not held back by ~8 ms of tokens per pass.
    stop = []
    setups_done: list[int] = []
    turns_in_burst = [0]

    def busy() -> None:
        while not stop:
            spin(0.008)
            gevent.sleep(0)  # back in the next iteration's callbacks

    def stream() -> None:
        turn = HubTurn()
        while not stop:
            spin(SLICE_S)
            if len(setups_done) < 60:
                turns_in_burst[0] += 1
            turn()

    def connection(i: int) -> None:
        setup_turn()
        spin(SLICE_S)
        setups_done.append(i)

    streams = [gevent.spawn(stream) for _ in range(3)]
    other = gevent.spawn(busy)
    gevent.sleep(0.02)
    burst = [gevent.spawn(connection, i) for i in range(60)]
    gevent.joinall(burst)
    stop.append(True)
    gevent.joinall([*streams, other])
    passes = 60 * SLICE_S / SETUP_SHARE_S + 1  # SETUP_SHARE_S of set-ups a pass
    # About one stream turn a pass (POLL_S is one slice), not the ~8 a pass the rest would allow.
    assert turns_in_burst[0] <= 2 * passes + 3, turns_in_burst
