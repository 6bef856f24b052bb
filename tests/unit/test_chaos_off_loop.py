"""A broker fault's CLI calls run off the chaos run's loop. rabbitmqctl boots an Erlang VM
of its own, which beside fsync-heavy writers once took 61.6 s: called from the loop, it
held every other fault's end (an overload due to end after 10 s lasted 70) and the
faults queued behind it then landed at once. Nothing is started, so no service is
needed: the broker is a function that answers when the test lets it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from harness.background import OffLoop
from harness.faults import FAULTS
from harness.parameters import BROKER_DOWN_SECONDS
from harness.run import Chaos
from harness.schedule import ScheduledFault

from support.chaos_runs import idle_chaos
from support.waiting import eventually_sync

DEADLINE_SECONDS = 30.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    eventually_sync(condition, within=DEADLINE_SECONDS, what=what)


class HeldBroker:
    """A broker control whose calls return only when the test releases them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    def __call__(self, *args: str) -> str | None:
        self.calls.append(args[0])
        if not self.release.wait(DEADLINE_SECONDS):
            return None
        return ""


def chaos_with(control: HeldBroker) -> Chaos:
    return idle_chaos(
        broker_control=control,
        timings={"faults": 0.0, "broker_calls": 0.0},
        stream_start=time.monotonic(),
    )


def test_the_faults_that_call_rabbitmqctl_are_the_ones_run_off_the_loop() -> None:
    assert {kind for kind, fault in FAULTS.items() if fault.off_loop} == {
        "broker_connection_close",
        "broker_restart",
    }


def test_a_held_broker_call_lets_other_faults_end_on_time() -> None:
    broker = HeldBroker()
    chaos = chaos_with(broker)
    overload_ended = threading.Event()
    chaos.lasting("cpu_starvation", 0.0, overload_ended.set)

    chaos._inject(ScheduledFault(0.0, "broker_restart", 0), 0.0)
    wait_until(lambda: broker.calls == ["stop_app"], "stop_app to be called")
    # The loop goes on while stop_app is held: the overload ends when due.
    chaos._tend(time.monotonic())
    assert overload_ended.is_set()
    assert chaos.off_loop.busy()
    assert chaos._faults_last(), "the stream must not end under a broker call"
    assert chaos.tally.broker_restarts == 0

    broker.release.set()
    wait_until(lambda: chaos.tally.broker_restarts == 1, "stop_app to return")
    chaos._tend(time.monotonic())
    assert not chaos.off_loop.busy()
    assert "broker_restart" in chaos.endings

    # Its end (start_app) runs off the loop too, and the fault is over when it returns.
    before = chaos.faults_ended_monotonic
    chaos._tend(time.monotonic() + BROKER_DOWN_SECONDS)
    assert "broker_restart" not in chaos.endings
    wait_until(lambda: broker.calls == ["stop_app", "start_app"], "start_app to be called")
    wait_until(lambda: _ran(chaos), "start_app's end to be taken")
    assert chaos.faults_ended_monotonic > before
    chaos.stop()


def _ran(chaos: Chaos) -> bool:
    chaos._tend(time.monotonic())
    return not chaos.off_loop.busy()


def test_no_cpu_starvation_starts_while_a_broker_call_is_under_way() -> None:
    broker = HeldBroker()
    chaos = chaos_with(broker)
    chaos._inject(ScheduledFault(0.0, "broker_restart", 0), 0.0)
    wait_until(lambda: broker.calls == ["stop_app"], "stop_app to be called")
    # start_app would starve beside the hogs: the two take turns.
    assert FAULTS["cpu_starvation"].inject(chaos, ScheduledFault(0.0, "cpu_starvation", 0)) is False
    assert chaos.hogs == []
    broker.release.set()
    chaos.stop()
    assert broker.calls == ["stop_app", "start_app"], "stop() starts a broker it stopped"


