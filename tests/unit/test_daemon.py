"""The daemons' shared scaffold: one answer to "is this transient", one backoff, one
session loop (outbox/daemon.py, outbox/backoff.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import timedelta

import aiormq.exceptions
import psycopg
import pytest
import sqlalchemy.exc
from prometheus_client import CollectorRegistry

from outbox.backoff import Backoff, exponential_delay
from outbox.broker import BrokerUnavailable
from outbox.contracts import RetryPolicy
from outbox.daemon import (
    LOCK_WAIT_REPEAT_SECONDS,
    Daemon,
    failed_peer,
    is_transient,
    is_transient_database_error,
)
from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    ReadOnlyDatabase,
    SchemaMissing,
    TransientDatabaseError,
    wrap_database_errors,
)
from outbox.settings import Settings
from outbox.store import LockHolder

from support.logs import logged, records_of

TRANSIENT = [
    (TransientDatabaseError("x"), "database"),
    (psycopg.OperationalError("x"), "database"),
    (sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("x")), "database"),
    (sqlalchemy.exc.InterfaceError("SELECT 1", {}, Exception("x")), "database"),
    (ConnectionRefusedError(), "database"),
    (TimeoutError(), "database"),
    (BrokerUnavailable("x"), "broker"),
    (aiormq.exceptions.AMQPConnectionError("x"), "broker"),
    (aiormq.exceptions.ConnectionClosed(320, "x"), "broker"),
    (aiormq.exceptions.ChannelInvalidStateError("x"), "broker"),
    (aiormq.exceptions.ChannelClosed(), "broker"),
]
NOT_TRANSIENT = [
    ConfigurationError("x"),
    SchemaMissing(),
    DatabaseError("x"),
    ValueError("x"),
    psycopg.errors.UniqueViolation("x"),
    # No new session cures a queue declared with other arguments, or a refused user.
    aiormq.exceptions.ChannelPreconditionFailed(),
    aiormq.exceptions.ChannelAccessRefused(),
]


@pytest.mark.parametrize(("error", "peer"), TRANSIENT, ids=lambda v: type(v).__name__)
def test_transient_failures_are_named_with_the_peer_they_came_from(
    error: BaseException, peer: str
) -> None:
    assert is_transient(error)
    assert failed_peer(error) == peer
    assert is_transient_database_error(error) == (peer == "database")


@pytest.mark.parametrize("error", NOT_TRANSIENT, ids=lambda v: type(v).__name__)
def test_refusals_and_bugs_are_not_transient(error: BaseException) -> None:
    assert not is_transient(error)
    assert not is_transient_database_error(error)


def test_a_read_only_server_is_a_transient_failure_of_its_own() -> None:
    """A standby, or a primary a failover demoted: a new connection (to the writable host
    of the URL's list) cures it, the one in hand never will."""
    with (
        pytest.raises(ReadOnlyDatabase) as refused,
        wrap_database_errors("transition_operation"),
    ):
        raise psycopg.errors.ReadOnlySqlTransaction(
            "cannot execute UPDATE in a read-only transaction"
        )

    assert is_transient_database_error(refused.value)
    assert "SQLSTATE 25006" in str(refused.value)


def test_backoff_doubles_up_to_its_ceiling_within_the_jitter() -> None:
    backoff = Backoff(first=0.2, longest=10.0)

    delays = [backoff.next_delay() for _ in range(9)]

    for attempt, delay in enumerate(delays):
        nominal = min(10.0, 0.2 * 2**attempt)
        assert 0.5 * nominal <= delay <= 1.5 * nominal
    assert backoff.failures == 9


def test_a_very_long_run_of_failures_stays_at_the_ceiling() -> None:
    for multiplier in (1.0, 1.5, 2.0, 10.0):
        delay = exponential_delay(10**6, first=0.2, longest=10.0, multiplier=multiplier, jitter=0)
        assert delay == (0.2 if multiplier == 1.0 else 10.0)


@pytest.mark.parametrize("attempts", [1, 2, 3, 9, 10_000])
def test_a_contracts_retry_policy_draws_the_shared_backoffs_delays(attempts: int) -> None:
    # A contract's retries and the daemons' reconnects wait by one formula: the same
    # draw gives the same delay.
    policy = RetryPolicy(
        initial_backoff=timedelta(seconds=1),
        max_backoff=timedelta(minutes=5),
        multiplier=3.0,
        jitter=0.2,
    )
    shared = exponential_delay(
        attempts, first=1.0, longest=300.0, multiplier=3.0, jitter=0.2, rng=random.Random(7)
    )
    assert policy.backoff(attempts, random.Random(7)).total_seconds() == pytest.approx(shared)


def test_a_session_that_lived_long_starts_the_backoff_again() -> None:
    backoff = Backoff(first=0.2, longest=10.0, healthy_after=10.0)
    for _ in range(6):
        backoff.next_delay(session_lasted=0.1)

    delay = backoff.next_delay(session_lasted=30.0)

    assert backoff.failures == 1
    assert delay <= 0.3


class Scripted(Daemon):
    """A daemon whose sessions fail as scripted, then stop it."""

    name = "scripted"
    default_metrics_port = 0

    def __init__(self, failures: list[BaseException]) -> None:
        super().__init__(Settings.model_construct(), logging.getLogger("outbox.test.daemon"))
        self.failures = failures
        self.sessions = 0
        self.lost: list[str] = []

    def healthy(self) -> bool:
        return True

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # the backoff's length is Backoff's business, tested above

    async def session(self) -> None:
        self.sessions += 1
        if self.failures:
            raise self.failures.pop(0)
        self.stop()


async def test_sessions_outlive_transient_failures_and_report_each_peer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = Scripted([BrokerUnavailable("gone"), psycopg.OperationalError("reset")])

    with caplog.at_level(logging.WARNING, logger="outbox.test.daemon"):
        await asyncio.wait_for(daemon.keep_sessions(daemon.session, daemon.lost.append), 10)

    assert daemon.sessions == 3
    assert daemon.lost == ["broker", "database"]
    assert logged(caplog, "scripted.session_lost", peer="broker", error="BrokerUnavailable")
    assert logged(caplog, "scripted.session_lost", peer="database", error="OperationalError")


async def test_a_failure_no_session_cures_ends_the_daemon() -> None:
    daemon = Scripted([BrokerUnavailable("gone"), SchemaMissing()])

    with pytest.raises(SchemaMissing):
        await asyncio.wait_for(daemon.keep_sessions(daemon.session, daemon.lost.append), 10)

    assert daemon.lost == ["broker"]


async def test_connect_with_retry_gives_up_after_its_attempts_and_raises_the_last_error() -> None:
    daemon = Scripted([])
    daemon.connect_attempts = 3
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError()

    with pytest.raises(ConnectionRefusedError):
        await asyncio.wait_for(daemon.connect_with_retry(refused, "database"), 10)
    assert calls == 3


async def test_connect_with_retry_does_not_retry_a_refusal() -> None:
    daemon = Scripted([])
    calls = 0

    async def misconfigured() -> None:
        nonlocal calls
        calls += 1
        raise ConfigurationError("the broker refused the topology")

    with pytest.raises(ConfigurationError):
        await asyncio.wait_for(daemon.connect_with_retry(misconfigured, "broker"), 10)
    assert calls == 1


async def test_serving_logs_the_start_with_its_fields_and_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = Scripted([])
    daemon.settings = Settings.model_construct(metrics_host="127.0.0.1", metrics_port=0)

    with caplog.at_level(logging.INFO, logger="outbox.test.daemon"):
        async with daemon.serving(CollectorRegistry(), queue="q") as port:
            assert port > 0
            assert daemon.metrics_port == port

    assert logged(caplog, "scripted.started", queue="q", metrics_port=port)
    assert logged(caplog, "scripted.stopped", worker=daemon.worker_id)


def test_a_lock_wait_names_its_blockers_once_every_ten_seconds_for_the_same_ones(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    clock = [1000.0]
    monkeypatch.setattr("outbox.daemon.time.monotonic", lambda: clock[0])
    waiting = Scripted([]).lock_waits()
    analyst = LockHolder(pid=41, role="analyst", state="idle in transaction", seconds=61)
    migration = LockHolder(pid=42, role="postgres", state="active", seconds=3)

    waiting((analyst,))
    waiting((analyst,))  # a second transaction waiting for the same session
    waiting((analyst, migration))  # another set of sessions: said at once
    clock[0] += LOCK_WAIT_REPEAT_SECONDS
    waiting((analyst,))

    said = [str(getattr(r, "waiting_for", "")) for r in records_of(caplog, "scripted.lock_wait")]
    assert said == [
        "pid 41 (role analyst, idle in transaction, for 61 s)",
        "pid 41 (role analyst, idle in transaction, for 61 s); "
        "pid 42 (role postgres, active, for 3 s)",
        "pid 41 (role analyst, idle in transaction, for 61 s)",
    ]
