"""Postgres fails over under the whole system: a private primary and its streaming
standby, the real dispatcher and two consumers as processes on the libpq multi-host URL,
the payment sandbox dropping answers, and a stream of decisions. Mid-stream the primary
crashes (``pg_ctl stop -m immediate``) with effects in flight and the standby is
promoted, as RDS, Patroni or CloudNativePG would.

Synchronous replication keeps the guarantee whole: every acknowledged decision is on the
new primary and ends once, and the reconciler settles the effects whose outcome writes
died with the old primary. Asynchronous replication loses what the standby had not
received; the test makes that certain (it stops the standby's WAL receiver shortly
before the crash), counts the loss, and shows that an effect whose decision was lost is
reported: the provider's late webhook names an operation the database no longer has,
and lands in the callbacks inbox as unmatched (``outbox callbacks list --unmatched``,
``outbox_callbacks_unmatched_total``)."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from pydantic import SecretStr

from outbox import Settings, record_decision
from outbox.errors import TransientDatabaseError
from outbox.migrate import migrate
from outbox.models import display_operation_id
from outbox.sandbox.processes import python_module
from outbox.sandbox.provider import Faults
from outbox.sandbox.webhooks import WebhookTarget

from support.pg_replication import Failover, ReplicatedPair, replicated_pair
from support.system import SETTLED, Daemon, System, running_system
from support.waiting import eventually_sync

pytestmark = pytest.mark.pg_failover

DECISIONS = 150
# Decisions acknowledged before the crash, and (asynchronous mode) after the standby
# stopped receiving: those are acknowledged by the old primary only.
BEFORE_CRASH = 70
UNREPLICATED = 15
# Between two decisions of the stream: an agent service at a steady pace.
PACE_SECONDS = 0.02
PAYMENTS_SECRET = "whsec_failover_test_payments_secret"
CALLBACK_SECRETS = (
    f"sandbox-payments:{PAYMENTS_SECRET},"
    "sandbox-email:whsec_" + base64.b64encode(b"failover-test-email-secret-32by!").decode()
)
SETTLE_SECONDS = 90.0
REFUND_DEADLINE = 3.0
REQUEUE_STALE_AFTER = "PT4S"
ENDINGS = {str(state) for state in SETTLED}


@dataclass
class Stream:
    """Decisions recorded by a thread, as an agent service records them: each under its
    own decision key, retried with the same key (so never twice) until a commit returns.
    ``acknowledged`` holds those whose ``record_decision`` and commit returned."""

    system: System
    url: str
    acknowledged: list[UUID] = field(default_factory=list)
    failed_attempts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        for n in range(DECISIONS):
            while not self._stop.is_set():
                try:
                    with psycopg.connect(self.url, connect_timeout=2) as connection:
                        recorded = record_decision(
                            connection,
                            self.system.registry,
                            "send_refund",
                            {"payment_id": "pay_1", "amount_cents": 100},
                            run_id="failover",
                            decision_key=f"d{n}",
                        )
                        connection.commit()
                    self.acknowledged.append(recorded.operation.id)
                    break
                except (psycopg.Error, TransientDatabaseError):
                    # The primary is gone: this decision is not acknowledged; the agent
                    # tries again with the same key, as a caller of an outbox must.
                    self.failed_attempts += 1
                    time.sleep(PACE_SECONDS * 5)
            if self._stop.is_set():
                return
            time.sleep(PACE_SECONDS)

    @contextlib.contextmanager
    def running(self) -> Iterator[Stream]:
        thread = threading.Thread(target=self.run, name="decisions", daemon=True)
        thread.start()
        try:
            yield self
            thread.join(timeout=SETTLE_SECONDS)
            assert not thread.is_alive(), "the decision stream never finished"
        finally:
            self._stop.set()
            thread.join(timeout=10)

    def count(self) -> int:
        return len(self.acknowledged)


def states(url: str, ids: list[UUID]) -> dict[UUID, str]:
    with psycopg.connect(url, connect_timeout=5) as connection:
        rows = connection.execute(
            "SELECT id, state FROM operations WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    return {row[0]: str(row[1]) for row in rows}


def endings(url: str, ids: list[UUID]) -> Counter[str]:
    """How the decisions ended, with the reason for any that did not commit."""
    with psycopg.connect(url, connect_timeout=5) as connection:
        rows = connection.execute(
            "SELECT state, last_error_class FROM operations WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    return Counter(str(s) if s == "committed" else f"{s}:{why}" for s, why in rows)


def one_value(url: str, sql: str, *params: object) -> Any:
    with psycopg.connect(url, connect_timeout=5) as connection:
        row = connection.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def kill_to_first_commit(url: str, killed_wall: float) -> float:
    """Seconds from the crash to the first outcome committed on the new primary."""
    first = one_value(
        url,
        "SELECT extract(epoch FROM min(created_at)) FROM operation_events "
        "WHERE name = 'operation.committed' AND created_at > to_timestamp(%s)",
        killed_wall,
    )
    assert first is not None, "nothing committed after the crash"
    return float(first) - killed_wall


def start_daemons(system: System) -> list[Daemon]:
    daemons = [system.start("dispatcher"), system.start("consumer"), system.start("consumer")]
    for daemon in daemons:
        daemon.wait_for_line("started", within=60)
    return daemons


def failover_lines(daemons: list[Daemon], pair: ReplicatedPair) -> int:
    """How many daemons logged their move, by place, from the old primary to the new."""
    moved = re.compile(
        rf"database_failover.*from={re.escape(pair.primary.address)}.*"
        rf"to={re.escape(pair.standby.address)}"
    )
    return sum(1 for daemon in daemons if moved.search(daemon.output()))


def wait_in_flight(system: System, stream: Stream, url: str) -> None:
    """Until an acknowledged refund has been claimed and not yet settled: the crash must
    catch effects in flight."""

    def caught() -> bool:
        current = states(url, list(stream.acknowledged))
        return any(state == "in_flight" for state in current.values())

    eventually_sync(caught, within=30, what="a refund in flight")


@contextlib.contextmanager
def failover_system(
    settings: Settings, pair: ReplicatedPair, faults: Faults
) -> Iterator[tuple[System, str]]:
    migrate(pair.primary.url(), roles=True)
    url = pair.url()
    multi = settings.model_copy(update={"database_url": SecretStr(url)})
    # A lookup on a busy machine (the sandbox shares this process with the stream) may
    # take longer than the usual 1 s deadline; a timed-out lookup ends in a person's hands.
    with running_system(multi, faults=faults, refund_deadline=REFUND_DEADLINE) as system:
        yield system, url


def settle(system: System, url: str, ids: list[UUID]) -> dict[UUID, str]:
    def all_ended() -> bool:
        return set(states(url, ids).values()) <= ENDINGS

    eventually_sync(all_ended, within=SETTLE_SECONDS, what="every surviving decision ended")
    return states(url, ids)


def requeued(url: str, ids: list[UUID]) -> int:
    """Operations the stale sweep sent again: prepared, with no message left to reach
    them."""
    return int(
        one_value(
            url,
            "SELECT count(DISTINCT operation_id) FROM operation_events "
            "WHERE name = 'operation.requeued' AND operation_id = ANY(%s)",
            ids,
        )
    )


def report(mode: str, **figures: object) -> None:
    print(f"\n{mode} failover: " + " ".join(f"{name}={value}" for name, value in figures.items()))


def test_synchronous_replication_loses_nothing_and_executes_nothing_twice(
    settings: Settings,
) -> None:
    with (
        replicated_pair(synchronous=True) as pair,
        failover_system(settings, pair, Faults(drop_response_every=4)) as (system, url),
    ):
        daemons = start_daemons(system)
        stream = Stream(system, url)
        with stream.running():
            eventually_sync(
                lambda: stream.count() >= BEFORE_CRASH, within=60, what="decisions before"
            )
            wait_in_flight(system, stream, pair.primary.url())
            acknowledged_at_crash = stream.count()
            killed_wall = time.time()
            failover: Failover = pair.fail_over()
            at_promotion = states(pair.standby.url(), list(stream.acknowledged))
            executed_at_promotion = set(system.provider.ledger()["refunds_by_key"])
        acknowledged = list(stream.acknowledged)
        ended = settle(system, url, acknowledged)
        ledger = system.provider.ledger()["refunds_by_key"]
        moved = failover_lines(daemons, pair)

        lost = [op for op in acknowledged if op not in ended]
        duplicates = {key: count for key, count in ledger.items() if count > 1}
        # In flight on the new primary at promotion with the refund already made: the
        # outcome write died with the old primary (or never ran); the reconciler ends them.
        writes_lost = [
            op
            for op, state in at_promotion.items()
            if state in ("in_flight", "outcome_unknown") and str(op) in executed_at_promotion
        ]
        report(
            "synchronous",
            decisions=len(acknowledged),
            lost=len(lost),
            effects=sum(ledger.values()),
            duplicates=len(duplicates),
            acknowledged_at_crash=acknowledged_at_crash,
            in_flight_at_promotion=sum(
                state in ("in_flight", "outcome_unknown") for state in at_promotion.values()
            ),
            failed_writes_retried=len(writes_lost),
            failed_decision_attempts=stream.failed_attempts,
            promote_s=round(failover.promote_s, 2),
            kill_to_first_commit_s=round(kill_to_first_commit(url, killed_wall), 2),
            states=dict(endings(url, acknowledged)),
            daemons_that_logged_the_failover=moved,
        )

        assert len(acknowledged) == DECISIONS
        assert lost == []
        assert duplicates == {}
        assert set(ended.values()) == {"committed"}
        assert all(ledger.get(str(op)) == 1 for op in acknowledged)
        assert all(ended[op] == "committed" for op in writes_lost)
        assert moved == len(daemons)


def unmatched_callbacks(system: System, url: str) -> set[str]:
    """The operations the inbox's unmatched callbacks name, as `outbox callbacks list
    --unmatched --json` prints them."""
    listed = subprocess.run(
        python_module("outbox", "callbacks", "list", "--unmatched", "--json", "--limit", "1000"),
        env={**system.environment, "OUTBOX_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    callbacks: list[dict[str, Any]] = json.loads(listed.stdout)
    return {c["named_operation_id"] for c in callbacks if c["named_operation_id"]}


def unmatched_metric(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("outbox_callbacks_unmatched_total{")
    )


def test_asynchronous_replication_loses_what_was_not_replicated_and_reports_its_effects(
    settings: Settings,
) -> None:
    # The provider's webhooks come late (held until the failover is over), as they do:
    # the refunds of decisions the failover lost must still reach an operator.
    faults = Faults(drop_response_every=4, webhook_delay_ms=3_600_000)
    with (
        replicated_pair(synchronous=False) as pair,
        failover_system(settings, pair, faults) as (system, url),
    ):
        # A survivor whose claim died with the old primary while its publication mark
        # had been replicated is prepared with no message left to reach it: the stale
        # sweep sends it again (10 minutes by default; seconds here).
        system.environment["OUTBOX_REQUEUE_STALE_AFTER"] = REQUEUE_STALE_AFTER
        callbacks = Daemon(
            "callbacks",
            {**system.environment, "OUTBOX_CALLBACK_SECRETS": CALLBACK_SECRETS},
            command=python_module("outbox", "callbacks", "serve", "--port", "0"),
        )
        system.daemons.append(callbacks)
        line = callbacks.wait_for_line("callbacks.listening", within=60)
        port_match = re.search(r"\bport=(\d+)", line)
        assert port_match, line
        port = int(port_match[1])
        system.provider.set_webhooks(
            WebhookTarget(
                url=f"http://127.0.0.1:{port}", secrets={"sandbox-payments": (PAYMENTS_SECRET,)}
            )
        )
        daemons = start_daemons(system)
        stream = Stream(system, url)
        with stream.running():
            eventually_sync(
                lambda: stream.count() >= BEFORE_CRASH - UNREPLICATED,
                within=60,
                what="decisions before the standby falls behind",
            )
            pair.detach_standby()
            detached_at = stream.count()
            eventually_sync(
                lambda: stream.count() >= detached_at + UNREPLICATED,
                within=60,
                what="decisions the standby never receives",
            )
            unreplicated = stream.acknowledged[detached_at + 1 :]

            def an_unreplicated_refund_made() -> bool:
                return any(
                    str(op) in system.provider.ledger()["refunds_by_key"] for op in unreplicated
                )

            eventually_sync(an_unreplicated_refund_made, within=30, what="a refund to be lost")
            wait_in_flight(system, stream, pair.primary.url())
            killed_wall = time.time()
            failover = pair.fail_over()
        acknowledged = list(stream.acknowledged)
        on_new_primary = states(url, acknowledged)
        lost = [op for op in acknowledged if op not in on_new_primary]
        survivors = [op for op in acknowledged if op in on_new_primary]
        ended = settle(system, url, survivors)
        ledger = system.provider.ledger()["refunds_by_key"]
        orphans = {display_operation_id(UUID(key)) for key in ledger if UUID(key) in set(lost)}

        system.provider.set_faults(webhook_delay_ms=0)  # the provider's webhooks arrive
        eventually_sync(
            lambda: orphans <= unmatched_callbacks(system, url),
            within=60,
            what="every lost decision's refund reported as an unmatched callback",
        )
        unmatched_total = unmatched_metric(port)
        moved = failover_lines(daemons, pair)
        duplicates = {key: count for key, count in ledger.items() if count > 1}
        report(
            "asynchronous",
            decisions=len(acknowledged),
            lost=len(lost),
            provably_unreplicated=len(unreplicated),
            effects=sum(ledger.values()),
            effects_of_lost_decisions=len(orphans),
            requeued_after_the_failover=requeued(url, survivors),
            unmatched_callbacks_metric=unmatched_total,
            duplicates=len(duplicates),
            promote_s=round(failover.promote_s, 2),
            kill_to_first_commit_s=round(kill_to_first_commit(url, killed_wall), 2),
            states=dict(endings(url, survivors)),
            daemons_that_logged_the_failover=moved,
        )

        assert set(unreplicated) <= set(lost)
        assert lost, "the decisions the standby never received were not lost: no failover?"
        assert duplicates == {}
        assert all(ledger.get(str(op), 0) <= 1 for op in survivors)
        assert all(ledger.get(str(op)) == 1 for op, state in ended.items() if state == "committed")
        assert orphans, "no refund of a lost decision was made before the crash"
        assert unmatched_total >= len(orphans)
        assert moved == len(daemons)
