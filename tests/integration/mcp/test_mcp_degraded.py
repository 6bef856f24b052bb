"""When something underneath fails: the watcher, a status read, the schema, the extra."""

from __future__ import annotations

import sys
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr

import outbox.mcp
from outbox import OutcomeWatcher, Registry, Settings, record_decision
from outbox.cli import run_command
from outbox.errors import SchemaMissing, TransientDatabaseError
from outbox.mcp import server as mcp_server
from outbox.mcp.answers import UNRECORDED
from outbox.mcp.tools import STATUS_TOOL
from outbox.recording import record_decision_whole

from support.logs import logged
from support.mcp_cases import (
    PAYMENT,
    connected,
    key,
    only_operation,
    operation_count,
    outcome_of,
    text_of,
)

# --- when the database fails after recording ------------------------------------------


async def _unreadable(*args: Any, **kwargs: Any) -> Any:
    raise TransientDatabaseError("outcome read: transient database failure")


async def test_a_watcher_that_fails_falls_back_to_one_read(
    registry: Registry,
    settings: Settings,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(OutcomeWatcher, "wait", _unreadable)
    async with connected(registry, settings, wait=600) as client:
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert result.is_error is False
    assert outcome_of(result).status == "pending"
    assert outcome_of(result).operation_id == only_operation(database_url).id
    assert logged(caplog, "mcp.database_failed", step="wait", error="TransientDatabaseError")


async def test_a_decision_whose_status_cannot_be_read_says_it_was_recorded(
    registry: Registry, settings: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with connected(registry, settings, wait=1) as client:
        with monkeypatch.context() as patched:
            patched.setattr(OutcomeWatcher, "wait", _unreadable)
            patched.setattr(mcp_server, "get_outcome_async", _unreadable)
            unread = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
            status = await client.call_tool(
                STATUS_TOOL, {"operation_id": only_operation(database_url).display_id}
            )
        retry = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    operation = only_operation(database_url)
    assert unread.is_error is True
    assert text_of(unread) == (
        f"Recorded as {operation.display_id}, but its status could not be read. Call again "
        "with the same arguments and decision key to check; that will not repeat the effect."
    )
    assert status.is_error is True
    assert text_of(status) == (
        "The runtime's database did not answer; ask again shortly. Nothing was changed."
    )
    assert outcome_of(retry).operation_id == operation.id
    assert operation_count(database_url) == 1


async def test_a_server_on_a_database_without_the_schema_refuses_to_start(
    registry: Registry, empty_database_url: str
) -> None:
    settings = Settings(database_url=SecretStr(empty_database_url))

    with pytest.raises(SchemaMissing, match="outbox migrate"):
        async with connected(registry, settings):
            pass


def test_without_the_mcp_extra_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("server", "tools", "answers", "transports"):
        # Whichever of them this process has imported so far (the file may run alone).
        monkeypatch.delitem(sys.modules, f"outbox.mcp.{module}", raising=False)
        monkeypatch.delattr(outbox.mcp, module, raising=False)
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an absent package imports as

    code = run_command(["mcp", "--tools", "outbox.sandbox.tools"])

    assert code == 2
    assert capsys.readouterr().err == (
        "outbox mcp: configuration error: `outbox mcp` needs the MCP SDK (mcp is not "
        "installed): pip install 'effect-outbox[mcp]'\n"
    )


# --- a decision key held by another session ---------------------------------------------


async def test_the_decision_lock_timeout_setting_bounds_the_servers_wait(
    registry: Registry,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Read from the environment, as `outbox mcp` reads it.
    monkeypatch.setenv("OUTBOX_DECISION_LOCK_TIMEOUT", "0.3")
    settings = Settings(
        database_url=SecretStr(database_url), db_transaction_timeout=30.0, lease_margin=31.0
    )
    bounds_used: list[float] = []
    record = record_decision_whole

    async def recording(*args: Any, lock_timeout: float, **kwargs: Any) -> Any:
        bounds_used.append(lock_timeout)
        return await record(*args, lock_timeout=lock_timeout, **kwargs)

    monkeypatch.setattr(mcp_server, "record_decision_whole", recording)
    # Another session holds the decision key: its own recording of the same call, not
    # committed. The server's insert waits on it for the setting's bound, then answers.
    with psycopg.connect(database_url) as holder:
        record_decision(holder, registry, "pay", PAYMENT, run_id="mcp", decision_key="call_1")
        async with connected(registry, settings) as client:
            blocked = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        holder.rollback()
    async with connected(registry, settings) as client:
        retried = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert bounds_used == [0.3, 0.3]
    assert blocked.is_error is True
    assert text_of(blocked) == UNRECORDED
    assert logged(caplog, "mcp.database_failed", step="record")
    assert outcome_of(retried).operation_id == only_operation(database_url).id
    assert operation_count(database_url) == 1
