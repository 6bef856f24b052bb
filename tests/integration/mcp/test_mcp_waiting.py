"""After the call: approvals, waiting for an ending, client timeouts, the status tool."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from mcp import MCPError

from outbox import Operation, Registry, Settings
from outbox import store as outbox_store
from outbox.mcp.tools import RECORDED_META, RUN_ID_META, STATUS_TOOL

from support.db_helpers import committed_counts, execute_admin
from support.mcp_cases import (
    PAYMENT,
    S,
    connected,
    escalate,
    key,
    meta,
    now,
    only_operation,
    operation_count,
    outcome_of,
    stored,
    text_of,
)
from support.ops_helpers import Ops
from support.waiting import eventually


def off_the_loop(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """A condition that blocks (a database query) runs in a thread: the server under test
    shares this event loop and must keep serving meanwhile."""
    return lambda: asyncio.to_thread(predicate)


# --- waiting and answering -------------------------------------------------------------


async def test_an_approval_is_asked_of_a_person_and_the_call_returns_at_once(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    # A wait far beyond the test's own timeout: only an answer before it can pass.
    async with connected(registry, settings, wait=600) as client:
        result = await client.call_tool(
            "pay", {**PAYMENT, "amount_cents": 60_000}, meta=key("call_big")
        )

    operation = only_operation(database_url)
    outcome = outcome_of(result)
    assert (outcome.status, outcome.needs_person, outcome.approval) == (
        "awaiting_approval",
        True,
        "missing",
    )
    assert result.is_error is False
    assert text_of(result) == (
        f"Waiting for a person to approve {operation.display_id} (approval required when "
        "amount_cents > 50000). Tell the user; do not retry."
    )


def reject(ops: Ops, operation: Operation) -> None:
    claimed = ops.move(operation, S.IN_FLIGHT)
    ops.run(
        outbox_store.transition(
            operation.id,
            source=S.IN_FLIGHT,
            target=S.REJECTED,
            lease_token=claimed.lease_token,
            error_class="card_declined",
        )
    )


def commit(ops: Ops, operation: Operation) -> None:
    ops.move(ops.move(operation, S.IN_FLIGHT), S.COMMITTED)


SETTLEMENTS = {
    "committed": (commit, False, "Done: {tool} committed (provider reference re_found)."),
    "rejected": (
        reject,
        True,
        "Not done: {tool} was rejected (card_declined). Do not retry with the same key; a "
        "changed request is a new decision.",
    ),
    "escalated": (
        escalate,
        False,
        "The outcome of {id} is unknown and a person is checking it with the evidence. Do "
        "not retry; tell the user.",
    ),
}


@pytest.mark.parametrize("ending", sorted(SETTLEMENTS))
async def test_a_waiting_call_reports_progress_and_answers_how_it_ended(
    registry: Registry, settings: Settings, database_url: str, ops: Ops, ending: str
) -> None:
    settle, is_error, expected = SETTLEMENTS[ending]
    reports: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        reports.append((progress, total, message))

    async with connected(registry, settings, wait=600) as client:
        call = asyncio.ensure_future(
            client.call_tool(
                "notify", {"to": "a", "body": "b"}, meta=key("c"), progress_callback=on_progress
            )
        )
        await eventually(
            now(lambda: bool(reports)),
            within=30,
            what="a progress notification while the call waits",
        )
        operation = only_operation(database_url)
        await asyncio.to_thread(settle, ops, operation)
        result = await asyncio.wait_for(call, timeout=30)

    outcome = outcome_of(result)
    assert outcome.status == ending
    assert result.is_error is is_error
    assert text_of(result) == expected.format(tool="notify", id=operation.display_id)
    done, total, message = reports[0]
    assert total == 600
    assert 0 < done <= 600
    assert message == f"{operation.display_id} is pending"
    assert all(a[0] < b[0] for a, b in itertools.pairwise(reports))


async def test_a_client_timeout_never_cuts_the_recording_and_the_retry_finds_it(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    # Hold the operations table so that recording is stuck mid-transaction when the client
    # gives up; without the shield, the cancellation would roll the decision back. Over a
    # message transport (legacy mode), as on stdio: in process, the client awaits the
    # handler itself and could not time out while the recording is shielded. The client
    # gives up after 1 s, well inside the 5 s a decision waits for a lock (DecisionBlocked
    # after that) on a busy machine too, and the lock is released as soon as it has.
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE operations IN EXCLUSIVE MODE")
        async with connected(registry, settings, wait=1, mode="legacy") as client:
            call = asyncio.ensure_future(
                client.call_tool("pay", PAYMENT, read_timeout_seconds=1, meta=key("call_t"))
            )
            await eventually(
                off_the_loop(lambda: recording_waits_for_the_lock(database_url)),
                within=8,
                what="the recording transaction to wait for the table lock",
            )
            with pytest.raises(MCPError) as timed_out:
                await call
            assert timed_out.value.code == -32001  # the client's own timeout
            assert operation_count(database_url) == 0
            blocker.rollback()

            await eventually(
                off_the_loop(lambda: operation_count(database_url) == 1),
                within=20,
                what="the abandoned call's decision to commit",
            )
            retry = await client.call_tool("pay", PAYMENT, meta=key("call_t"))

    operation = only_operation(database_url)
    assert outcome_of(retry).operation_id == operation.id
    assert retry.meta is not None
    assert retry.meta[RECORDED_META] == "existing"
    counts = committed_counts(database_url)
    assert (counts.operations, counts.outbox) == (1, 1)


def recording_waits_for_the_lock(database_url: str) -> bool:
    rows = execute_admin(
        database_url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-mcp' "
        "AND wait_event_type = 'Lock' AND datname = current_database()",
    )
    return bool(rows[0][0])


async def test_a_database_that_fails_the_recording_asks_for_a_retry(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings) as client:
        await client.call_tool("lookup", {"ref": "ref_1"})  # the pool holds a connection now
        execute_admin(
            database_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'outbox-mcp' AND datname = current_database()",
        )
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        retry = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert result.is_error is True
    assert text_of(result).startswith("Not done yet: the runtime could not record this call")
    assert "Call again with the same arguments and decision key" in text_of(result)
    assert retry.is_error is False
    assert outcome_of(retry).decision_key == "call_1"


# --- the status tool ---------------------------------------------------------------


async def test_the_status_tool_reads_an_operation_of_the_callers_run(
    registry: Registry, settings: Settings, database_url: str, ops: Ops
) -> None:
    async with connected(registry, settings) as client:
        recorded = outcome_of(await client.call_tool("pay", PAYMENT, meta=key("call_1")))
        pending = await client.call_tool(STATUS_TOOL, {"operation_id": recorded.display_id})
        await asyncio.to_thread(commit, ops, stored(database_url, recorded.operation_id))
        status = await client.call_tool(STATUS_TOOL, {"operation_id": recorded.display_id})
        bare = await client.call_tool(STATUS_TOOL, {"operation_id": str(recorded.operation_id)})
        other_run = await client.call_tool(
            STATUS_TOOL, {"operation_id": recorded.display_id}, meta=meta({RUN_ID_META: "someone"})
        )

    assert status.is_error is False
    assert outcome_of(status).status == "committed"
    assert outcome_of(status).provider_reference == "re_found"
    assert text_of(status) == "Done: pay committed (provider reference re_found)."
    assert outcome_of(bare).operation_id == recorded.operation_id
    assert text_of(pending) == (
        f"Accepted as {recorded.display_id} and not settled yet. To check, call {STATUS_TOOL} "
        f"with operation_id {recorded.display_id}; do not start a new call."
    )
    assert outcome_of(pending).status == "pending"
    assert other_run.is_error is True
    assert text_of(other_run) == f"No operation {recorded.display_id} was recorded in this run."
    assert other_run.structured_content is None


@pytest.mark.parametrize(
    "operation_id", ["op_not-a-uuid", 7, None, "op_00000000-0000-4000-8000-000000000000"]
)
async def test_the_status_tool_refuses_what_it_cannot_find(
    registry: Registry, settings: Settings, operation_id: Any
) -> None:
    arguments = {} if operation_id is None else {"operation_id": operation_id}
    async with connected(registry, settings) as client:
        result = await client.call_tool(STATUS_TOOL, arguments)

    assert result.is_error is True
    text = text_of(result)
    if isinstance(operation_id, str) and operation_id.startswith("op_0"):
        assert text == f"No operation {operation_id} was recorded in this run."
    else:
        assert text.startswith("operation_id must be the id an earlier answer gave")
