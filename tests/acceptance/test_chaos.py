"""`outbox chaos`: the guarantee holds while daemons, broker connections and database
sessions are broken under a seeded schedule."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from outbox.models import OperationEvent
from outbox.sandbox.chaos import FAULT_CATEGORIES, Verdict, _check_sequence, fault_schedule
from outbox.states import OperationState

OUTBOX = str(Path(sys.executable).parent / "outbox")
FAULT_COUNTS = (
    "dispatcher_kills",
    "consumer_kills",
    "consumer_stops",
    "broker_connection_closes",
    "db_connection_kills",
)


def verdict_of(output: str) -> dict[str, str]:
    return dict(re.findall(r"\b([a-z_]+)=(\S+)", "\n".join(output.splitlines()[-8:])))


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_the_schedule_has_every_fault_kind_and_repeats_for_its_seed(seed: int) -> None:
    everything = frozenset(FAULT_CATEGORIES)
    schedule = fault_schedule(seed, 150, everything)

    assert {fault.kind for fault in schedule} == {
        kind for kinds in FAULT_CATEGORIES.values() for kind in kinds
    }
    assert schedule == fault_schedule(seed, 150, everything)
    assert [fault.at for fault in schedule] == sorted(fault.at for fault in schedule)


@pytest.mark.rabbitmqctl
@pytest.mark.timeout(180)
def test_chaos_loses_nothing_and_duplicates_nothing(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    environment = {
        **os.environ,
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
    }
    result = subprocess.run(
        [OUTBOX, "chaos", "--operations", "150", "--seed", "7"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=170,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    verdict = verdict_of(result.stdout)
    assert verdict["decisions"] == "150"
    assert verdict["lost"] == "0"
    assert verdict["duplicate_effects"] == "0"
    assert verdict["blind_retries"] == "0"
    assert verdict["illegal_sequences"] == "0"
    for count in FAULT_COUNTS:
        assert int(verdict[count]) >= 1, f"{count}: {result.stdout}"
    with psycopg.connect(postgres_server_url, autocommit=True) as connection:
        leftovers = connection.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'outbox_chaos_%'"
        ).fetchall()
    assert leftovers == []


def event(name: str, **attributes: str) -> OperationEvent:
    return OperationEvent(
        id=0, operation_id=OPERATION, name=name, attributes=attributes, created_at=NOW
    )


OPERATION = uuid.uuid4()
NOW = datetime.now(UTC)
UNKNOWN = event("operation.outcome_unknown", **{"from": "in_flight", "to": "outcome_unknown"})


@pytest.mark.parametrize(
    ("between", "blind"),
    [
        ([event("operation.requeued", **{"from": "outcome_unknown", "to": "prepared"})], 1),
        (
            [
                event(
                    "operation.reconciled",
                    result="not_found",
                    **{"from": "outcome_unknown", "to": "prepared"},
                )
            ],
            0,
        ),
    ],
)
def test_the_checker_counts_a_retry_never_proven_absent(
    between: list[OperationEvent], blind: int
) -> None:
    verdict = Verdict(decisions=1)
    events = [
        event("operation.prepared"),
        event("operation.attempted"),
        UNKNOWN,
        *between,
        event("operation.attempted"),
        event("operation.committed", **{"from": "in_flight", "to": "committed"}),
    ]

    _check_sequence(verdict, "op", OperationState.COMMITTED, events)

    assert (verdict.blind_retries, verdict.illegal_sequences) == (blind, 0)


def test_the_checker_refuses_an_illegal_sequence() -> None:
    verdict = Verdict(decisions=1)
    events = [
        event("operation.prepared"),
        event("operation.committed", **{"from": "in_flight", "to": "committed"}),
    ]

    _check_sequence(verdict, "op", OperationState.COMMITTED, events)

    assert verdict.illegal_sequences == 1
