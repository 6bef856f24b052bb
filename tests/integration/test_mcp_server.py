"""`outbox mcp` through the real MCP client: in memory, and over streamable HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from datetime import timedelta
from typing import Any, cast
from uuid import UUID

import httpx2
import psycopg
import pytest
import uvicorn
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import CallToolResult, RequestParamsMeta, TextContent
from pydantic import BaseModel, ConfigDict, Field, SecretStr

import outbox.mcp
from outbox import (
    ApprovalPolicy,
    OnUnknown,
    Operation,
    OperationState,
    Outcome,
    OutcomeWatcher,
    Registry,
    Settings,
    SideEffect,
    ToolContract,
)
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.credentials import Credential, FailureThrottle
from outbox.errors import ConfigurationError, SchemaMissing, TransientDatabaseError
from outbox.mcp import server as mcp_server
from outbox.mcp.config import BEARER_PRINCIPAL, PRINCIPAL_SCOPE_KEY, ServerOptions
from outbox.mcp.server import ToolHost, build_server
from outbox.mcp.tools import (
    CONTRACT_META,
    DECISION_KEY_META,
    OPERATION_META,
    RECORDED_META,
    RUN_ID_META,
    STATUS_TOOL,
)
from outbox.mcp.transports import BearerGuard, http_app
from outbox.outcomes import EffectResult, ExecutionContext

from support.db_helpers import committed_counts, execute_admin
from support.logs import logged, records_of, rendered
from support.ops_helpers import Ops
from support.ports import closed_port
from support.waiting import eventually

S = OperationState


# --- the tools ---------------------------------------------------------------------


class LookupInput(BaseModel):
    model_config = ConfigDict(strict=True)

    ref: str = Field(pattern=r"^ref_[a-z0-9]{1,20}$")


class LookupInputV2(LookupInput):
    verbose: bool = False


class FlagInput(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(max_length=40)
    on: bool


class PaymentInput(BaseModel):
    model_config = ConfigDict(strict=True)

    account: str = Field(pattern=r"^acc_[a-z0-9]{1,20}$")
    amount_cents: int = Field(gt=0)


class MessageInput(BaseModel):
    model_config = ConfigDict(strict=True)

    to: str = Field(max_length=100)
    body: str = Field(max_length=1000)


async def never_runs(tool_input: BaseModel, ctx: ExecutionContext) -> EffectResult:
    raise AssertionError("no consumer runs in these tests")


def build_registry() -> Registry:
    registry = Registry()
    for version, model in ((1, LookupInput), (2, LookupInputV2)):
        registry.register(
            ToolContract(
                name="lookup",
                version=version,
                input_model=model,
                side_effect=SideEffect.READ_ONLY,
                execute=never_runs,
                description="Look a reference up; changes nothing.",
            )
        )
    registry.register(
        ToolContract(
            name="set_flag",
            version=1,
            input_model=FlagInput,
            side_effect=SideEffect.IDEMPOTENT_WRITE,
            execute=never_runs,
        )
    )
    registry.register(
        ToolContract(
            name="pay",
            version=1,
            input_model=PaymentInput,
            side_effect=SideEffect.DEDUPLICATED_WRITE,
            execute=never_runs,
            dedupe_window=timedelta(hours=24),
            approval=ApprovalPolicy.above("amount_cents", 50_000),
            additive_only=True,
            description="Pay amount_cents into an account, once.",
        )
    )
    registry.register(
        ToolContract(
            name="notify",
            version=1,
            input_model=MessageInput,
            side_effect=SideEffect.NON_REPEATABLE_WRITE,
            execute=never_runs,
            on_unknown=OnUnknown.ESCALATE,
        )
    )
    return registry


PAYMENT = {"account": "acc_1", "amount_cents": 1250}


# --- fixtures and helpers ------------------------------------------------------------


@pytest.fixture
def registry() -> Registry:
    return build_registry()


@pytest.fixture
def settings(database_url: str) -> Settings:
    # Generous transaction bounds: the machine running the tests may be busy (and the
    # lease margin, which no call here uses, longer still, as settings require).
    return Settings(
        database_url=SecretStr(database_url), db_transaction_timeout=30.0, lease_margin=31.0
    )


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def server(registry: Registry, settings: Settings, **options: Any) -> Server[ToolHost]:
    options.setdefault("wait", 0.5)
    return build_server(registry, settings, ServerOptions(**options))


@contextlib.asynccontextmanager
async def connected(
    registry: Registry, settings: Settings, *, mode: str = "auto", **options: Any
) -> AsyncIterator[Client]:
    async with Client(
        server(registry, settings, **options), raise_exceptions=True, mode=mode
    ) as client:
        yield client


def meta(values: dict[str, Any]) -> RequestParamsMeta:
    # An open map on the wire; the SDK types it as a TypedDict with the reserved keys.
    return cast("RequestParamsMeta", values)


def key(value: str, run_id: str | None = None) -> RequestParamsMeta:
    values: dict[str, Any] = {DECISION_KEY_META: value}
    if run_id is not None:
        values[RUN_ID_META] = run_id
    return meta(values)


def text_of(result: CallToolResult) -> str:
    assert len(result.content) == 1
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


def outcome_of(result: CallToolResult) -> Outcome:
    return Outcome.model_validate(result.structured_content)


def stored(database_url: str, operation_id: UUID) -> Operation:
    with psycopg.connect(database_url) as connection:
        return outbox_store.Store(connection).run(outbox_store.get_operation(operation_id))


def only_operation(database_url: str) -> Operation:
    rows = execute_admin(database_url, "SELECT id FROM operations")
    assert len(rows) == 1
    operation_id = rows[0][0]
    assert isinstance(operation_id, UUID)
    return stored(database_url, operation_id)


def operation_count(database_url: str) -> int:
    return committed_counts(database_url).operations


def now(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return predicate()

    return check


def off_the_loop(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """A condition that blocks (a database query) runs in a thread: the server under test
    shares this event loop and must keep serving meanwhile."""
    return lambda: asyncio.to_thread(predicate)


# --- tools/list ----------------------------------------------------------------------


async def test_each_contract_is_one_tool_at_its_latest_version(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}

    assert list(listed) == ["lookup", "notify", "pay", "set_flag", STATUS_TOOL]
    for name in ("lookup", "notify", "pay", "set_flag"):
        contract = registry.get(name)
        tool = listed[name]
        assert tool.input_schema == {
            **contract.input_model.model_json_schema(),
            "additionalProperties": False,
        }
        assert tool.output_schema == Outcome.model_json_schema(mode="serialization")
        assert tool.annotations is not None
        wire = tool.annotations.model_dump(by_alias=True, exclude_none=True)
        assert wire == contract.mcp_annotations()
        assert tool.meta is not None
        card = tool.meta[CONTRACT_META]
        assert (card["name"], card["version"]) == (name, contract.version)
        assert card["side_effect"] == contract.side_effect.value
        assert card["card"] == contract.card()
    assert listed["lookup"].meta is not None
    assert listed["lookup"].meta[CONTRACT_META]["version"] == 2
    assert "verbose" in listed["lookup"].input_schema["properties"]
    assert listed["lookup"].description == "Look a reference up; changes nothing."


async def test_annotations_and_contract_say_what_the_runtime_enforces(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}

    def hints(name: str) -> dict[str, Any]:
        annotations = listed[name].annotations
        assert annotations is not None
        return annotations.model_dump(by_alias=True, exclude_none=True)

    def contract(name: str) -> dict[str, Any]:
        meta = listed[name].meta
        assert meta is not None
        found: dict[str, Any] = meta[CONTRACT_META]
        return found

    assert hints("lookup") == {"readOnlyHint": True}
    assert hints("set_flag") == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": True,
    }
    assert hints("pay") == {
        "readOnlyHint": False,
        "destructiveHint": False,
        "idempotentHint": False,
    }
    assert hints("notify")["destructiveHint"] is True
    assert hints(STATUS_TOOL) == {"readOnlyHint": True, "openWorldHint": False}
    assert [contract(n)["decision_key"] for n in ("lookup", "set_flag", "pay", "notify")] == [
        "optional",
        "optional",
        "required",
        "required",
    ]
    assert contract("pay")["approval"] == "approval required when amount_cents > 50000"
    assert contract("pay")["dedupe_window_seconds"] == 24 * 3600
    assert contract("notify")["on_unknown"] == "escalate"
    assert contract("lookup")["approval"] is None


async def test_require_key_marks_every_tool_as_needing_one(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings, require_key=True) as client:
        tools = (await client.list_tools()).tools
    assert {tool.meta[CONTRACT_META]["decision_key"] for tool in tools if tool.meta} == {"required"}


def test_a_tool_named_like_the_status_tool_is_refused(settings: Settings) -> None:
    registry = Registry()
    registry.register(
        ToolContract(
            name=STATUS_TOOL,
            version=1,
            input_model=LookupInput,
            side_effect=SideEffect.READ_ONLY,
            execute=never_runs,
        )
    )
    with pytest.raises(ConfigurationError, match="rename that tool"):
        build_server(registry, settings)


def test_a_negative_wait_is_refused(registry: Registry, settings: Settings) -> None:
    with pytest.raises(ConfigurationError, match="--wait must not be negative"):
        build_server(registry, settings, ServerOptions(wait=-1))


@pytest.mark.parametrize("run_id", ["", "r" * 201, "r\x00"])
def test_an_unusable_default_run_id_is_refused(
    registry: Registry, settings: Settings, run_id: str
) -> None:
    with pytest.raises(ConfigurationError, match="--run-id must be 1 to 200 characters"):
        build_server(registry, settings, ServerOptions(run_id=run_id))


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


def escalate(ops: Ops, operation: Operation) -> None:
    unknown = ops.move(ops.move(operation, S.IN_FLIGHT), S.OUTCOME_UNKNOWN)
    ops.move(unknown, S.ESCALATED)


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
    # handler itself and could not time out while the recording is shielded.
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE operations IN EXCLUSIVE MODE")
        async with connected(registry, settings, wait=1, mode="legacy") as client:
            call = asyncio.ensure_future(
                client.call_tool("pay", PAYMENT, read_timeout_seconds=8, meta=key("call_t"))
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


# --- HTTP ----------------------------------------------------------------------------


TOKEN = "tok-CANARY-7f3a9d-4e1b2c8a0f5d6e3b9c"
SUPPORT = Credential("support-bot", "tok-CANARY-support-5f2a9c81d4e6b7a30c1f")
BILLING = Credential("billing-bot", "tok-CANARY-billing-0b8d3e6f2a9c41d7e5b2")


def bearer(token: str) -> tuple[Credential, ...]:
    """The single-token form: one token, the principal ``bearer``."""
    return (Credential(BEARER_PRINCIPAL, token),)


@contextlib.asynccontextmanager
async def serving_http(
    registry: Registry,
    settings: Settings,
    *,
    credentials: tuple[Credential, ...],
    throttle: FailureThrottle | None = None,
) -> AsyncIterator[str]:
    port = closed_port()
    app = http_app(
        server(registry, settings),
        host="127.0.0.1",
        credentials=credentials,
        throttle=throttle or FailureThrottle(),
    )
    http_server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.ensure_future(http_server.serve())
    try:
        await eventually(
            now(lambda: http_server.started or task.done()),
            within=30,
            what="the HTTP server to start",
        )
        assert http_server.started
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        http_server.should_exit = True
        await asyncio.wait_for(task, timeout=30)


@contextlib.asynccontextmanager
async def http_client(url: str, token: str | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def test_http_with_a_token_binds_runs_to_the_principal(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with (
        serving_http(registry, settings, credentials=bearer(TOKEN)) as url,
        http_client(url, TOKEN) as client,
    ):
        default_run = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        own_run = await client.call_tool("pay", PAYMENT, meta=key("call_1", run_id="r7"))
        status = await client.call_tool(
            STATUS_TOOL,
            {"operation_id": outcome_of(own_run).display_id},
            meta=meta({RUN_ID_META: "r7"}),
        )

    assert outcome_of(default_run).run_id == "bearer:mcp"
    assert outcome_of(own_run).run_id == "bearer:r7"
    assert outcome_of(status).operation_id == outcome_of(own_run).operation_id
    assert operation_count(database_url) == 2


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"],
)
async def test_http_with_a_token_refuses_requests_without_it(
    registry: Registry,
    settings: Settings,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
    authorization: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with (
        serving_http(registry, settings, credentials=bearer(TOKEN)) as url,
        httpx2.AsyncClient() as http,
    ):
        response = await http.post(url, json=body, headers=headers)

    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert TOKEN not in response.text
    assert TOKEN not in rendered(caplog)
    assert operation_count(database_url) == 0


@dataclasses.dataclass
class GuardProbe:
    """An ASGI app behind the guard that keeps what reached it, and what the guard sent."""

    reached: list[MutableMapping[str, Any]] = dataclasses.field(default_factory=list)
    sent: list[MutableMapping[str, Any]] = dataclasses.field(default_factory=list)

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        self.reached.append(scope)

    async def receive(self) -> MutableMapping[str, Any]:
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)


async def test_the_guard_passes_only_the_lifespan_and_the_token_holder() -> None:
    probe = GuardProbe()
    reached, sent, receive, send = probe.reached, probe.sent, probe.receive, probe.send
    guard = BearerGuard(probe.app, bearer(TOKEN), FailureThrottle())
    good = (b"authorization", f"Bearer {TOKEN}".encode())
    await guard({"type": "websocket", "headers": [good]}, receive, send)
    await guard({"type": "websocket", "headers": []}, receive, send)
    await guard({"type": "http", "headers": [good, good]}, receive, send)
    await guard({"type": "lifespan"}, receive, send)
    await guard(
        {"type": "http", "headers": [(b"Authorization", f"bearer {TOKEN}".encode())]}, receive, send
    )

    assert [scope["type"] for scope in reached] == ["websocket", "lifespan", "http"]
    assert reached[0][PRINCIPAL_SCOPE_KEY] == reached[2][PRINCIPAL_SCOPE_KEY] == "bearer"
    assert sent[0] == {"type": "websocket.close", "code": 1008}
    assert sent[1]["status"] == 401  # two Authorization headers: ambiguous, refused


async def test_each_token_holder_records_and_reads_as_its_own_principal(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with serving_http(registry, settings, credentials=(SUPPORT, BILLING)) as url:
        async with http_client(url, SUPPORT.token) as support:
            mine = await support.call_tool("pay", PAYMENT, meta=key("call_1"))
        async with http_client(url, BILLING.token) as billing:
            # The same key, another caller: another decision, never the first one's.
            theirs = await billing.call_tool("pay", PAYMENT, meta=key("call_1"))
            peek = await billing.call_tool(
                STATUS_TOOL, {"operation_id": outcome_of(mine).display_id}
            )

    assert outcome_of(mine).run_id == "support-bot:mcp"
    assert outcome_of(theirs).run_id == "billing-bot:mcp"
    assert outcome_of(mine).operation_id != outcome_of(theirs).operation_id
    assert peek.is_error is True
    assert text_of(peek).startswith("No operation op_")
    assert operation_count(database_url) == 2


async def test_failed_bearer_attempts_are_throttled_per_address_and_logged_by_address(
    registry: Registry,
    settings: Settings,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    throttle = FailureThrottle(limit=3)
    async with (
        serving_http(registry, settings, credentials=(SUPPORT,), throttle=throttle) as url,
        httpx2.AsyncClient() as http,
    ):
        guesses = [
            await http.post(url, json=body, headers={**headers, "Authorization": f"Bearer {g}"})
            for g in ("guess-CANARY-1", "guess-CANARY-2", "guess-CANARY-3")
        ]
        # Past the limit even the right token is refused unread: a guess learns nothing.
        right = await http.post(
            url, json=body, headers={**headers, "Authorization": f"Bearer {SUPPORT.token}"}
        )

    assert [guess.status_code for guess in guesses] == [401, 401, 401]
    assert right.status_code == 429
    assert 0 < int(right.headers["retry-after"]) <= 600
    assert "CANARY" not in right.text
    refused = records_of(caplog, "mcp.unauthorized")
    assert [(getattr(r, "address", None), getattr(r, "failures", None)) for r in refused] == [
        ("127.0.0.1", 1),
        ("127.0.0.1", 2),
        ("127.0.0.1", 3),
    ]
    assert logged(caplog, "mcp.throttled", address="127.0.0.1")
    assert "CANARY" not in rendered(caplog)
    assert operation_count(database_url) == 0


async def test_the_throttle_holds_back_only_the_address_that_failed() -> None:
    probe = GuardProbe()
    reached, sent, receive, send = probe.reached, probe.sent, probe.receive, probe.send

    def request(address: str, token: str) -> dict[str, Any]:
        headers = [(b"authorization", f"Bearer {token}".encode())]
        return {"type": "http", "headers": headers, "client": (address, 50000)}

    guard = BearerGuard(probe.app, (SUPPORT, BILLING), FailureThrottle(limit=2))
    for _ in range(2):
        await guard(request("10.0.0.9", "wrong"), receive, send)
    await guard(request("10.0.0.9", SUPPORT.token), receive, send)
    await guard(request("10.0.0.10", BILLING.token), receive, send)

    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [401, 401, 429]
    assert [scope[PRINCIPAL_SCOPE_KEY] for scope in reached] == ["billing-bot"]


async def test_http_on_loopback_without_a_token_serves_the_loopback_principal(
    registry: Registry, settings: Settings
) -> None:
    async with (
        serving_http(registry, settings, credentials=()) as url,
        http_client(url, None) as client,
    ):
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert outcome_of(result).run_id == "loopback:mcp"


async def test_an_http_app_without_the_guard_refuses_calls(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    port = closed_port()
    # What someone would get by serving build_server's app directly: no principal.
    app = server(registry, settings).streamable_http_app(host="127.0.0.1")
    http_server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.ensure_future(http_server.serve())
    try:
        await eventually(
            now(lambda: http_server.started),
            within=30,
            what="the HTTP server to start",
        )
        async with http_client(f"http://127.0.0.1:{port}/mcp", None) as client:
            result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
    finally:
        http_server.should_exit = True
        await asyncio.wait_for(task, timeout=30)

    assert result.is_error is True
    assert text_of(result) == "Not done: this HTTP endpoint has no authenticated caller."
    assert operation_count(database_url) == 0


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "example.com", "::"])
def test_http_beyond_loopback_without_a_token_is_refused_at_startup(
    registry: Registry, settings: Settings, capsys: pytest.CaptureFixture[str], host: str
) -> None:
    with pytest.raises(ConfigurationError, match="not a loopback address"):
        http_app(server(registry, settings), host=host, credentials=())

    code = run_command(
        ["mcp", "--tools", "outbox.sandbox.tools", "--transport", "http", "--host", host]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith(f"outbox mcp: configuration error: --host {host} is not a loopback")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_token(registry: Registry, settings: Settings, host: str) -> None:
    assert http_app(server(registry, settings), host=host, credentials=()) is not None


@pytest.mark.parametrize(
    ("variables", "flags", "says"),
    [
        (
            {"OUTBOX_TEST_MCP_TOKEN": "CANARY-short-0123456789abcdef"},
            ["--bearer-token-env", "OUTBOX_TEST_MCP_TOKEN"],
            "--bearer-token-env OUTBOX_TEST_MCP_TOKEN: the token must be at least 32 characters",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"{SUPPORT.name}:{SUPPORT.token},billing-bot:CANARY-short-01"},
            [],
            "OUTBOX_MCP_TOKENS entry 2: the token must be at least 32 characters",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"ops team:{SUPPORT.token}"},
            [],
            "OUTBOX_MCP_TOKENS entry 1: a caller's name is 1-64 letters, digits",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"loopback:{SUPPORT.token}"},
            [],
            "OUTBOX_MCP_TOKENS entry 1: 'loopback' is the principal of calls without a token",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"a:{SUPPORT.token}", "OUTBOX_TEST_MCP_TOKEN": TOKEN},
            ["--bearer-token-env", "OUTBOX_TEST_MCP_TOKEN"],
            "set OUTBOX_MCP_TOKENS or --bearer-token-env, not both",
        ),
    ],
    ids=["short-single-token", "short-token-in-the-list", "bad-name", "reserved-name", "both"],
)
def test_bad_bearer_tokens_are_refused_at_start_without_echoing_them(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    flags: list[str],
    says: str,
) -> None:
    # Nothing answers there: a command that did not refuse would fail to connect instead.
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://nobody@127.0.0.1:{closed_port()}/x")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)

    code = run_command(
        ["mcp", "--tools", "outbox.sandbox.tools", "--transport", "http", "--port", "0", *flags]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith("outbox mcp: configuration error: ")
    assert says in err
    assert "CANARY" not in err


def test_an_unset_token_variable_is_refused_without_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_TEST_MCP_TOKEN", "  ")
    code = run_command(
        [
            "mcp",
            "--tools",
            "outbox.sandbox.tools",
            "--transport",
            "http",
            "--bearer-token-env",
            "OUTBOX_TEST_MCP_TOKEN",
        ]
    )

    assert code == 2
    assert "'OUTBOX_TEST_MCP_TOKEN', which is unset or empty" in capsys.readouterr().err


def test_http_flags_on_stdio_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_command(["mcp", "--tools", "outbox.sandbox.tools", "--port", "9000"])

    assert code == 2
    assert "apply to --transport http" in capsys.readouterr().err


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
        monkeypatch.delitem(sys.modules, f"outbox.mcp.{module}")
        monkeypatch.delattr(outbox.mcp, module)
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an absent package imports as

    code = run_command(["mcp", "--tools", "outbox.sandbox.tools"])

    assert code == 2
    assert capsys.readouterr().err == (
        "outbox mcp: configuration error: `outbox mcp` needs the MCP SDK (mcp is not "
        "installed): pip install 'effect-outbox[mcp]'\n"
    )
