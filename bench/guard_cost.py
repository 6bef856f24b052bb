"""What each of the database's guards costs an operation, in the backend's own CPU:

    .venv/bin/python -m bench.guard_cost [--pieces none chain transition ...]
        [--block 50] [--blocks 40]
        [--database-url postgresql://localhost:5432/postgres]

For each piece, two scratch databases: one on the schema's defaults, one with that piece
switched off (an ablation no product component should be given). One connection to
each runs an operation's statements in turn, each its own transaction, as the agent,
the dispatcher and the consumer send them: the decision (``insert_decision``), its
dispatch (``claim_outbox_batch`` and ``mark_outbox_published``), its claim
(``claim_deliveries``) and its outcome (``commit_operations``). The two alternate in
blocks of ``--block`` operations, ``--blocks`` times, which pairs each block with one
run just before or after it on the same host, so that what the machine does meanwhile
falls on both. The backend's CPU comes from ``/proc/<pid>/schedstat``: the database
server must run on this host.

Prints, per piece, the median per block of the defaults' and the variant's CPU µs an
operation, the median of their paired differences per statement, and in how many
blocks the variant was cheaper. ``none`` strips nothing: its difference is the noise
the others are read against.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from bench.writer_floor import statement_parameters
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase, new_tag
from outbox.settings import libpq_url
from outbox.sql import QUERIES

STAGES = ("decide", "dispatch", "claim", "outcome")
LEASE = timedelta(seconds=30)
WARM_UP = 100

# What switching each piece off takes: statements on a scratch database.
PIECES: dict[str, tuple[str, ...]] = {
    "none": (),
    "chain": (
        "ALTER TABLE operation_events DISABLE TRIGGER operation_events_chain",
        "ALTER TABLE operation_events ALTER COLUMN seq DROP NOT NULL",
        "ALTER TABLE operation_events ALTER COLUMN hash DROP NOT NULL",
    ),
    "transition": ("ALTER TABLE operations DISABLE TRIGGER operations_guard_transition",),
    "birth": ("ALTER TABLE operations DISABLE TRIGGER operations_guard_birth",),
    "by-role": ("ALTER TABLE operation_events DISABLE TRIGGER operation_events_by_role",),
    "outbox-guards": (
        "ALTER TABLE outbox DISABLE TRIGGER outbox_guard_row",
        "ALTER TABLE outbox DISABLE TRIGGER outbox_guard_update",
    ),
    "heads-guard": (
        "ALTER TABLE operation_event_heads DISABLE TRIGGER operation_event_heads_guard",
    ),
    "checks": (
        "ALTER TABLE operation_events DROP CONSTRAINT operation_events_name_check",
        "ALTER TABLE operation_event_heads DROP CONSTRAINT operation_event_heads_events_check",
        "ALTER TABLE outbox DROP CONSTRAINT outbox_publish_attempts_check",
    ),
    "outbox-foreign-key": ("ALTER TABLE outbox DROP CONSTRAINT outbox_operation_id_fkey",),
}


def refuse_unknown_pieces(pieces: list[str]) -> None:
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        raise SystemExit(f"unknown piece(s) {', '.join(unknown)}: choose from {', '.join(PIECES)}")


def strip_piece(connection: psycopg.Connection[Any], piece: str) -> None:
    """Switch ``piece`` off on the database of ``connection`` (autocommit)."""
    for statement in PIECES[piece]:
        connection.execute(statement.encode())


def backend_cpu_ns(pid: int) -> int:
    """The CPU time the server process ``pid`` has run, in ns (its first schedstat
    field), which unlike utime and stime is not counted in whole clock ticks."""
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[0])


@dataclass
class OperationLoop:
    """One connection running operations through their four stages, counting the
    backend's CPU of each."""

    connection: psycopg.Connection[Any]
    run_id: str = field(default_factory=lambda: f"guard_{new_tag()}")
    done: int = 0

    @property
    def pid(self) -> int:
        return int(self.connection.info.backend_pid)

    def one(self) -> dict[str, int]:
        self.done += 1
        connection, spent = self.connection, {}
        params = statement_parameters(self.run_id, self.done)
        params["input"], params["headers"] = Jsonb(params["input"]), Jsonb(params["headers"])
        started = backend_cpu_ns(self.pid)
        self._execute("insert_decision", params)
        spent["decide"], started = _since(self.pid, started)
        with connection.transaction():
            rows = self._execute("claim_outbox_batch", {"batch_size": 16})
            self._execute("mark_outbox_published", {"ids": [row["id"] for row in rows]})
        spent["dispatch"], started = _since(self.pid, started)
        claimed = self._execute(
            "claim_deliveries",
            {
                "ids": [params["id"]],
                "leases": [LEASE],
                "tool_names": [params["tool_name"]],
                "tool_versions": [params["tool_version"]],
                "input_fingerprints": [params["input_fingerprint"]],
                "owner": "guard-cost",
            },
        )
        if len(claimed) != 1:
            raise RuntimeError(f"operation {self.done} was not claimed: {len(claimed)} rows")
        spent["claim"], started = _since(self.pid, started)
        moved = self._execute(
            "commit_operations",
            {
                "ids": [params["id"]],
                "lease_tokens": [claimed[0]["lease_token"]],
                "provider_references": [None],
                "results": [Jsonb({})],
                "event_attributes": [Jsonb({"attempt": 1})],
            },
        )
        if len(moved) != 1:
            raise RuntimeError(f"operation {self.done} was not committed: {len(moved)} rows")
        spent["outcome"], _ = _since(self.pid, started)
        return spent

    def _execute(self, query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        cursor = self.connection.execute(QUERIES[query].sql, params, prepare=True)
        return cursor.fetchall() if cursor.description else []

    def block(self, size: int) -> dict[str, float]:
        """µs of backend CPU an operation, per stage and in total, over ``size``."""
        totals = dict.fromkeys(STAGES, 0)
        for _ in range(size):
            for stage, spent in self.one().items():
                totals[stage] += spent
        per_operation = {stage: spent / size / 1000 for stage, spent in totals.items()}
        per_operation["total"] = sum(totals.values()) / size / 1000
        return per_operation


def _since(pid: int, started: int) -> tuple[int, int]:
    now = backend_cpu_ns(pid)
    return now - started, now


@dataclass
class PieceCost:
    piece: str
    defaults: list[float]
    stripped: list[float]
    differences: dict[str, list[float]]

    def line(self) -> str:
        median = {name: statistics.median(values) for name, values in self.differences.items()}
        cheaper = sum(1 for difference in self.differences["total"] if difference < 0)
        stages = " ".join(f"{name} {median[name]:+.1f}" for name in (*STAGES, "total"))
        return (
            f"{self.piece:18s} defaults {statistics.median(self.defaults):7.1f}"
            f"  without {statistics.median(self.stripped):7.1f}  difference: {stages}"
            f"  (cheaper in {cheaper} of {len(self.defaults)} blocks)"
        )


@contextmanager
def loop_on(admin_url: str, piece: str | None) -> Iterator[OperationLoop]:
    """A scratch database with ``piece`` switched off (None: the defaults), and a loop on
    it; the database is dropped at the end."""
    prefix = "guard_defaults" if piece is None else f"guard_{piece.replace('-', '_')}"
    with ScratchDatabase(admin_url, f"{prefix}_{new_tag()}") as scratch:
        if piece is not None:
            with psycopg.connect(scratch.url, autocommit=True) as admin:
                strip_piece(admin, piece)
        with psycopg.connect(scratch.url, autocommit=True, row_factory=dict_row) as connection:
            yield OperationLoop(connection)


def measure_piece(admin_url: str, piece: str, block: int, blocks: int) -> PieceCost:
    with ExitStack() as stack:
        defaults = stack.enter_context(loop_on(admin_url, None))
        stripped = stack.enter_context(loop_on(admin_url, piece))
        for loop in (defaults, stripped):
            loop.block(WARM_UP)
        cost = PieceCost(piece, [], [], {name: [] for name in (*STAGES, "total")})
        for number in range(blocks):
            # Each goes first in every other block.
            if number % 2 == 0:
                on_defaults = defaults.block(block)
                without = stripped.block(block)
            else:
                without = stripped.block(block)
                on_defaults = defaults.block(block)
            cost.defaults.append(on_defaults["total"])
            cost.stripped.append(without["total"])
            for name in cost.differences:
                cost.differences[name].append(without[name] - on_defaults[name])
        return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL", "postgresql://localhost:5432/postgres"),
        help="a database on the server (env OUTBOX_BENCH_DATABASE_URL), which must run on "
        "this host; scratch ones are created beside it",
    )
    parser.add_argument("--pieces", nargs="+", default=list(PIECES), metavar="PIECE")
    parser.add_argument("--block", type=positive_int, default=50)
    parser.add_argument("--blocks", type=positive_int, default=40)
    args = parser.parse_args()
    refuse_unknown_pieces(args.pieces)
    print("backend CPU µs an operation (decide, dispatch, claim, outcome), medians of blocks")
    for piece in args.pieces:
        print(
            measure_piece(libpq_url(args.database_url), piece, args.block, args.blocks).line(),
            flush=True,
        )


if __name__ == "__main__":
    main()
