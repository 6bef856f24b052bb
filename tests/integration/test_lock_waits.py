"""A daemon transaction that waits for a lock another session holds says whom it waits
for (the session's pid and role) while the wait goes on, instead of blaming the
database once a lock_timeout ends it (issue #46, item 2)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from outbox import OperationState, Registry, Settings, record_decision

from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import counter_value, running_dispatcher
from support.logs import records_of
from support.waiting import eventually

S = OperationState


def decide(engine: Any, registry: Registry) -> Any:
    with engine.begin() as connection:
        return record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_lock", "amount_cents": 700},
            run_id="run-lock",
        ).operation


def holder_of(connection: psycopg.Connection[Any]) -> str:
    row = connection.execute("SELECT current_user").fetchone()
    assert row is not None
    return f"pid {connection.info.backend_pid} (role {row[0]}, "


async def named_in_a_line(caplog: pytest.LogCaptureFixture, action: str, holder: str) -> None:
    async def said() -> bool:
        return any(
            str(getattr(record, "waiting_for", "")).startswith(holder)
            for record in records_of(caplog, action)
        )

    await eventually(said, within=20, what=f"{action} naming {holder}")


async def test_the_consumer_names_the_session_whose_row_lock_it_waits_for(
    settings: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    operation = decide(engine, registry)
    async with running_consumer(settings, registry) as consumer:
        with psycopg.connect(database_url) as holder:
            # An analyst's session (or any login's) holding the operation's row.
            holder.execute("SELECT 1 FROM operations WHERE id = %s FOR UPDATE", (operation.id,))
            async with running_dispatcher(settings):
                await named_in_a_line(caplog, "consumer.lock_wait", holder_of(holder))
                assert counter_value(consumer, "outbox_database_lock_waits_total") >= 1
                line = records_of(caplog, "consumer.lock_wait")[0]
                assert line.levelno == logging.WARNING
                assert "commit" in str(getattr(line, "do", ""))
                holder.rollback()
                await eventually(
                    in_state(database_url, operation.id, S.COMMITTED),
                    within=30,
                    what="the refund to commit once the lock is gone",
                )


async def test_the_dispatcher_names_the_session_whose_table_lock_it_waits_for(
    settings: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    operation = decide(engine, registry)
    with psycopg.connect(database_url) as holder:
        holder.execute("LOCK TABLE outbox IN EXCLUSIVE MODE")
        async with running_dispatcher(settings) as dispatcher:
            assert counter_value(dispatcher, "outbox_database_lock_waits_total") == 0
            await named_in_a_line(caplog, "dispatcher.lock_wait", holder_of(holder))
            assert counter_value(dispatcher, "outbox_database_lock_waits_total") >= 1
            holder.rollback()
            async with running_consumer(settings, registry):
                await eventually(
                    in_state(database_url, operation.id, S.COMMITTED),
                    within=30,
                    what="the refund to be published and commit once the lock is gone",
                )
