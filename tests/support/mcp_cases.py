"""What the MCP server tests share: the tools they serve, a connected client, reading its
answers, the stored operations behind them, HTTP with bearer tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any, cast
from uuid import UUID

import psycopg
from mcp import Client
from mcp.server import Server
from mcp.types import CallToolResult, RequestParamsMeta, TextContent
from pydantic import BaseModel, ConfigDict, Field

from outbox import (
    ApprovalPolicy,
    OnUnknown,
    Operation,
    OperationState,
    Outcome,
    Registry,
    Settings,
    SideEffect,
    ToolContract,
)
from outbox import store as outbox_store
from outbox.mcp.config import ServerOptions
from outbox.mcp.server import ToolHost, build_server
from outbox.mcp.tools import DECISION_KEY_META, RUN_ID_META
from outbox.outcomes import EffectResult, ExecutionContext

from support.db_helpers import committed_counts, execute_admin
from support.ops_helpers import Ops

S = OperationState


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


def escalate(ops: Ops, operation: Operation) -> None:
    unknown = ops.move(ops.move(operation, S.IN_FLIGHT), S.OUTCOME_UNKNOWN)
    ops.move(unknown, S.ESCALATED)
