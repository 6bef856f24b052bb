"""Each component does its whole job as its own login and nothing more."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest
from pydantic import SecretStr

from dispatcher.daemon import Dispatcher
from outbox import (
    Operation,
    OperationState,
    OutcomeStatus,
    OutcomeWatcher,
    Registry,
    Settings,
    await_outcome,
    await_outcome_sync,
    check_approval,
    grant_approval,
    record_decision,
)
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.breaker import BreakerRules, BreakerState, Failure
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.cli import run_command
from outbox.errors import DatabaseError, DecisionConflict
from outbox.models import ApprovalStatus, CallbackOutcome
from outbox.states import EventName
from outbox.store import Store

from support.broker_helpers import read_all
from support.db_helpers import execute_admin
from support.logins import Login
from support.logs import Ran, statements_seen
from support.roles_cases import (
    AGENT,
    CALLBACKS,
    COMPONENT_QUERIES,
    CONSUMER,
    DISPATCHER,
    LEASE,
    OPERATOR,
    S,
    advance,
    new_operation,
    run,
    snapshot,
)
from support.waiting import eventually_sync


@pytest.fixture
def ran() -> Iterator[Ran]:
    with statements_seen() as seen:
        yield seen


def queries_run_by(ran: Ran, url: str) -> set[str]:
    return ran.by(urlsplit(url).username)


# --- each component does its job with its own role --------------------------------


def test_the_agent_records_decisions_and_reads_them_back(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    agent = login(AGENT)
    refund = {"payment_id": "pay_1", "amount_cents": 100}

    with psycopg.connect(agent) as connection:
        first = record_decision(
            connection, registry, "send_refund", refund, run_id="r", decision_key="k"
        )
    with psycopg.connect(agent) as connection:
        again = record_decision(
            connection, registry, "send_refund", refund, run_id="r", decision_key="k"
        )
    with psycopg.connect(agent) as connection, pytest.raises(DecisionConflict):
        record_decision(
            connection,
            registry,
            "send_refund",
            {**refund, "amount_cents": 101},
            run_id="r",
            decision_key="k",
        )

    # The agent learns how its decisions stand: running, or waiting for a person.
    with psycopg.connect(agent) as connection:
        large = record_decision(
            connection,
            registry,
            "send_refund",
            {**refund, "amount_cents": 60_000},
            run_id="r",
            decision_key="large",
        )
    # What it says of its own operation waits for the reconciler, outside the chain.
    with psycopg.connect(agent) as connection:
        Store(connection).run(
            outbox_store.report_agent_completed(first.operation.id, {"agent.outcome": "ok"})
        )
    running = await_outcome_sync(agent, first, timeout=0)
    waiting = asyncio.run(await_outcome(agent, large, timeout=0))
    with psycopg.connect(agent) as connection:
        approval = check_approval(connection, large.operation.id)

    assert (first.created, again.created) == (True, False)
    assert again.operation.id == first.operation.id
    assert (running.status, waiting.status) == ("pending", "awaiting_approval")
    assert approval.status is ApprovalStatus.MISSING
    assert execute_admin(roles_database, "SELECT state FROM operations") == [
        ("prepared",),
        ("prepared",),
    ]
    assert execute_admin(roles_database, "SELECT count(*) FROM outbox") == [(2,)]
    assert execute_admin(roles_database, "SELECT name FROM operation_events") == [
        ("operation.prepared",),
        ("operation.prepared",),
    ]
    assert queries_run_by(ran, agent) == COMPONENT_QUERIES[AGENT]


async def test_the_agent_awaits_an_approval_an_operator_grants(
    login: Login, registry: Registry, ran: Ran
) -> None:
    agent, operator = login(AGENT), login(OPERATOR)
    with psycopg.connect(agent) as connection:
        large = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 60_000},
            run_id="r",
            decision_key="large",
        )

    async with OutcomeWatcher(agent, poll_interval=0.2) as watcher:
        before = await watcher.wait(large, timeout=0)
        with psycopg.connect(operator) as connection:
            grant_approval(
                connection, large.operation.id, approved_by="lead", ttl=timedelta(hours=1)
            )
        after = await watcher.wait(large, timeout=0)

    assert before.status is OutcomeStatus.AWAITING_APPROVAL
    assert (before.approval, before.reason) == (ApprovalStatus.MISSING, "approval_missing")
    assert (after.status, after.approval) == (OutcomeStatus.PENDING, ApprovalStatus.VALID)
    assert {"listen_operation_changes", "operation_outcomes_changed"} <= queries_run_by(ran, agent)


async def test_the_dispatcher_publishes_what_the_agent_recorded(
    login: Login,
    registry: Registry,
    roles_database: str,
    settings: Settings,
    amqp_server_url: str,
    ran: Ran,
) -> None:
    agent, dispatcher_url = login(AGENT), login(DISPATCHER)
    recorded = [new_operation(agent, registry) for _ in range(3)]
    dispatcher = Dispatcher(settings.model_copy(update={"database_url": SecretStr(dispatcher_url)}))

    report = await dispatcher.drain()
    messages = await read_all(amqp_server_url, settings.queue, expect=3)
    async with await psycopg.AsyncConnection.connect(dispatcher_url) as database:
        backlog = await dispatcher.refresh_backlog(database)
    async with await psycopg.AsyncConnection.connect(dispatcher_url, autocommit=True) as listener:
        await (await outbox_store.AsyncStore.on(listener, require_transaction=False)).run(
            outbox_store.listen_outbox_pending()
        )
    await dispatcher.prune()  # under the default retention: nothing is old enough yet
    # A publish that failed, then retention with no grace: the dispatcher's other writes.
    ((first_row,),) = execute_admin(roles_database, "SELECT min(id) FROM outbox")
    failed = outbox_store.FailedPublish(first_row, "broker said no", timedelta(0))
    run(dispatcher_url, outbox_store.mark_outbox_failed([failed]))
    deleted = run(dispatcher_url, outbox_store.delete_published_outbox_rows(timedelta(0), 10))
    # The gauge on a table past its exact-count threshold (here any table).
    by_state = run(dispatcher_url, outbox_store.operations_by_state(exact_below=0))
    # A batch past its soft deadline: is the server working on it? Its own backends only.
    with psycopg.connect(dispatcher_url) as watched:
        pid = watched.info.backend_pid
        assert pid in run(dispatcher_url, outbox_store.backend_activity())
    # A batch waiting for a lock: whom it waits for, whatever that session's role.
    waited_for, holder = whom_a_waiting_session_names(dispatcher_url, roles_database)
    assert [(h.pid, h.role) for h in waited_for] == [holder]

    assert (report.published, report.failed) == (3, 0)
    assert sorted(m.body.operation_id for m in messages) == sorted(o.id for o in recorded)
    assert backlog.pending == 0
    assert deleted == 3
    assert by_state[OperationState.PREPARED] == 3
    assert execute_admin(roles_database, "SELECT count(*) FROM outbox") == [(0,)]
    assert queries_run_by(ran, dispatcher_url) == COMPONENT_QUERIES[DISPATCHER]


def whom_a_waiting_session_names(
    url: str, admin_url: str
) -> tuple[tuple[outbox_store.LockHolder, ...], tuple[int, str]]:
    """A session of ``url`` waits for a lock the tables' owner holds: whom that login
    finds it waiting for (lock_blockers), and the holder's pid and role."""
    key = secrets.randbits(62)
    with psycopg.connect(admin_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        with psycopg.connect(url, autocommit=True) as waiter:
            pid = waiter.info.backend_pid
            waiting = threading.Thread(
                target=lambda: waiter.execute("SELECT pg_advisory_lock(%s)", (key,)),
                daemon=True,
            )
            waiting.start()
            found: list[tuple[outbox_store.LockHolder, ...]] = []

            def named() -> bool:
                found.append(run(url, outbox_store.lock_blockers(pid)))
                return bool(found[-1])

            eventually_sync(named, within=10, what="the session to wait for the lock")
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
            waiting.join(timeout=10)
        row = holder.execute("SELECT current_user").fetchone()
        assert row is not None
        return found[-1], (holder.info.backend_pid, str(row[0]))


def test_the_consumer_executes_reconciles_and_escalates(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    consumer = login(CONSUMER)
    waiting = new_operation(roles_database, registry, amount_cents=60_000)
    executed = new_operation(roles_database, registry)
    unknown = advance(roles_database, new_operation(roles_database, registry), S.IN_FLIGHT)
    unknown = advance(roles_database, unknown, S.OUTCOME_UNKNOWN)
    stale = new_operation(roles_database, registry)
    execute_admin(
        roles_database,
        "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE operation_id = %s",
        (stale.id,),
    )

    # At start: is the schema there? The catalog answers without a grant.
    with psycopg.connect(consumer) as connection:
        assert outbox_schema.schema_is_current(connection)
    # The key of the short fingerprints its spans show.
    assert len(run(consumer, outbox_store.fingerprint_key())) == 64
    # A message arrives: load, check the approval, note the wait.
    assert run(consumer, outbox_store.find_operation(waiting.id)) == waiting
    check = run(consumer, outbox_store.check_approval(waiting.id))
    assert check.status is ApprovalStatus.MISSING
    run(consumer, outbox_store.append_event(waiting, EventName.APPROVAL_REQUIRED, {}))
    # Its gauges of what waits: to be executed, and for an approval.
    assert run(consumer, outbox_store.execution_gauges()).awaiting_approval == 1
    # Its liveness probe sees its own backends, state included, without a grant.
    with psycopg.connect(consumer) as watched:
        watched.execute("SELECT 1")
        activity = run(consumer, outbox_store.backend_activity())
        assert activity[watched.info.backend_pid][0] == "idle in transaction"
    # A transaction waiting for a lock: whom it waits for, whatever that session's role.
    waited_for, holder = whom_a_waiting_session_names(consumer, roles_database)
    assert [(h.pid, h.role) for h in waited_for] == [holder]
    # Claim and execute: prepared -> in_flight -> committed.
    committed = advance(consumer, executed, S.IN_FLIGHT, S.COMMITTED)
    # The reconciler: requeue a lost message, lease an unknown outcome, defer a lookup,
    # then give up on it: outcome_unknown -> escalated.
    requeued = run(consumer, outbox_store.requeue_stale_prepared(timedelta(0), 10))
    # ... and end what nothing would move: escalate what keeps coming back undelivered,
    # reject what was denied and never granted.
    execute_admin(
        roles_database,
        "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE operation_id = %s",
        (stale.id,),
    )
    # A consumer without its tool refused the requeued message: the evidence.
    run(consumer, outbox_store.append_event(stale, EventName.DEAD_LETTERED, {"reason": "x"}))
    assert run(consumer, outbox_store.escalate_undeliverable(timedelta(0), 1, 10)) == [
        (stale.id, "send_refund")
    ]
    assert run(consumer, outbox_store.reject_denied_operations(timedelta(hours=1), 10)) == []
    with psycopg.connect(consumer) as connection:
        runner = Store(connection)
        (due,) = runner.run(outbox_store.claim_reconciliation_batch(10))
        leased = runner.run(outbox_store.lease_for_reconciliation(due, owner="r", lease=LEASE))
        assert leased is not None
        runner.run(
            outbox_store.defer_reconciliation(
                leased.id, lease_token=leased.lease_token, reason="lookup_failed", delay=LEASE
            )
        )
    gave_up = advance(consumer, run(consumer, outbox_store.get_operation(unknown.id)), S.ESCALATED)
    # It chains what the agents reported (one, by the owner here, on the stale one).
    run(roles_database, outbox_store.report_agent_completed(stale.id, {"agent.outcome": "x"}))
    assert run(consumer, outbox_store.chain_agent_reports(10)) == 1
    # A burst of deliveries: loaded, claimed and committed together.
    burst = new_operation(roles_database, registry)
    assert run(consumer, outbox_store.find_operations([burst.id])) == {burst.id: burst}
    (claimed,) = run(consumer, outbox_store.claim_many([(burst.id, LEASE)], owner="w")).values()
    effect = outbox_store.ConfirmedEffect(
        operation=claimed, provider_reference="re_burst", result={}, attributes={}
    )
    assert run(consumer, outbox_store.commit_many([effect]))[burst.id].state is S.COMMITTED
    # ... or claimed without a read first, matched to what its message says.
    delivered = new_operation(roles_database, registry)
    (taken,) = run(
        consumer,
        outbox_store.claim_deliveries(
            [
                outbox_store.DeliveryClaim(
                    delivered.id,
                    delivered.tool_name,
                    delivered.tool_version,
                    delivered.input_fingerprint,
                    lease=LEASE,
                )
            ],
            owner="w",
        ),
    ).values()
    assert taken.operation.state is S.IN_FLIGHT
    assert taken.before.first_attempt_at is None
    # A provider's callback about it: claimed with its operation, read under the
    # operation's lock, applied once.
    run(
        roles_database,
        outbox_store.record_callback(
            "payments",
            CallbackReport(
                event_id="evt_1",
                status=CallbackStatus.COMMITTED,
                operation_id=burst.id,
                provider_reference="re_burst",
            ),
            "0" * 64,
        ),
    )
    with psycopg.connect(consumer) as connection:
        runner = Store(connection)
        (callback,) = runner.run(outbox_store.claim_callback_batch(["send_refund.v1"], 10))
        locked = runner.run(outbox_store.lock_operation(burst.id))
        assert locked is not None
        assert runner.run(outbox_store.callbacks_of([burst.id])) == {burst.id: [callback]}
        runner.run(outbox_store.mark_callback(callback, CallbackOutcome.CONFIRMED))
    assert execute_admin(roles_database, "SELECT outcome FROM callbacks") == [("confirmed",)]
    # Its provider breaker: failures of two operations open it; meanwhile a prepared and
    # an unknown operation wait; the probe goes out; the answer closes the breaker and
    # releases them.
    rules = BreakerRules(failures_to_open=2)
    for failing in (burst.id, delivered.id):
        change = run(
            consumer,
            outbox_store.record_provider_failure(
                "send_refund", Failure(failing, "http_503"), rules=rules
            ),
        )
    assert change.opened
    breakers, _ = run(consumer, outbox_store.provider_health(["send_refund"]))
    assert run(consumer, outbox_store.provider_still_unavailable("send_refund"))
    assert breakers["send_refund"].state is BreakerState.OPEN
    held = new_operation(roles_database, registry)
    assert run(
        consumer,
        outbox_store.wait_prepared(
            [(held, LEASE)], provider="send_refund", reason="provider_unavailable"
        ),
    ) == {held.id}
    lost = advance(roles_database, new_operation(roles_database, registry), S.IN_FLIGHT)
    lost = advance(roles_database, lost, S.OUTCOME_UNKNOWN)
    run(
        consumer,
        outbox_store.wait_unknown(lost, delay=LEASE, provider="send_refund", reason="http_503"),
    )
    assert run(consumer, outbox_store.waiting_operations_by_tool()) == {"send_refund": 2}
    # A declared rate's turn, booked for every consumer alike.
    turn = outbox_store.book_provider_call(
        "send_refund", interval=timedelta(seconds=1), burst=1, horizon=LEASE
    )
    assert run(consumer, turn) == 0.0
    # ... and a place among the calls out at once: one of one, then none left.
    first = outbox_store.take_provider_call("send_refund", held.id, limit=1, hold=LEASE)
    second = outbox_store.take_provider_call("send_refund", lost.id, limit=1, hold=LEASE)
    assert run(consumer, first) is None
    assert run(consumer, second) is not None
    run(consumer, outbox_store.give_back_provider_call("send_refund", held.id))
    assert run(consumer, second) is None
    execute_admin(roles_database, "UPDATE provider_health SET next_probe_at = now()")
    nominated = run(consumer, outbox_store.nominate_probe(["send_refund"]))
    assert nominated in {held.id, lost.id}
    probe = outbox_store.take_provider_probe("send_refund", owner="probe", lease=LEASE)
    assert run(consumer, probe) is not None
    closing = outbox_store.record_provider_answer(
        "send_refund", tools=["send_refund"], release_spread=timedelta(seconds=1)
    )
    closed = run(consumer, closing)
    assert closed is not None
    assert closed.closed
    # The answer ended their wait: a later failure starts a wait of its own, and the
    # outage tolerance counts from there, not from before this outage.
    assert execute_admin(
        roles_database,
        "SELECT count(*) FROM operations WHERE id = ANY(%s) AND waiting_since IS NOT NULL",
        ([held.id, lost.id],),
    ) == [(0,)]
    assert execute_admin(roles_database, "SELECT name FROM provider_events ORDER BY id") == [
        ("provider.unavailable",),
        ("provider.available",),
    ]

    assert committed.state is S.COMMITTED
    assert requeued == [stale.id]
    assert due.id == unknown.id
    assert gave_up.state is S.ESCALATED
    assert queries_run_by(ran, consumer) == COMPONENT_QUERIES[CONSUMER]


def test_the_callbacks_receiver_records_callbacks_and_nothing_else(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    receiver = login(CALLBACKS)
    operation = new_operation(roles_database, registry)
    before = execute_admin(roles_database, "SELECT state, lease_token FROM operations")

    with psycopg.connect(receiver) as connection:
        assert outbox_schema.schema_is_current(connection)
    report = CallbackReport(
        event_id="evt_1", status=CallbackStatus.COMMITTED, operation_id=operation.id
    )
    first = run(receiver, outbox_store.record_callback("payments", report, "a" * 64))
    again = run(receiver, outbox_store.record_callback("payments", report, "a" * 64))
    stranger = CallbackReport(event_id="evt_2", status=CallbackStatus.REJECTED)
    unmatched = run(receiver, outbox_store.record_callback("payments", stranger, "b" * 64))

    assert (first.result, again.result, unmatched.result) == ("recorded", "duplicate", "unmatched")
    assert execute_admin(roles_database, "SELECT state, lease_token FROM operations") == before
    assert run(roles_database, outbox_store.verify_chain(operation.id)).intact
    assert queries_run_by(ran, receiver) == COMPONENT_QUERIES[CALLBACKS]


@pytest.mark.parametrize("target", [S.COMMITTED, S.REJECTED, S.PREPARED])
def test_the_consumer_cannot_resolve_an_escalation(
    login: Login, roles_database: str, seeded: dict[str, Operation], target: OperationState
) -> None:
    consumer = login(CONSUMER)
    operation = seeded["escalated"]
    before = snapshot(roles_database)

    with pytest.raises(DatabaseError) as refused:
        run(consumer, outbox_store.transition(operation.id, source=S.ESCALATED, target=target))

    assert type(refused.value) is DatabaseError
    assert isinstance(refused.value.driver_error, psycopg.errors.InsufficientPrivilege)
    assert "operations_escalation_operator_only" in str(refused.value)
    assert "only a member of outbox_operator may resolve it" in str(
        refused.value.driver_error.diag.message_primary
    )
    assert snapshot(roles_database) == before


def test_the_operator_resolves_escalations_and_decides_approvals(
    login: Login,
    roles_database: str,
    seeded: dict[str, Operation],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ran: Ran,
) -> None:
    operator = login(OPERATOR)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", operator)
    waiting, stuck = seeded["waiting"], seeded["escalated"]

    codes = [
        run_command(["ops", "list"]),
        # A tool's list is a statement of its own (list_tool_operation_summaries).
        run_command(["ops", "list", "--tool", "send_refund"]),
        run_command(["ops", "show", stuck.display_id[:11]]),
        # What waits for approval shows its check and who decided (latest_approval,
        # console_operation_approvals); `approvals pending` reads both in one statement.
        run_command(["ops", "show", waiting.display_id]),
        run_command(["ops", "verify", stuck.display_id]),
        run_command(["ops", "verify", "--all"]),
        run_command(["stats"]),
        run_command(["approvals", "pending"]),
        run_command(
            [
                "ops",
                "resolve",
                stuck.display_id,
                "--committed",
                "--provider-ref",
                "re_found",
                "--evidence",
                "seen on the provider dashboard",
                "--by",
                "oncall@example.com",
            ]
        ),
        run_command(["approvals", "grant", waiting.display_id, "--by", "lead@example.com"]),
        # Over a filter: the dry run selects (escalations_matching), changes nothing.
        run_command(
            [
                "ops",
                "resolve",
                "--run",
                stuck.run_id,
                "--rejected",
                "--evidence",
                "e",
                "--by",
                "ana",
            ]
        ),
        run_command(["callbacks", "list", "--unmatched"]),
    ]
    rows = run(operator, outbox_store.outbox_rows(waiting.id))
    # `outbox providers`: the breakers, a provider's outages, who waits.
    assert run(operator, outbox_store.all_providers()) == []
    assert run(operator, outbox_store.provider_events("send_refund")) == []
    assert run(operator, outbox_store.waiting_operations_by_tool()) == {}
    # `outbox stats` and the overview on a large table estimate the settled operations
    # from a sample (here forced with a threshold of 0): a catalog read and a sample.
    assert run(operator, outbox_store.operation_stats(exact_below=0)).estimated
    # `outbox dlq discard` records a dead letter before removing it; `dlq discarded`.
    discard = outbox_store.DeadLetterDiscard(
        message_id="outbox-1",
        operation_ids=(stuck.id,),
        tools=("send_refund",),
        body_sha256="0" * 64,
        body_bytes=10,
        death_reason="rejected",
        died_at=None,
        reason="poison, seen in the log",
        discarded_by="oncall@example.com",
    )
    [recorded] = run(operator, outbox_store.record_discarded_dead_letters([discard]))
    assert run(operator, outbox_store.list_discarded_dead_letters(10)) == [recorded]

    assert codes == [0] * len(codes), capsys.readouterr().err
    assert run(roles_database, outbox_store.get_operation(stuck.id)).state is S.COMMITTED
    assert run(roles_database, outbox_store.check_approval(waiting.id)).is_valid
    assert len(rows) == 2  # the decision's row and the one the grant queued
    assert queries_run_by(ran, operator) == COMPONENT_QUERIES[OPERATOR]
