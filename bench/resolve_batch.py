"""How long one ``outbox ops resolve`` over a filter takes to resolve the escalations a
provider fault left: issue #49's "277 escalations took one command each".

    .venv/bin/python -m bench.resolve_batch [--escalations 200] [--runs 3]

Each run creates a scratch database (``outbox_bench_resolve_<tag>``, dropped at the
end), records ``--escalations`` refunds in a run id of its own (the scratch tag), moves
each attempted -> outcome unknown -> escalated (reason ``provider_fault``), as the
reconciler leaves them after a fault, then times one command, as an operator types it,
in a process of its own (interpreter start included)::

    outbox ops resolve --run <tag> --reason provider_fault --rejected \\
        --evidence ... --by bench --yes --json

and checks that every operation ended rejected with one ``operation.resolved`` event
carrying the batch's id. Prints each run's seconds and the median; exits 1 if any
operation was not resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from uuid import UUID

import psycopg

from bench.e2e_tools import REFUND_TOOL, refund_registry
from outbox import OperationState, record_decision
from outbox import store as outbox_store
from outbox.cli import positive_int
from outbox.operator.batch import MAX_BATCH
from outbox.sandbox.scratch import ScratchDatabase, new_tag
from outbox.settings import libpq_url
from outbox.store import Store

S = OperationState
LEASE = timedelta(minutes=5)
REASON = "provider_fault"


def escalate(url: str, tag: str, count: int) -> list[UUID]:
    """``count`` refunds of run ``tag``, each escalated after an unknown outcome."""
    registry = refund_registry()
    ids = []
    with psycopg.connect(url) as connection:
        runner = Store(connection)
        for n in range(count):
            recorded = record_decision(
                connection,
                registry,
                REFUND_TOOL,
                {"payment_id": f"pay_{n}", "amount_cents": 1250},
                run_id=tag,
                decision_key=f"k{n}",
            )
            claimed = runner.run(
                outbox_store.claim(recorded.operation.id, owner="bench", lease=LEASE)
            )
            assert claimed is not None
            runner.run(
                outbox_store.transition(
                    claimed.id,
                    source=S.IN_FLIGHT,
                    target=S.OUTCOME_UNKNOWN,
                    lease_token=claimed.lease_token,
                    error_class="read_timeout",
                )
            )
            runner.run(
                outbox_store.transition(
                    claimed.id,
                    source=S.OUTCOME_UNKNOWN,
                    target=S.ESCALATED,
                    attributes={"reason": REASON},
                )
            )
            connection.commit()
            ids.append(claimed.id)
    return ids


def resolved_in_one_batch(url: str, ids: list[UUID]) -> bool:
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FILTER (WHERE o.state = 'rejected'),"
            " count(DISTINCT e.attributes->>'batch_id')"
            " FROM operations o JOIN operation_events e ON e.operation_id = o.id"
            " AND e.name = 'operation.resolved' WHERE o.id = ANY(%s)",
            (ids,),
        ).fetchone()
    return row is not None and row[0] == len(ids) and row[1] == 1


def one_run(admin_url: str, count: int) -> float:
    tag = new_tag()
    with ScratchDatabase(admin_url, f"outbox_bench_resolve_{tag}") as database:
        ids = escalate(database.url, f"fault_{tag}", count)
        command = [
            sys.executable,
            "-m",
            "outbox",
            "ops",
            "resolve",
            "--run",
            f"fault_{tag}",
            "--reason",
            REASON,
            "--rejected",
            "--evidence",
            "provider fault: the refunds never reached it (its incident report)",
            "--by",
            "bench",
            "--yes",
            "--json",
            "--limit",
            str(min(MAX_BATCH, count)),
        ]
        environment = {**os.environ, "OUTBOX_DATABASE_URL": database.url}
        started = time.perf_counter()
        finished = subprocess.run(  # noqa: S603 - this interpreter, fixed arguments
            command, env=environment, capture_output=True, text=True, check=False
        )
        seconds = time.perf_counter() - started
        if finished.returncode != 0:
            raise SystemExit(f"the command failed ({finished.returncode}): {finished.stderr}")
        report = json.loads(finished.stdout)
        if len(report["resolved"]) != count or not resolved_in_one_batch(database.url, ids):
            raise SystemExit(f"not every escalation was resolved in one batch: {report}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "OUTBOX_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="a database on the server to create the scratch databases from",
    )
    parser.add_argument("--escalations", type=positive_int, default=200)
    parser.add_argument("--runs", type=positive_int, default=3)
    args = parser.parse_args()
    if args.escalations > MAX_BATCH:
        parser.error(f"--escalations: one batch resolves at most {MAX_BATCH}")
    admin_url = libpq_url(args.database_url)
    measured = []
    for run in range(1, args.runs + 1):
        seconds = one_run(admin_url, args.escalations)
        measured.append(seconds)
        print(
            f"run {run}: {args.escalations} escalations resolved by one command in {seconds:.2f} s"
        )
    print(f"median: {statistics.median(measured):.2f} s ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
