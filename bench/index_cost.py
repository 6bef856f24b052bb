"""What an index on ``operations`` costs the hot path: one operation's life (recorded,
claimed, committed, each its own transaction, as the agent and the consumer write them)
on databases that differ only in the index, in turn.

    .venv/bin/python -m bench.index_cost [--history 400000] [--seconds 300] [--threads 1]
        [--fsync] [--database-url postgresql://postgres@127.0.0.1:5432/postgres]

Three scratch databases (``outbox_bench_index_cost_<variant>``, dropped at the end), one
filled with the schema and ``--history`` settled operations (``bench/history_fill.py``),
the others copies of it; in each every index below dropped and its variant's built:

- ``none``: neither index;
- ``settled``: ``operations_tool_settled`` as schema.sql builds it, an entry at settling;
- ``full``: ``(tool_name, state, updated_at, id)`` over every state, an entry at the
  birth and at every move (every move sets ``updated_at``, an indexed column, so no
  update of an operation is HOT and each adds an entry to every index it matches).

Each of ``--threads`` threads lives operations through on the three databases in turn,
one operation on each, the order rotated every time: a shared machine's load falls on
the three alike, to the millisecond, where rounds of seconds would each catch a
different load. Prints per variant the median (and p95) of each write and of the three
together, their ratio to ``none``, and the bytes the index grew by per operation (its
entries, dead or alive, before any vacuum: what a vacuum then has to clear). Sessions
run with ``synchronous_commit`` off unless ``--fsync``: the commit's flush is the same
for every variant and would hide what differs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta

import psycopg

from bench.e2e_tools import REFUND_TOOL, refund_registry
from bench.history_fill import fill
from bench.reporting import percentile
from outbox import record_decision, store
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase
from outbox.store import Store

PREFIX = "outbox_bench_index_cost"
LEASE = timedelta(minutes=5)
INDEXES = {
    "settled": "CREATE INDEX operations_tool_settled ON operations "
    "(tool_name, state, updated_at, id) WHERE state IN ('committed', 'rejected')",
    "full": "CREATE INDEX operations_tool_state_updated ON operations "
    "(tool_name, state, updated_at, id)",
}
VARIANTS = ("none", "settled", "full")
WRITES = ("record", "claim", "commit")


def _index_name(variant: str) -> str:
    return INDEXES[variant].split()[2]


class Life:
    """One connection to one variant's database, living operations through."""

    def __init__(self, url: str, run_id: str, sync: bool) -> None:
        self.connection = psycopg.connect(url)
        if not sync:
            self.connection.execute("SET synchronous_commit = off")
            self.connection.commit()
        self.runner = Store(self.connection)
        self.registry = refund_registry()
        self.run_id = run_id
        self.lived = 0
        self.taken: dict[str, list[float]] = {write: [] for write in (*WRITES, "life")}

    def _committed(self, write: str, began: float) -> float:
        self.connection.commit()
        ms = (time.perf_counter() - began) * 1000
        self.taken[write].append(ms)
        return ms

    def one(self) -> None:
        began = time.perf_counter()
        recorded = record_decision(
            self.connection,
            self.registry,
            REFUND_TOOL,
            {"payment_id": f"pay_{self.run_id}_{self.lived}", "amount_cents": 1250},
            run_id=self.run_id,
            decision_key=str(self.lived),
        )
        life = self._committed("record", began)
        began = time.perf_counter()
        claimed = self.runner.run(store.claim_many([(recorded.operation.id, LEASE)], owner="bench"))
        life += self._committed("claim", began)
        (operation,) = claimed.values()
        effect = store.ConfirmedEffect(
            operation=operation, provider_reference="re_bench", result={}, attributes={}
        )
        began = time.perf_counter()
        self.runner.run(store.commit_many([effect]))
        life += self._committed("commit", began)
        self.taken["life"].append(life)
        self.lived += 1


def _prepare(url: str, variant: str) -> int:
    """The variant's index alone, the table vacuumed; the index's size."""
    with psycopg.connect(url, autocommit=True) as connection:
        for other in INDEXES:
            connection.execute(f"DROP INDEX IF EXISTS {_index_name(other)}")
        if variant in INDEXES:
            connection.execute(INDEXES[variant])
        connection.execute("VACUUM ANALYZE operations")
    return _index_bytes(url, variant)


def _index_bytes(url: str, variant: str) -> int:
    if variant not in INDEXES:
        return 0
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT pg_relation_size(%(name)s::regclass)", {"name": _index_name(variant)}
        ).fetchone()
    assert row is not None
    return int(row[0])


def measure(urls: dict[str, str], seconds: float, threads: int, sync: bool) -> list[Life]:
    lives: list[Life] = []

    def work(thread: int) -> None:
        mine = [Life(urls[v], f"index_cost_{thread}", sync) for v in VARIANTS]
        lives.extend(mine)
        deadline = time.monotonic() + seconds
        turn = 0
        try:
            while time.monotonic() < deadline:
                for index in range(len(mine)):
                    mine[(turn + index) % len(mine)].one()
                turn += 1
        finally:
            for life in mine:
                life.connection.close()

    running = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return lives


def report(lives: list[Life], grown: dict[str, int]) -> None:
    medians: dict[str, dict[str, float]] = {}
    print(f"{'variant':<8}  {'lives':>6}  {'index B/op':>10}  ms, median (p95) and / none")
    for position, variant in enumerate(VARIANTS):
        mine = lives[position :: len(VARIANTS)]
        lived = sum(life.lived for life in mine)
        medians[variant] = {}
        cells = []
        for write in (*WRITES, "life"):
            ordered = sorted(ms for life in mine for ms in life.taken[write])
            medians[variant][write] = statistics.median(ordered)
            ratio = medians[variant][write] / medians["none"][write]
            cells.append(
                f"{write} {medians[variant][write]:.3f} ({percentile(ordered, 0.95):.3f}) "
                f"{ratio:.3f}"
            )
        print(f"{variant:<8}  {lived:>6}  {grown[variant] / lived:>10.1f}  " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=400_000)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--fsync", action="store_true", help="keep synchronous_commit on")
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    first = ScratchDatabase(args.database_url, f"{PREFIX}_{VARIANTS[0]}")
    copies = [
        ScratchDatabase(args.database_url, f"{PREFIX}_{v}", template=first.name)
        for v in VARIANTS[1:]
    ]
    try:
        url = first.recreate()
        if args.history:
            fill(url, args.history)
        urls = {VARIANTS[0]: url} | {
            v: c.recreate() for v, c in zip(VARIANTS[1:], copies, strict=True)
        }
        before = {variant: _prepare(urls[variant], variant) for variant in VARIANTS}
        print(f"{args.history:,} settled operations; living operations for {args.seconds} s")
        lives = measure(urls, args.seconds, args.threads, args.fsync)
        grown = {v: _index_bytes(urls[v], v) - before[v] for v in VARIANTS}
    finally:
        for database in (*copies, first):
            database.drop()
    report(lives, grown)


if __name__ == "__main__":
    main()
