"""What stays readable once an operation moved to history (docs/operating.md "History
retention"): the agent's await_outcome and get_outcome, `outbox ops show`, `ops list
--archived` and `ops verify`, short ids across the hot tables and history; and every
operator action on an archived operation refused, saying why, with nothing changed."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import (
    OperationState,
    OutcomeStatus,
    OutcomeWatcher,
    Registry,
    await_outcome,
    await_outcome_sync,
    get_outcome,
)
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.cli import run_command
from outbox.errors import OperationNotFound
from outbox.models import Operation
from outbox.operator import views
from outbox.operator.dlq import DeadLetter
from outbox.operator.dlq_discard import discard_fate
from outbox.store import Store

from support import history_helpers
from support.db_helpers import execute_admin
from support.history_helpers import approved, archive_all, settled_days_ago
from support.ops_helpers import LEASE, Ops

S = OperationState
RUN = "run-archived-reads"


@pytest.fixture
def ops(database_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Ops:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    return Ops(database_url, registry)


decided = functools.partial(history_helpers.decided, run_id=RUN)


def settle(ops: Ops, operation: Operation, target: OperationState) -> Operation:
    """Attempted once and settled as a worker settles it: a committed one with its
    provider's reference and result, a rejected one with its error class."""
    claimed = ops.run(outbox_store.claim(operation.id, owner="worker-a", lease=LEASE))
    assert claimed is not None
    settled: Operation = ops.run(
        outbox_store.transition(
            operation.id,
            source=S.IN_FLIGHT,
            target=target,
            lease_token=claimed.lease_token,
            provider_reference="re_archived" if target is S.COMMITTED else None,
            result={"refund_id": "re_archived"} if target is S.COMMITTED else None,
            error_class="card_declined" if target is S.REJECTED else None,
        )
    )
    return settled


def archived(ops: Ops, *operations: Operation, days: int = 3) -> None:
    for operation in operations:
        settled_days_ago(ops.database_url, operation.id, days)
    archive_all(ops)
    for operation in operations:
        assert execute_admin(
            ops.database_url, "SELECT count(*) FROM operations WHERE id = %s", (operation.id,)
        ) == [(0,)]


