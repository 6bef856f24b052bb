"""`outbox chaos`: the guarantee holds while daemons, the broker, the database sessions,
the network links and the provider are broken under a seeded schedule."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import psycopg
import pytest

from outbox.models import OperationEvent
from outbox.sandbox.chaos import (
    FAULT_CATEGORIES,
    Tally,
    Verdict,
    _check_sequence,
    fault_schedule,
)
from outbox.states import OperationState

OUTBOX = str(Path(sys.executable).parent / "outbox")
# Every fault kind the run counts; the short run must land each at least once.
FAULT_COUNTS = tuple(
    name
    for name in Tally.__dataclass_fields__
    if name not in ("unplanned_exits", "faults_that_found_nothing")
)


def verdict_of(output: str) -> dict[str, str]:
    """The key=value pairs of the verdict: the lines from the last one that counts
    decisions to the end."""
    lines = output.splitlines()
    first = max(n for n, line in enumerate(lines) if line.startswith("decisions="))
    return dict(re.findall(r"\b([a-z_]+)=(\S+)", "\n".join(lines[first:])))


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
    assert verdict["in_flight_past_lease"] == "0"
    # A daemon that dies of a fault instead of riding it out is a bug, even if the
    # harness's restart hides it from the other figures.
    assert verdict["unplanned_exits"] == "0", result.stdout
    # Kills, restarts and dropped responses make the broker redeliver; the consumers
    # must have turned some delivery away, and the count comes from the event log.
    assert int(verdict["duplicate_deliveries_suppressed"]) >= 1, result.stdout
    for count in FAULT_COUNTS:
        assert int(verdict[count]) >= 1, f"{count}: {result.stdout}"
    assert broker_accepts_connections(amqp_server_url), "the run left the broker stopped"
    with psycopg.connect(postgres_server_url, autocommit=True) as connection:
        leftovers = connection.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'outbox_chaos_%'"
        ).fetchall()
    assert leftovers == []


def broker_accepts_connections(amqp_url: str) -> bool:
    async def connect() -> bool:
        connection = await aio_pika.connect(amqp_url, timeout=10)
        await connection.close()
        return True

    return asyncio.run(connect())


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
