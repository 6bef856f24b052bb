"""A tool call: one decision recorded, idempotency keys per run, identities and input
refused without echoing them.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from mcp import MCPError

from outbox import Registry, Settings, ToolContract
from outbox.mcp.tools import (
    DECISION_KEY_META,
    OPERATION_META,
    RECORDED_META,
    RUN_ID_META,
    STATUS_TOOL,
)

from support.db_helpers import committed_counts
from support.history_helpers import archive_all, settled_days_ago
from support.mcp_cases import (
    PAYMENT,
    S,
    connected,
    key,
    meta,
    only_operation,
    operation_count,
    outcome_of,
    text_of,
)
from support.ops_helpers import Ops

# --- recording -----------------------------------------------------------------------


async def test_a_call_records_one_decision_and_answers_pending(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings) as client:
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    operation = only_operation(database_url)
    outcome = outcome_of(result)
    assert result.is_error is False
    assert (operation.run_id, operation.decision_key, operation.input) == ("mcp", "call_1", PAYMENT)
    assert outcome.operation_id == operation.id
    assert (outcome.status, outcome.state, outcome.final) == ("pending", S.PREPARED, False)
    assert result.meta is not None
    assert result.meta[OPERATION_META] == operation.display_id
    assert result.meta[RECORDED_META] == "new"
    assert text_of(result) == (
        f"Accepted as {operation.display_id} and not settled yet. To check, call again with "
        f"the same arguments and decision key, or call {STATUS_TOOL} with operation_id "
        f"{operation.display_id}; do not start a new call."
    )
    assert committed_counts(database_url).outbox == 1


async def test_a_call_validates_its_arguments_once(
    registry: Registry, settings: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They were validated before a connection was taken and again inside the recording.
    parsed: list[str] = []
    parse_input = ToolContract.parse_input

    def counted(contract: ToolContract[Any], raw: Any) -> Any:
        parsed.append(contract.name)
        return parse_input(contract, raw)

    monkeypatch.setattr(ToolContract, "parse_input", counted)
    async with connected(registry, settings, wait=0) as client:
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert result.is_error is False
    assert parsed == ["pay"]
    assert committed_counts(database_url).operations == 1


async def test_the_same_key_twice_is_one_operation_and_a_status_check(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings) as client:
        first = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        again = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert outcome_of(again).operation_id == outcome_of(first).operation_id
    assert again.meta is not None
    assert again.meta[RECORDED_META] == "existing"
    counts = committed_counts(database_url)
    assert (counts.operations, counts.outbox) == (1, 1)


async def test_the_same_key_after_its_operation_moved_to_history_answers_as_before(
    registry: Registry, settings: Settings, database_url: str, ops: Ops
) -> None:
    async with connected(registry, settings) as client:
        await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        operation = only_operation(database_url)
        ops.move(ops.move(operation, S.IN_FLIGHT), S.COMMITTED)
        settled_days_ago(database_url, operation.id, 3)
        hot = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        archive_all(ops)
        archived = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert operation_count(database_url) == 0  # answered from its key row in history
    assert outcome_of(hot).status == "committed"
    assert outcome_of(archived) == outcome_of(hot)
    assert text_of(archived) == text_of(hot)
    assert archived.is_error is False
    assert archived.meta is not None
    assert archived.meta[RECORDED_META] == "existing"


async def test_keys_are_per_run(registry: Registry, settings: Settings, database_url: str) -> None:
    async with connected(registry, settings, run_id="conversation_a") as client:
        default_run = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        other_run = await client.call_tool("pay", PAYMENT, meta=key("call_1", run_id="b"))

    assert outcome_of(default_run).run_id == "conversation_a"
    assert outcome_of(other_run).run_id == "b"
    assert outcome_of(default_run).operation_id != outcome_of(other_run).operation_id
    assert operation_count(database_url) == 2


async def test_the_same_key_for_other_arguments_is_refused(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings) as client:
        await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        conflict = await client.call_tool(
            "pay", {**PAYMENT, "amount_cents": 9999}, meta=key("call_1")
        )

    assert conflict.is_error is True
    assert "this decision key was used for a different request" in text_of(conflict)
    assert "nothing was recorded" in text_of(conflict)
    assert conflict.structured_content is None
    assert only_operation(database_url).input == PAYMENT


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [("pay", PAYMENT), ("notify", {"to": "someone", "body": "hello"})],
)
async def test_a_write_that_must_not_repeat_is_refused_without_a_key(
    registry: Registry, settings: Settings, database_url: str, tool: str, arguments: dict[str, Any]
) -> None:
    async with connected(registry, settings) as client:
        result = await client.call_tool(tool, arguments)

    assert result.is_error is True
    text = text_of(result)
    assert text.startswith(f"Not done: {tool} needs a decision key")
    assert f'_meta under "{DECISION_KEY_META}"' in text
    assert "send the same value again when you retry" in text
    assert operation_count(database_url) == 0


@pytest.mark.parametrize(
    ("tool", "arguments"), [("lookup", {"ref": "ref_1"}), ("set_flag", {"name": "x", "on": True})]
)
async def test_a_read_or_an_idempotent_write_may_go_without_a_key(
    registry: Registry, settings: Settings, database_url: str, tool: str, arguments: dict[str, Any]
) -> None:
    async with connected(registry, settings) as client:
        first = await client.call_tool(tool, arguments)
        second = await client.call_tool(tool, arguments)

    assert (first.is_error, second.is_error) == (False, False)
    keys = {outcome_of(first).decision_key, outcome_of(second).decision_key}
    assert len(keys) == 2  # a fresh identity each: a repeat is harmless for these classes
    assert all(UUID(k).version == 4 for k in keys if k is not None)
    assert operation_count(database_url) == 2
    # Only the status tool finds a keyless decision again.
    assert "same arguments and decision key" not in text_of(first)
    assert f"call {STATUS_TOOL} with operation_id" in text_of(first)


async def test_require_key_refuses_even_a_keyless_read(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings, require_key=True) as client:
        result = await client.call_tool("lookup", {"ref": "ref_1"})

    assert result.is_error is True
    assert "this server requires one for every call" in text_of(result)
    assert operation_count(database_url) == 0


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ({DECISION_KEY_META: 42}, f'"{DECISION_KEY_META}" must be a string'),
        ({DECISION_KEY_META: ""}, "decision_key must be a string of 1 to 200 characters"),
        ({DECISION_KEY_META: "k" * 201}, "decision_key must be a string of 1 to 200 characters"),
        ({DECISION_KEY_META: "k", RUN_ID_META: ["r"]}, f'"{RUN_ID_META}" must be a string'),
        ({DECISION_KEY_META: "k", RUN_ID_META: ""}, "run_id must be a string of 1 to 200"),
    ],
)
async def test_malformed_identities_are_refused(
    registry: Registry,
    settings: Settings,
    database_url: str,
    sent: dict[str, Any],
    expected: str,
) -> None:
    async with connected(registry, settings) as client:
        result = await client.call_tool("pay", PAYMENT, meta=meta(sent))

    assert result.is_error is True
    assert expected in text_of(result)
    assert operation_count(database_url) == 0


@pytest.mark.parametrize(
    ("arguments", "fields", "values"),
    [
        (
            {"account": "acc_SECRET-CANARY", "amount_cents": -31337},
            ["account", "amount_cents"],
            ["SECRET-CANARY", "-31337"],
        ),
        ({"account": "acc_1", "amount_cents": "4242"}, ["amount_cents"], ["4242"]),
        ({"amount_cents": 100}, ["account"], []),
    ],
)
async def test_bad_input_names_the_fields_and_never_the_values(
    registry: Registry,
    settings: Settings,
    database_url: str,
    arguments: dict[str, Any],
    fields: list[str],
    values: list[str],
) -> None:
    async with connected(registry, settings) as client:
        result = await client.call_tool("pay", arguments, meta=key("call_1"))
        corrected = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    text = text_of(result)
    assert result.is_error is True
    assert text.startswith("Not done: input for tool 'pay' v1 is invalid")
    assert "Nothing was recorded; correct the arguments and call again." in text
    for field in fields:
        assert f"{field}:" in text
    for value in values:
        assert value not in text
    # Nothing was recorded, so the same key is free for the corrected request.
    assert corrected.is_error is False
    assert only_operation(database_url).input == PAYMENT


async def test_a_field_the_tool_does_not_take_is_refused_and_nothing_is_recorded(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    """Tried with a real MCP client before: the extra field was dropped, the rest was
    recorded, and the model heard the call succeed."""
    async with connected(registry, settings) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        result = await client.call_tool(
            "pay", {**PAYMENT, "refund_to": "acc_CANARY_9"}, meta=key("call_1")
        )

    assert listed["pay"].input_schema["additionalProperties"] is False
    assert listed["lookup"].input_schema["additionalProperties"] is False
    assert result.is_error is True
    assert text_of(result).startswith("Not done: input for tool 'pay' v1 is invalid: ")
    assert "refund_to: not a field of this tool" in text_of(result)
    assert "CANARY" not in text_of(result)
    assert operation_count(database_url) == 0


async def test_an_unknown_tool_is_a_protocol_error_that_does_not_echo_the_name(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with connected(registry, settings) as client:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("delete_everything_CANARY", {}, meta=key("call_1"))

    assert raised.value.code == -32602
    assert "CANARY" not in str(raised.value)
    assert operation_count(database_url) == 0
