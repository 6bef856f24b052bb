"""The live workload both databases of ``bench.history_scale`` hold, and the calls it
times: each named operation as one callable on the project's own code paths.

The workload (the same in both): five runs of eight decisions of ``send_refund``, all
recorded by ``record_decision`` (so 40 outbox rows wait for the dispatcher); of them ten
claimed under a long lease (in flight, for the consumer's outcome), five claimed under
a lease that has already run out and three moved to an unknown outcome, due (for the
reconciler), two of which escalated (for the escalations page); the rest prepared (for
the consumer's claim). Before them, three decisions of a rare tool (``RARE_TOOL``, which
the fill never writes: in the full database three operations among millions), published
and committed, for the lists filtered by a tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
from pydantic import SecretStr
from starlette.testclient import TestClient

from bench.e2e_tools import REFUND_TOOL, refund_registry
from outbox import (
    OutcomeWatcher,
    Registry,
    Settings,
    await_outcome,
    record_decision,
    store,
)
from outbox.cli import run_command
from outbox.console.app import Console, create_app
from outbox.console.config import AuthConfig, ProxyIdentity, parse_proxies
from outbox.settings import ENV_PREFIX
from outbox.sql import QUERIES
from outbox.states import EventName, OperationState
from outbox.store import Store
from outbox.store.operator import SETTLED_SAMPLE_PAGES, tool_listing_limits

RUNS = 5
RUN_SIZE = 8
LONG = timedelta(minutes=30)
PROXY = "10.0.0.7"
OPERATOR = "ada@example.com"
# A stale period no live operation reaches: the requeue and escalation scans still read
# what they read to decide so, and move nothing.
STALE_AFTER = timedelta(minutes=5)
BATCH = 100
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Not one of bench.history_fill.TOOLS: as rare in the full database as in the empty one.
RARE_TOOL = "issue_voucher"
RARE = 3


def live_registry() -> Registry:
    """``send_refund`` as the decision benchmarks record it, and the rare tool: the same
    contract under another name."""
    registry = refund_registry()
    registry.register(dataclasses.replace(registry.get(REFUND_TOOL), name=RARE_TOOL))
    return registry


@dataclass
class LiveWorkload:
    prepared: list[UUID]
    in_flight: list[UUID]
    escalated: list[UUID]
    run_id: str
    fingerprint: str
    """The input fingerprint of ``prepared[0]``, which the consumer's claim compares."""

    def explain(self, url: str, name: str) -> str:
        """EXPLAIN (ANALYZE, BUFFERS) of the reads behind measurement ``name``, rolled
        back: what a grown figure's plan is."""
        out = []
        with psycopg.connect(url) as connection:
            for query, params in self.statements(name):
                rows = connection.execute(
                    "EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[query].sql, params
                ).fetchall()
                out.append(f"[{query}]\n" + "\n".join(row[0] for row in rows))
            connection.rollback()
        return "\n\n".join(out)

    def statements(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        stale = {"stale_after": STALE_AFTER, "limit": BATCH}
        page = {
            "states": None, "tool": None, "run_id": None, "since": None, "until": None,
            "after_updated_at": None, "after_id": None, "limit": 51,
        }  # fmt: skip
        listing = {"states": None, "tool": None, "since": None, "ago": None, "limit": 50}

        def tool(params: dict[str, Any]) -> dict[str, Any]:
            states = [OperationState(s) for s in params["states"] or ()]
            return {**params, "tool": RARE_TOOL, **tool_listing_limits(states, params["limit"])}

        known: dict[str, list[tuple[str, dict[str, Any]]]] = {
            "dispatcher: claim + mark published": [("claim_outbox_batch", {"batch_size": BATCH})],
            "dispatcher: gauges": [
                ("outbox_backlog", {}),
                ("operations_analyzed_rows", {}),
                ("operations_by_state", {}),
            ],
            "consumer: claim": [
                ("get_operation", {"id": self.prepared[0]}),
                (
                    "claim_deliveries",
                    {
                        "ids": [self.prepared[0]],
                        "leases": [LONG],
                        "tool_names": [REFUND_TOOL],
                        "tool_versions": [1],
                        "input_fingerprints": [self.fingerprint],
                        "owner": "bench",
                    },
                ),
            ],
            "consumer: outcome (commit)": [("get_operation", {"id": self.in_flight[0]})],
            "reconciler: requeue_stale_prepared": [("requeue_stale_prepared", stale)],
            "reconciler: escalate_undeliverable": [
                ("escalate_undeliverable", {**stale, "cycles": 3})
            ],
            "reconciler: claim_reconciliation_batch": [
                ("claim_reconciliation_batch", {"limit": BATCH})
            ],
            "reconciler: reject_denied_operations": [
                ("reject_denied_operations", {"grace": STALE_AFTER, "limit": BATCH})
            ],
            "reconciler: claim_callback_batch": [
                ("claim_callback_batch", {"tools": [f"{REFUND_TOOL}.v1"], "limit": BATCH})
            ],
            "reconciler: chain_agent_reports": [("chain_agent_reports", {"limit": BATCH})],
            "reconciler: execution_gauges": [("execution_gauges", {})],
            "reconciler: waiting_operations_by_tool": [("waiting_operations_by_tool", {})],
            "console: overview": [
                # What it reads on a table past EXACT_SETTLED_COUNT_BELOW, as the full one.
                ("operations_analyzed_rows", {}),
                ("estimate_operations_by_tool_and_state", {"sample_pages": SETTLED_SAMPLE_PAGES}),
                ("list_approval_candidates", {}),
                ("console_operations_page", {**page, "states": ["escalated"], "limit": 11}),
            ],
            "console: escalations": [
                ("console_operations_page", {**page, "states": ["escalated"]})
            ],
            "console: a rare tool's operations": [("console_tool_operations_page", tool(page))],
            "console: a rare tool's committed": [
                ("console_tool_operations_page", tool({**page, "states": ["committed"]}))
            ],
            "ops list": [("list_operation_summaries", listing)],
            "ops list --tool (a rare tool)": [("list_tool_operation_summaries", tool(listing))],
            "await_outcome": [("operation_outcomes", {"ids": [self.escalated[0]]})],
            "ops verify OP": [
                (
                    "verify_event_chains",
                    {"first": self.prepared[0], "last": self.prepared[0], "limit": 1},
                )
            ],
        }
        # In the order Reconciler's pass runs them (measurements' reconciler_steps).
        known["reconciler: pass"] = [
            *known["reconciler: escalate_undeliverable"],
            *known["reconciler: requeue_stale_prepared"],
            *known["reconciler: reject_denied_operations"],
            *known["reconciler: claim_callback_batch"],
            *known["reconciler: chain_agent_reports"],
            *known["reconciler: claim_reconciliation_batch"],
            *known["reconciler: execution_gauges"],
            *known["reconciler: waiting_operations_by_tool"],
        ]
        return known.get(name, [])


def _rare_operations(connection: psycopg.Connection[Any]) -> None:
    """The rare tool's few operations, committed, their outbox rows published (before the
    refunds are recorded, so the dispatcher's claim still finds 40 rows)."""
    registry = live_registry()
    ids = [
        record_decision(
            connection,
            registry,
            RARE_TOOL,
            {"payment_id": f"pay_rare_{n}", "amount_cents": 500},
            run_id="live_rare",
            decision_key=f"call_{n}",
        ).operation.id
        for n in range(RARE)
    ]
    connection.commit()
    runner = Store(connection)
    published = runner.run(store.claim_outbox_batch(BATCH))
    runner.run(store.mark_outbox_published([row.id for row in published]))
    claimed = runner.run(store.claim_many([(i, LONG) for i in ids], owner="bench"))
    connection.commit()
    effects = [
        store.ConfirmedEffect(
            operation=operation, provider_reference="re_rare", result={}, attributes={}
        )
        for operation in claimed.values()
    ]
    runner.run(store.commit_many(effects))
    connection.commit()


def start_live_workload(url: str) -> LiveWorkload:
    registry = live_registry()
    ids: list[UUID] = []
    with psycopg.connect(url) as connection:
        _rare_operations(connection)
        for run, call in itertools.product(range(RUNS), range(RUN_SIZE)):
            recorded = record_decision(
                connection,
                registry,
                REFUND_TOOL,
                {"payment_id": f"pay_live_{run}_{call}", "amount_cents": 1250},
                run_id=f"live_{run}",
                decision_key=f"call_{call}",
            )
            ids.append(recorded.operation.id)
        connection.commit()
        runner = Store(connection)
        in_flight, expired, unknown = ids[:10], ids[10:15], ids[15:18]
        runner.run(store.claim_many([(i, LONG) for i in in_flight], owner="bench"))
        runner.run(store.claim_many([(i, timedelta(microseconds=1)) for i in expired], owner="b"))
        claimed = runner.run(store.claim_many([(i, LONG) for i in unknown], owner="bench"))
        for operation in claimed.values():
            runner.run(
                store.transition(
                    operation.id,
                    source=OperationState.IN_FLIGHT,
                    target=OperationState.OUTCOME_UNKNOWN,
                    lease_token=operation.lease_token,
                    event=EventName.OUTCOME_UNKNOWN,
                    attributes={"reason": "deadline_exceeded"},
                )
            )
        for operation_id in unknown[:2]:
            runner.run(
                store.transition(
                    operation_id,
                    source=OperationState.OUTCOME_UNKNOWN,
                    target=OperationState.ESCALATED,
                    event=EventName.ESCALATED,
                    attributes={"reason": "reconcile_exhausted"},
                )
            )
        connection.commit()
    return read_live_workload(url)


def read_live_workload(url: str) -> LiveWorkload:
    """The live workload of a database ``start_live_workload`` wrote (``bench.history_scale
    --keep`` leaves two), read back: its decisions by run and key, in the order written."""
    with psycopg.connect(url) as connection:
        keys = [(f"live_{run}", f"call_{call}") for run in range(RUNS) for call in range(RUN_SIZE)]
        found = {
            (run_id, key): operation_id
            for run_id, key, operation_id in connection.execute(
                "SELECT run_id, decision_key, id FROM operations WHERE run_id = ANY(%(runs)s)",
                {"runs": sorted({run_id for run_id, _ in keys})},
            )
        }
        ids = [found[key] for key in keys]
        first = Store(connection).run(store.get_operation(ids[18]))
    return LiveWorkload(
        prepared=ids[18:],
        in_flight=ids[:10],
        escalated=ids[15:17],
        run_id="live_4",
        fingerprint=first.input_fingerprint,
    )


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@contextlib.contextmanager
def measurements(
    url: str, live: LiveWorkload, amqp_url: str = DEFAULT_AMQP_URL
) -> Iterator[dict[str, Callable[[], object]]]:
    """Each named operation as a callable; whatever it writes is rolled back. The
    console's overview asks the broker at ``amqp_url`` for its dead-letter count."""
    registry = live_registry()
    settings = Settings(database_url=SecretStr(url), amqp_url=SecretStr(amqp_url))
    console = Console(
        settings=settings,
        auth=AuthConfig(
            proxy=ProxyIdentity(header="X-Forwarded-User", proxies=parse_proxies(PROXY))
        ),
        registry=registry,
    )
    decisions = itertools.count()
    loop = asyncio.new_event_loop()
    watcher = OutcomeWatcher(url)
    with (
        psycopg.connect(url) as connection,
        TestClient(
            create_app(console),
            base_url="http://127.0.0.1",
            client=(PROXY, 50000),
            headers={"X-Forwarded-User": OPERATOR},
        ) as browser,
    ):
        runner = Store(connection)
        tools = [f"{REFUND_TOOL}.v1"]
        loop.run_until_complete(watcher.start())

        def rolled_back(work: Callable[[], object]) -> Callable[[], object]:
            def call() -> object:
                try:
                    return work()
                finally:
                    connection.rollback()

            return call

        def plan(make: Callable[[], Any]) -> Callable[[], object]:
            return rolled_back(lambda: runner.run(make()))

        def decide() -> object:
            return record_decision(
                connection,
                registry,
                REFUND_TOOL,
                {"payment_id": "pay_bench", "amount_cents": 1250},
                run_id="bench_history",
                decision_key=f"k{next(decisions)}",
            )

        def dispatch() -> object:
            rows = runner.run(store.claim_outbox_batch(BATCH))
            return runner.run(store.mark_outbox_published([row.id for row in rows]))

        def consumer_claim() -> object:
            operation = runner.run(store.get_operation(live.prepared[0]))
            return runner.run(
                store.claim_deliveries(
                    [
                        store.DeliveryClaim(
                            operation_id=operation.id,
                            tool_name=operation.tool_name,
                            tool_version=operation.tool_version,
                            input_fingerprint=operation.input_fingerprint,
                            lease=LONG,
                        )
                    ],
                    owner="bench",
                )
            )

        def consumer_outcome() -> object:
            operation = runner.run(store.get_operation(live.in_flight[0]))
            effect = store.ConfirmedEffect(
                operation=operation, provider_reference="re_bench", result={}, attributes={}
            )
            return runner.run(store.commit_many([effect]))

        reconciler_steps: dict[str, Callable[[], Any]] = {
            "escalate_undeliverable": lambda: store.escalate_undeliverable(STALE_AFTER, 3, BATCH),
            "requeue_stale_prepared": lambda: store.requeue_stale_prepared(STALE_AFTER, BATCH),
            "reject_denied_operations": lambda: store.reject_denied_operations(STALE_AFTER, BATCH),
            "claim_callback_batch": lambda: store.claim_callback_batch(tools, BATCH),
            "chain_agent_reports": lambda: store.chain_agent_reports(BATCH),
            "claim_reconciliation_batch": lambda: store.claim_reconciliation_batch(BATCH),
            "execution_gauges": store.execution_gauges,
            "waiting_operations_by_tool": store.waiting_operations_by_tool,
        }

        def reconciler_pass() -> object:
            return [runner.run(step()) for step in reconciler_steps.values()]

        def get(path: str) -> Callable[[], object]:
            def call() -> object:
                answer = browser.get(path)
                if answer.status_code != 200:
                    raise RuntimeError(f"GET {path}: {answer.status_code}")
                return answer

            return call

        def command(*argv: str) -> Callable[[], object]:
            def call() -> object:
                # Per call: the runner holds both databases' calls open at once.
                with (
                    _environment(f"{ENV_PREFIX}DATABASE_URL", url),
                    contextlib.redirect_stdout(io.StringIO()),
                    contextlib.redirect_stderr(io.StringIO()),
                ):
                    code = run_command(list(argv))
                if code != 0:
                    raise RuntimeError(f"outbox {' '.join(argv)} exited {code}")
                return code

            return call

        def verify_run() -> object:
            page = runner.run(
                store.operations_page(store.OperationFilter(run_id=live.run_id), limit=50)
            )
            return [runner.run(store.verify_chain(row.id)) for row in page.rows]

        def awaited() -> object:
            return loop.run_until_complete(
                await_outcome(watcher, live.escalated[0], timeout=5, until="attention")
            )

        named: dict[str, Callable[[], object]] = {
            "record_decision": rolled_back(decide),
            "dispatcher: claim + mark published": rolled_back(dispatch),
            "dispatcher: gauges": plan(
                lambda: _both(store.outbox_backlog(), store.operations_by_state())
            ),
            "consumer: claim": rolled_back(consumer_claim),
            "consumer: outcome (commit)": rolled_back(consumer_outcome),
            **{f"reconciler: {name}": plan(step) for name, step in reconciler_steps.items()},
            "reconciler: pass": rolled_back(reconciler_pass),
            "console: overview": get("/"),
            "console: escalations": get("/escalations"),
            "console: operation page": get(f"/operations/{live.escalated[0]}"),
            "console: a rare tool's operations": get(f"/operations?tool={RARE_TOOL}"),
            "console: a rare tool's committed": get(
                f"/operations?tool={RARE_TOOL}&state=committed"
            ),
            "ops list": command("ops", "list"),
            "ops list --tool (a rare tool)": command("ops", "list", "--tool", RARE_TOOL),
            "ops verify OP": command("ops", "verify", str(live.prepared[0])),
            "ops verify: a run": rolled_back(verify_run),
            "await_outcome": awaited,
        }
        try:
            yield named
        finally:
            loop.run_until_complete(watcher.close())
            loop.close()


def _both(first: Any, second: Any) -> Any:
    one = yield from first
    two = yield from second
    return one, two