def test_results_are_taken_in_the_order_the_calls_were_made() -> None:
    off_loop = OffLoop()
    first_may_return = threading.Event()
    taken: list[str] = []
    off_loop.submit(lambda: first_may_return.wait(DEADLINE_SECONDS), lambda _: taken.append("1"))
    off_loop.submit(lambda: "2", taken.append)
    off_loop.run_finished()
    assert taken == [], "the second result overtook the first"
    first_may_return.set()

    def both() -> bool:
        off_loop.run_finished()
        return taken == ["1", "2"]

    wait_until(both, "both results")
    assert not off_loop.busy()
    off_loop.close()


def test_a_failed_call_raises_on_the_loop() -> None:
    off_loop = OffLoop()

    def start_app() -> None:
        raise RuntimeError("rabbitmqctl start_app failed; start the broker by hand")

    def taken() -> bool:
        off_loop.run_finished()
        return not off_loop.busy()

    off_loop.submit(start_app, lambda _: None)
    with pytest.raises(RuntimeError, match="start the broker by hand"):
        wait_until(taken, "the failure")
    off_loop.close()


def test_the_cpu_hogs_wait_their_turn_behind_a_broker_call_without_using_their_tries() -> None:
    broker = HeldBroker()
    chaos = chaos_with(broker)
    hogs = ScheduledFault(5.0, "cpu_starvation", 0)
    chaos.retries[hogs] = 3
    chaos._inject(ScheduledFault(0.0, "broker_restart", 0), 0.0)
    wait_until(lambda: broker.calls == ["stop_app"], "stop_app to be called")

    assert chaos._waits_its_turn(hogs)
    chaos._postpone(hogs, 5.0)
    assert [(f.kind, f.at) for f in chaos.pending] == [("cpu_starvation", 6.0)]
    assert chaos.retries[chaos.pending[0]] == 3, "waiting its turn is not a try"

    broker.release.set()
    wait_until(lambda: _ran(chaos), "stop_app's end to be taken")
    # The broker is stopped until start_app: still not the hogs' turn.
    assert chaos._waits_its_turn(hogs)
    chaos.stop()


def test_the_broker_faults_wait_their_turn_behind_the_cpu_hogs() -> None:
    chaos = chaos_with(HeldBroker())
    chaos.hogs = [cast(Any, object())]

    assert chaos._waits_its_turn(ScheduledFault(0.0, "broker_restart", 0))
    assert chaos._waits_its_turn(ScheduledFault(0.0, "broker_connection_close", 2))
    assert not chaos._waits_its_turn(ScheduledFault(0.0, "consumer_kill", 1))
    chaos.hogs = []
    assert not chaos._waits_its_turn(ScheduledFault(0.0, "broker_restart", 0))


def test_a_broker_connection_close_waits_for_a_broker_restart_without_using_its_tries() -> None:
    chaos = chaos_with(HeldBroker())
    close = ScheduledFault(0.0, "broker_connection_close", 1)

    assert not chaos._waits_its_turn(close)
    chaos.lasting("broker_restart", 60.0, lambda: None)
    assert chaos._waits_its_turn(close)
    chaos.stop()


def test_past_the_stream_only_a_fault_that_needs_no_work_keeps_trying() -> None:
    """A daemon's broker connection comes back whatever the decisions do; a refund held
    by the provider needs decisions still in flight."""
    chaos = chaos_with(HeldBroker())
    chaos.retry_until = 0.0  # the stream's last decision is long past
    close = ScheduledFault(0.0, "broker_connection_close", 1)
    kill_in_effect = ScheduledFault(0.0, "consumer_kill_in_effect", 0)
    chaos.retries[close] = chaos.retries[kill_in_effect] = 0

    chaos._injected(close, 0.0, acted=False)
    chaos._injected(kill_in_effect, 0.0, acted=False)

    assert [f.kind for f in chaos.pending] == ["broker_connection_close"]
    assert chaos.retries[chaos.pending[0]] == 1
    assert chaos.tally.faults_that_found_nothing == 1
    assert {kind for kind, fault in FAULTS.items() if fault.needs_no_work} == {
        "broker_connection_close"
    }
    chaos.stop()
