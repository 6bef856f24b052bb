"""`python -m harness.chaos`: the guarantee holds while daemons, the broker, the database
sessions, the network links and the provider are broken under a seeded schedule."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import psycopg
import pytest

from harness.chaos import seed_range
from harness.checker import Verdict, check_sequence
from harness.faults import FAULT_CATEGORIES
from harness.parameters import PROVIDER_OUTAGE_SECONDS, RUN_OVERHEAD_SECONDS, liveness_bound
from harness.report import Tally
from harness.schedule import fault_schedule, run_deadline
from outbox.models import OperationEvent
from outbox.states import OperationState

# The harness is not installed (it is not in the wheel): it runs from the checkout, whose
# root `python -m` puts on sys.path when it is the working directory.
REPOSITORY = Path(__file__).resolve().parents[2]
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


# Enough for every fault kind to land (22 kinds after an 8 s quiet phase) within the
# stream: at 150, a schedule crammed into 7 s gave up on two of them.
CI_OPERATIONS = 300
CI_SEED = 7
# The run's own deadline (stream + its provider outage + liveness bound + overhead), not
# a guess; past it the harness gets SIGTERM, which still stops its daemons and keeps its
# evidence.
RUN_DEADLINE = run_deadline(
    CI_OPERATIONS,
    max(
        fault.seconds or 0.0
        for fault in fault_schedule(CI_SEED, CI_OPERATIONS, frozenset(FAULT_CATEGORIES))
    ),
)
TERMINATE_GRACE_SECONDS = 60.0


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_within_deadline(command: list[str], environment: dict[str, str]) -> Finished:
    process = subprocess.Popen(
        command,
        env=environment,
        cwd=REPOSITORY,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=RUN_DEADLINE)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=TERMINATE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(
            f"the chaos run ran past its own deadline ({RUN_DEADLINE:.0f} s) and was stopped "
            f"with SIGTERM:\n{stdout}\n{stderr}"
        ) from None
    return Finished(process.returncode, stdout, stderr)


@pytest.mark.rabbit_cluster  # a private broker: rabbitmq-server installed
@pytest.mark.timeout(RUN_DEADLINE + TERMINATE_GRACE_SECONDS + 30)
def test_chaos_loses_nothing_and_duplicates_nothing(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    environment = {
        **os.environ,
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
    }
    result = run_within_deadline(
        [
            *[sys.executable, "-m", "harness.chaos", "--operations", str(CI_OPERATIONS)],
            # A broker of the run's own: its stop_app stops nobody else's work.
            *["--seed", str(CI_SEED), "--broker", "private"],
        ],
        environment,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    verdict = verdict_of(result.stdout)
    assert verdict["decisions"] == str(CI_OPERATIONS)
    assert verdict["drain_s"] != "timeout"
    assert verdict["settle_s"] != "-"
    assert verdict["lost"] == "0"
    assert verdict["duplicate_effects"] == "0"
    assert verdict["blind_retries"] == "0"
    assert verdict["illegal_sequences"] == "0"
    assert verdict["in_flight_past_lease"] == "0"
    # Overload (#22) and callbacks (#25): what breaks the verdict, spelled out.
    assert verdict["undeliverable"] == "0", result.stdout
    assert verdict["contradictions"] == "0", result.stdout
    assert verdict["recovery_s"] not in ("-", "never"), result.stdout
    assert verdict["committed_without_one_email"] == "0", result.stdout
    # A daemon that dies of a fault instead of riding it out is a bug, even if the
    # harness's restart hides it from the other figures.
    assert verdict["unplanned_exits"] == "0", result.stdout
    # Kills, restarts and dropped responses make the broker redeliver; the consumers
    # must have turned some delivery away, and the count comes from the event log.
    assert int(verdict["duplicate_deliveries_suppressed"]) >= 1, result.stdout
    for count in FAULT_COUNTS:
        assert int(verdict[count]) >= 1, f"{count}: {result.stdout}"
    assert broker_accepts_connections(amqp_server_url), "the shared broker stopped"
    # This run's database only: another run's kept evidence is not ours to judge.
    with psycopg.connect(postgres_server_url, autocommit=True) as connection:
        leftovers = connection.execute(
            "SELECT datname FROM pg_database WHERE datname = %s", (database_of(result.stdout),)
        ).fetchall()
    assert leftovers == []


def database_of(output: str) -> str:
    """The run's own database, from the line that names it as the run begins."""
    found = re.search(r"^database \S+/(outbox_chaos_\w+),", output, re.MULTILINE)
    assert found, f"the run never named its database:\n{output}"
    return found.group(1)


def test_a_run_is_known_by_the_database_it_names() -> None:
    output = (
        "outbox chaos: 5 decisions, seed 1, faults process, broker private\n"
        "database postgresql://postgres@127.0.0.1:5432/outbox_chaos_1a2b3c4d, "
        "queue chaos.1a2b3c4d.operations\n"
    )

    assert database_of(output) == "outbox_chaos_1a2b3c4d"


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

    check_sequence(verdict, "op", OperationState.COMMITTED, events)

    assert (verdict.blind_retries, verdict.illegal_sequences) == (blind, 0)


def test_the_checker_refuses_an_illegal_sequence() -> None:
    verdict = Verdict(decisions=1)
    events = [
        event("operation.prepared"),
        event("operation.committed", **{"from": "in_flight", "to": "committed"}),
    ]

    check_sequence(verdict, "op", OperationState.COMMITTED, events)

    assert verdict.illegal_sequences == 1


def test_the_checker_notes_when_the_last_operation_settled() -> None:
    verdict = Verdict(decisions=2)
    later = NOW + timedelta(seconds=5)
    committed = event("operation.committed", **{"from": "in_flight", "to": "committed"})
    escalated = event("operation.escalated", **{"from": "outcome_unknown", "to": "escalated"})
    escalated = escalated.model_copy(update={"created_at": later})
    attempted = event("operation.attempted")

    check_sequence(
        verdict, "a", OperationState.COMMITTED, [event("operation.prepared"), attempted, committed]
    )
    check_sequence(
        verdict,
        "b",
        OperationState.ESCALATED,
        [event("operation.prepared"), attempted, UNKNOWN, escalated],
    )

    assert verdict.last_settled_at == later
    assert verdict.illegal_sequences == 0


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("7", [7]), ("1-3", [1, 2, 3]), ("1-3,9", [1, 2, 3, 9]), ("5,2", [5, 2])],
)
def test_a_seed_sweep_is_read_from_ranges_and_lists(text: str, seeds: list[int]) -> None:
    assert seed_range(text) == seeds


@pytest.mark.parametrize("text", ["", "a-b", "5-1", "1-"])
def test_a_bad_seed_list_is_refused_with_the_forms_it_takes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="use 1-20"):
        seed_range(text)


def test_the_run_deadline_is_the_stream_the_outage_the_liveness_bound_and_the_overhead() -> None:
    # send_refund under chaos: 5 s deadline, 3 s margin, five lookups of 5 s after
    # backoffs of 0.2 s doubling (at most 20% jitter): 2 x (8 + 25 + 7.44) s.
    assert liveness_bound() == pytest.approx(2 * (5 + 3 + 25 + 6.2 * 1.2))
    # The longest provider outage the schedule draws, unless the caller knows its own.
    longest = max(PROVIDER_OUTAGE_SECONDS)
    assert run_deadline(150) == pytest.approx(
        15 + longest + liveness_bound() + RUN_OVERHEAD_SECONDS
    )
    assert run_deadline(300, 5.0) == pytest.approx(30 + 5 + liveness_bound() + RUN_OVERHEAD_SECONDS)