def run(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = run_command(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- the agent --------------------------------------------------------------------------


def test_await_outcome_answers_an_archived_operation_with_its_final_outcome(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    recorded = decided(database_url, registry, "refund-kept")
    committed = settle(ops, recorded.operation, S.COMMITTED)
    rejected = settle(ops, decided(database_url, registry, "refund-declined").operation, S.REJECTED)
    archived(ops, committed, rejected)

    async def waits() -> list[Any]:
        by_id = await await_outcome(database_url, committed.id, timeout=5, until="final")
        by_key = await await_outcome(database_url, recorded, timeout=5, until="final")
        declined = await await_outcome(database_url, rejected.id, timeout=5)
        return [by_id, by_key, declined]

    by_id, by_key, declined = asyncio.run(waits())
    blocking = await_outcome_sync(database_url, committed.id, timeout=5)
    with psycopg.connect(database_url) as connection:
        once = get_outcome(connection, committed.id)

    for outcome in (by_id, by_key, blocking, once):
        assert outcome.status is OutcomeStatus.COMMITTED
        assert outcome.final
        assert outcome.operation_id == committed.id
        assert outcome.decision_key == "refund-kept"
        assert (outcome.tool, outcome.tool_version) == ("send_refund", 1)
        assert outcome.provider_reference == "re_archived"
        assert outcome.result == {"refund_id": "re_archived"}
        assert outcome.attempts == 1
    assert declined.status is OutcomeStatus.REJECTED
    assert declined.reason == "card_declined"
    assert declined.result is None


def test_a_retried_decision_answered_from_history_can_be_awaited(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    first = decided(database_url, registry, "refund-retried")
    committed = settle(ops, first.operation, S.COMMITTED)
    archived(ops, committed)

    again = decided(database_url, registry, "refund-retried")
    outcome = await_outcome_sync(database_url, again, timeout=5)

    assert again.created is False
    assert again.operation.id == committed.id
    assert outcome.status is OutcomeStatus.COMMITTED
    assert outcome.provider_reference == "re_archived"


async def test_one_watcher_answers_hot_and_archived_waiters_together(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    old = settle(ops, decided(database_url, registry, "refund-old").operation, S.COMMITTED)
    archived(ops, old)
    hot = decided(database_url, registry, "refund-new")

    async with OutcomeWatcher(database_url, poll_interval=0.2) as watcher:
        waiting_hot = asyncio.ensure_future(watcher.wait(hot, timeout=10, until="final"))
        answered_old = await watcher.wait(old.id, timeout=5)
        await asyncio.to_thread(settle, ops, hot.operation, S.REJECTED)
        answered_hot = await waiting_hot

    assert answered_old.status is OutcomeStatus.COMMITTED
    assert answered_old.operation_id == old.id
    assert answered_hot.status is OutcomeStatus.REJECTED


def test_an_archived_operation_recorded_without_a_key_is_named_not_lost(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    keyless = settle(ops, decided(database_url, registry, None).operation, S.COMMITTED)
    archived(ops, keyless)

    with pytest.raises(OperationNotFound, match="recorded without a decision key") as waited:
        asyncio.run(await_outcome(database_url, keyless.id, timeout=1))
    with psycopg.connect(database_url) as connection, pytest.raises(OperationNotFound) as read:
        get_outcome(connection, keyless.id)
    with pytest.raises(OperationNotFound, match="is visible"):
        await_outcome_sync(database_url, UUID(int=5), timeout=0)

    assert f"outbox ops show {keyless.display_id}" in str(waited.value)
    assert "recorded without a decision key" in str(read.value)


def test_the_outcome_outlives_its_day_of_history_for_a_caller_with_the_key(
    ops: Ops, database_url: str, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded = decided(database_url, registry, "refund-dropped")
    committed = settle(ops, recorded.operation, S.COMMITTED)
    archived(ops, committed, days=200)
    code, _, err = run("history", "drop", "--retention", "30d", capsys=capsys)
    assert code == 0, err

    by_key = await_outcome_sync(database_url, recorded, timeout=0)
    with pytest.raises(OperationNotFound, match="is visible"):
        await_outcome_sync(database_url, committed.id, timeout=0)

    assert by_key.status is OutcomeStatus.COMMITTED
    assert by_key.provider_reference == "re_archived"


# --- the operator's reads ---------------------------------------------------------------


def test_ops_show_reads_an_archived_operation_by_short_id_with_a_paged_timeline(
    ops: Ops, database_url: str, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    operation = approved(ops)
    ops.lengthen(operation.id, 5)
    committed = settle(ops, operation, S.COMMITTED)
    every = [e.id for e in ops.events(committed.id)]
    archived(ops, committed)
    short = committed.display_id[:11]

    code, text, err = run("ops", "show", short, "--events", "3", capsys=capsys)
    _, first_page, _ = run("ops", "show", short, "--events", "3", "--after", "0", capsys=capsys)
    _, as_json, _ = run("ops", "show", committed.display_id, "--json", capsys=capsys)
    shown = json.loads(as_json)

    assert code == 0, err
    assert committed.display_id in text
    assert "archived" in text
    assert "moved to history" in text
    assert "granted by lead@example.com" in text
    assert f"events {len(every) - 2}-{len(every)} of {len(every)}" in text
    assert f"--before {every[-3]}" in text
    assert f"events 1-3 of {len(every)}" in first_page
    assert shown["id"] == committed.display_id
    assert shown["state"] == "committed"
    assert shown["provider_reference"] == "re_archived"
    assert shown["input"]["amount_cents"] == 90_000
    assert shown["fingerprint"] == ops.short(committed.input_fingerprint)
    assert [e["id"] for e in shown["events"]] == every
    assert shown["events_total"] == len(every)
    assert shown["approval"]["status"] == "valid"
    assert shown["approval"]["decided_by"] == "lead@example.com"
    assert (
        shown["archived"]["settled_on"]
        == execute_admin(
            database_url,
            "SELECT settled_on::text FROM history WHERE operation_id = %s",
            (committed.id,),
        )[0][0]
    )
    assert shown["archived"]["events"] == len(every)


def test_a_hot_operation_says_it_is_not_archived(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    operation = ops.at(S.COMMITTED)

    _, out, _ = run("ops", "show", operation.display_id, "--json", capsys=capsys)

    assert json.loads(out)["archived"] is None


def test_ops_list_includes_archived_operations_only_when_asked(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    older = [ops.at(S.COMMITTED), ops.at(S.REJECTED)]
    archived(ops, older[0], days=5)
    archived(ops, older[1], days=4)
    hot = [ops.at(S.COMMITTED), ops.at(S.ESCALATED)]

    def listed(*argv: str) -> list[dict[str, Any]]:
        code, out, err = run("ops", "list", "--json", *argv, capsys=capsys)
        assert code == 0, err
        result: list[dict[str, Any]] = json.loads(out)
        return result

    plain = listed()
    every = listed("--archived")
    limited = listed("--archived", "--limit", "3")
    rejected = listed("--archived", "--state", "rejected")
    escalated = listed("--archived", "--state", "escalated")
    _, text, _ = run("ops", "list", "--archived", capsys=capsys)

    assert [row["id"] for row in plain] == [hot[1].display_id, hot[0].display_id]
    assert "archived_at" not in plain[0]
    assert [row["id"] for row in every] == [
        hot[1].display_id,
        hot[0].display_id,
        older[1].display_id,
        older[0].display_id,
    ]
    assert [row["archived_at"] is None for row in every] == [True, True, False, False]
    assert [row["id"] for row in limited] == [row["id"] for row in every[:3]]
    assert [row["id"] for row in rejected] == [older[1].display_id]
    assert rejected[0]["tool"] == "send_refund"
    assert [row["id"] for row in escalated] == [hot[1].display_id]
    assert "ARCHIVED" in text
    assert "pay_1" not in text  # never the input


def test_ops_verify_checks_an_archived_chain_by_short_id(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    operation = ops.at(S.COMMITTED)
    archived(ops, operation)

    code, out, err = run("ops", "verify", operation.display_id[:11], capsys=capsys)

    assert code == 0, err
    assert "intact" in out
    assert "archived" in out


def twin_of(operation_id: UUID) -> UUID:
    """Another id that starts with the same short id (op_ and 8 hex digits)."""
    return UUID(operation_id.hex[:8] + "0" * 23 + "1")


def test_a_short_id_resolves_across_hot_and_history_and_a_shared_one_is_refused(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    old = ops.at(S.COMMITTED)
    archived(ops, old)
    alone = ops.at(S.COMMITTED)
    archived(ops, alone)
    twin = twin_of(old.id)
    execute_admin(
        database_url,
        "INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, input, "
        "input_fingerprint, requires_approval) SELECT %s, 'twin', o.tool_name, "
        "o.tool_version, o.side_effect, o.input, o.input_fingerprint, o.requires_approval "
        "FROM history h, jsonb_populate_record(NULL::operations, h.operation) o "
        "WHERE h.operation_id = %s",
        (twin, old.id),
    )

    shared = run("ops", "show", old.display_id[:11], capsys=capsys)
    found = run("ops", "show", alone.display_id[:11], capsys=capsys)
    resolved = run(
        "ops",
        "cancel",
        old.display_id[:11],
        "--reason",
        "x",
        "--by",
        "ana",
        capsys=capsys,
    )

    assert shared[0] == 1
    assert "is ambiguous" in shared[2]
    assert old.display_id in shared[2] or f"op_{twin}" in shared[2]
    assert found[0] == 0
    assert alone.display_id in found[1]
    assert resolved[0] == 1
    assert "is ambiguous" in resolved[2]
    assert ops.get(twin).state is S.PREPARED


def test_a_dead_letter_whose_operation_moved_says_it_is_archived(
    ops: Ops, database_url: str
) -> None:
    moved = ops.at(S.COMMITTED)
    archived(ops, moved)
    letters = [
        DeadLetter(
            message_id=f"outbox-{n}",
            envelope=OperationMessage(
                operation_id=operation_id,
                outbox_id=n + 1,
                tool="send_refund",
                tool_version=1,
                input_fingerprint=moved.input_fingerprint,
            ),
            body_bytes=100,
            deaths=(),
            first_death_reason="rejected",
            routing_key="send_refund.v1",
            delivery_count=1,
        )
        for n, operation_id in enumerate((moved.id, UUID(int=9)))
    ]

    with psycopg.connect(database_url) as connection:
        shown = views.dead_letter_views(Store(connection), letters)

    assert shown[0].why.startswith("archived: its operation settled committed")
    assert "nothing waits for this message" in discard_fate(shown[0])
    assert shown[1].why.startswith("unknown_operation")


# --- the operator's actions -------------------------------------------------------------


def everything(database_url: str) -> list[Any]:
    return [
        execute_admin(database_url, f"SELECT * FROM {table} ORDER BY 1")
        for table in ("operations", "operation_events", "approvals", "outbox", "history")
    ]


@pytest.mark.parametrize("named", ["full", "short"])
def test_every_operator_action_on_an_archived_operation_is_refused_saying_so(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str], named: str
) -> None:
    operation = ops.at(S.COMMITTED)
    archived(ops, operation)
    shown = operation.display_id if named == "full" else operation.display_id[:11]
    before = everything(database_url)
    by = ("--by", "ana")

    attempts = {
        "resolve": ["ops", "resolve", shown, "--rejected", "--evidence", "e", *by],
        "force": ["ops", "resolve", shown, "--rejected", "--evidence", "e", "--force", *by],
        "cancel": ["ops", "cancel", shown, "--reason", "r", *by],
        "grant": ["approvals", "grant", shown, *by],
        "deny": ["approvals", "deny", shown, *by],
    }
    answers = {what: run(*argv, capsys=capsys) for what, argv in attempts.items()}

    for what, (code, out, err) in answers.items():
        # One line, the command's refusal (the lifecycle's log lines may precede it).
        refusal = err.splitlines()[-1]
        assert code == 1, (what, out, err)
        assert refusal.startswith(("outbox ops: error: ", "outbox approvals: error: "))
        assert f"{operation.display_id} is archived" in refusal, (what, err)
        assert "moved to history" in refusal
        assert "nothing was changed" in refusal
    assert everything(database_url) == before
