"""outbox.integrations.pydantic_ai: a scripted pydantic-ai agent (FunctionModel, no
network, no API key) whose refunds the runtime performs. The dispatcher and consumer run
as subprocesses against this test's database and broker names, the payment sandbox in
process."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest
from pydantic import BaseModel, ConfigDict
from pydantic_ai import (
    Agent,
    CallDeferred,
    DeferredToolRequests,
    RunContext,
    ToolDefinition,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import ToolsetTool
from pydantic_ai.usage import RunUsage
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import (
    DecisionConflict,
    EffectResult,
    ExecutionContext,
    OperationState,
    OutcomeStatus,
    OutcomeWatcher,
    Registry,
    Settings,
    SideEffect,
    ToolContract,
    agent_completed,
    get_outcome_async,
    grant_approval_async,
)
from outbox.integrations.pydantic_ai import OperationsUnsettled, OutboxToolset, resume_results
from outbox.models import parse_operation_id
from outbox.sandbox.provider import Faults

from support.db_helpers import committed_counts, execute_admin
from support.logs import lifecycle_lines, rendered
from support.system import System, running_system
from support.waiting import eventually

REFUND = {"payment_id": "pay_agent_1", "amount_cents": 2500, "reason": "parcel arrived damaged"}
# Above the sandbox contract's approval threshold (50 000 cents).
LARGE_REFUND = {"payment_id": "pay_agent_2", "amount_cents": 60_000}
# The daemons settle a lost response in about a second; this is for a busy 2-core machine,
# and stays under the tests' own timeout so that a failure shows the daemons' output.
SETTLE_SECONDS = 45.0
SYSTEM_TEST_TIMEOUT = 150
# Long enough for a fresh watcher's first read on a busy machine; nothing settles meanwhile.
NOT_SETTLING_SECONDS = 3.0


class ScriptedRefundAgent:
    """Stands in for an LLM: asks for ``refund`` once, then answers from the tool's result.

    It asks again after a retry prompt (as a model fixing its input would) and never
    after a failure; ``calls`` counts the refunds it asked for.
    """

    def __init__(self, refund: dict[str, Any]) -> None:
        self.refund = refund
        self.calls = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answer = latest_tool_return(messages)
        if answer is None or answer.outcome == "retried":
            self.calls += 1
            return ModelResponse(parts=[ToolCallPart("send_refund", self.refund)])
        if answer.outcome == "success":
            reference = structured(answer)["provider_reference"]
            return ModelResponse(parts=[TextPart(f"Refund confirmed: {reference}")])
        return ModelResponse(parts=[TextPart(f"The refund was not made: {text(answer)}")])


def latest_tool_return(messages: list[ModelMessage]) -> ToolReturnPart | None:
    last = messages[-1]
    if not isinstance(last, ModelRequest):
        return None
    returns = [part for part in last.parts if isinstance(part, ToolReturnPart)]
    return returns[-1] if returns else None


def structured(part: ToolReturnPart) -> dict[str, Any]:
    assert isinstance(part.content, dict), part.content
    return part.content


def text(part: ToolReturnPart) -> str:
    assert isinstance(part.content, str), part.content
    return part.content


def refund_agent(
    script: ScriptedRefundAgent, toolset: OutboxToolset
) -> Agent[None, str | DeferredToolRequests]:
    return Agent(
        FunctionModel(script),
        toolsets=[toolset],
        output_type=[str, DeferredToolRequests],
    )


def tool_returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [
        part
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]


def start_daemons(system: System) -> None:
    system.start("dispatcher")
    system.start("consumer")


def daemon_output(system: System) -> str:
    return "\n".join(f"--- {d.kind}\n{''.join(d.lines)[-4000:]}" for d in system.daemons)


@pytest.mark.timeout(SYSTEM_TEST_TIMEOUT)
async def test_a_lost_response_ends_in_one_refund_and_a_confirmed_answer(
    settings: Settings, async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    with running_system(settings, faults=Faults(drop_response_every=1)) as system:
        start_daemons(system)
        script = ScriptedRefundAgent(REFUND)
        toolset = OutboxToolset(system.registry, async_engine, wait=SETTLE_SECONDS)

        result = await refund_agent(script, toolset).run("Refund my damaged parcel, please.")
        completed = agent_completed(result.conversation_id, "refund_confirmed")

        assert isinstance(result.output, str), daemon_output(system)
        (tool_return,) = tool_returns(result.all_messages())
        content = structured(tool_return)
        operation_id = parse_operation_id(content["operation_id"])
        assert result.output == f"Refund confirmed: {content['provider_reference']}"
        assert content["status"] == "committed"
        assert system.refunds_for(operation_id) == 1
        assert len(system.provider.ledger()["refunds"]) == 1
        assert system.events(operation_id) == [
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
            "operation.reconciled",
        ]
        async with async_engine.connect() as connection:
            outcome = await get_outcome_async(connection, operation_id)
        # The decision's identity: the conversation, and the model's tool call.
        assert outcome.run_id == result.conversation_id
        assert outcome.decision_key == tool_return.tool_call_id
        assert outcome.provider_reference == content["provider_reference"]
    lines = lifecycle_lines(caplog)
    assert lines[0].startswith(f"operation.prepared id={outcome.display_id} tool=send_refund")
    assert lines[-1] == completed
    assert completed == f"agent.completed id={result.conversation_id} outcome=refund_confirmed"


@pytest.mark.timeout(SYSTEM_TEST_TIMEOUT)
async def test_a_rejection_reaches_the_model_as_a_failure_it_does_not_retry(
    settings: Settings, async_engine: AsyncEngine
) -> None:
    # The sandbox refuses a refund larger than what the payment captured.
    with running_system(settings, payment_amount_cents=10_000) as system:
        start_daemons(system)
        script = ScriptedRefundAgent({"payment_id": "pay_agent_3", "amount_cents": 20_000})
        toolset = OutboxToolset(system.registry, async_engine, wait=SETTLE_SECONDS)

        result = await refund_agent(script, toolset).run("Refund 200 EUR.")

        (tool_return,) = tool_returns(result.all_messages())
        # A failure, not a retry prompt ("retried"): the model is not asked to try again.
        assert tool_return.outcome == "failed", daemon_output(system)
        message = text(tool_return)
        assert "send_refund was rejected (amount_exceeds_payment)" in message
        assert "will not be" in message
        assert "20000" not in message
        assert "pay_agent_3" not in message
        assert script.calls == 1
        assert result.output == f"The refund was not made: {message}"
        assert committed_counts(system.database_url).operations == 1
        assert system.provider.ledger()["refunds"] == []


@pytest.mark.timeout(SYSTEM_TEST_TIMEOUT)
async def test_an_approval_defers_the_call_and_a_follow_up_run_confirms_it(
    settings: Settings, async_engine: AsyncEngine
) -> None:
    with running_system(settings) as system:
        start_daemons(system)
        script = ScriptedRefundAgent(LARGE_REFUND)
        toolset = OutboxToolset(system.registry, async_engine, wait=SETTLE_SECONDS)
        agent = refund_agent(script, toolset)

        paused = await agent.run("Refund the full 600 EUR.")

        # A person has to approve: the call does not sit waiting for the whole `wait`.
        requests = paused.output
        assert isinstance(requests, DeferredToolRequests)
        (call,) = requests.calls
        metadata = requests.metadata[call.tool_call_id]
        assert metadata["status"] == "awaiting_approval"
        assert metadata["tool"] == "send_refund"
        operation_id = parse_operation_id(metadata["operation_id"])
        with pytest.raises(OperationsUnsettled) as unsettled:
            await resume_results(requests, async_engine, timeout=NOT_SETTLING_SECONDS)
        assert unsettled.value.outcomes[call.tool_call_id].status is (
            OutcomeStatus.AWAITING_APPROVAL
        )
        assert system.provider.ledger()["refunds"] == []

        async with async_engine.begin() as connection:
            await grant_approval_async(
                connection, operation_id, approved_by="operator@example.com", ttl=timedelta(hours=1)
            )
        results = await resume_results(requests, async_engine, timeout=SETTLE_SECONDS)
        resumed = await agent.run(
            message_history=paused.all_messages(), deferred_tool_results=results
        )

        assert isinstance(resumed.output, str), daemon_output(system)
        assert resumed.output.startswith("Refund confirmed: re_")
        assert resumed.conversation_id == paused.conversation_id
        assert script.calls == 1
        assert system.refunds_for(operation_id) == 1
        assert system.operation(operation_id).state is OperationState.COMMITTED


@pytest.mark.timeout(SYSTEM_TEST_TIMEOUT)
async def test_a_wait_that_times_out_defers_and_resuming_answers_once_settled(
    settings: Settings, async_engine: AsyncEngine
) -> None:
    with running_system(settings) as system:
        # No daemons yet: the decision stays pending past the toolset's wait.
        script = ScriptedRefundAgent(REFUND)
        toolset = OutboxToolset(system.registry, async_engine, wait=1.0)
        agent = refund_agent(script, toolset)

        paused = await agent.run("Refund my damaged parcel, please.")

        requests = paused.output
        assert isinstance(requests, DeferredToolRequests)
        (call,) = requests.calls
        assert requests.metadata[call.tool_call_id]["status"] == "pending"
        reported = await resume_results(
            requests, async_engine, timeout=NOT_SETTLING_SECONDS, unsettled="report"
        )
        still = reported.calls[call.tool_call_id]
        assert isinstance(still, dict)
        assert still["status"] == "pending"
        assert "do not call the tool again" in still["note"]

        start_daemons(system)
        async with OutcomeWatcher(async_engine) as watcher:  # one the app already runs
            results = await resume_results(requests, watcher, timeout=SETTLE_SECONDS)
        resumed = await agent.run(
            message_history=paused.all_messages(), deferred_tool_results=results
        )

        assert isinstance(resumed.output, str)
        assert resumed.output.startswith("Refund confirmed: re_")
        assert script.calls == 1
        assert len(system.provider.ledger()["refunds"]) == 1


async def test_invalid_input_goes_back_to_the_model_by_field_name_only(
    database_url: str, async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    registry = sandbox_registry()
    attempts: list[dict[str, Any]] = [
        {"payment_id": "card QWERTY-secret", "amount_cents": "twelve"},  # both refused
        {"payment_id": "pay_agent_4", "amount_cents": -777777},  # still refused
    ]
    seen: list[ToolReturnPart] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answer = latest_tool_return(messages)
        if answer is not None:
            seen.append(answer)
        if len(seen) < len(attempts):
            return ModelResponse(parts=[ToolCallPart("send_refund", attempts[len(seen)])])
        return ModelResponse(parts=[TextPart("I could not make that refund.")])

    toolset = OutboxToolset(registry, async_engine, max_retries=2)
    agent = Agent(FunctionModel(script), toolsets=[toolset], output_type=str)

    result = await agent.run("Refund it.")

    assert result.output == "I could not make that refund."
    assert [part.outcome for part in seen] == ["retried", "retried"]
    first, second = (str(part.content) for part in seen)
    # The contract's own strict validation speaks, not a lax one in front of it.
    assert first.startswith("input for tool 'send_refund' v1 is invalid")
    assert "payment_id" in first
    assert "amount_cents" in first
    assert "amount_cents" in second
    assert "payment_id" not in second
    logged = rendered(caplog)
    for value in ("QWERTY", "secret", "twelve", "777777"):
        assert value not in first + second + logged
    assert committed_counts(database_url).operations == 0


async def test_a_field_the_tool_does_not_take_goes_back_to_the_model_unrecorded(
    database_url: str, async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[ToolReturnPart] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        answer = latest_tool_return(messages)
        if answer is None:
            extra = {**REFUND, "refund_to": "acc_CANARY_elsewhere"}
            return ModelResponse(parts=[ToolCallPart("send_refund", extra)])
        seen.append(answer)
        return ModelResponse(parts=[TextPart("I could not make that refund.")])

    toolset = OutboxToolset(sandbox_registry(), async_engine, max_retries=1)
    agent = Agent(FunctionModel(script), toolsets=[toolset], output_type=str)

    await agent.run("Refund it to my other account.")

    (answer,) = seen
    assert answer.outcome == "retried"
    assert "refund_to: not a field of this tool" in str(answer.content)
    assert "CANARY" not in str(answer.content) + rendered(caplog)
    assert committed_counts(database_url).operations == 0


async def test_tools_are_the_registry_at_its_latest_versions(
    database_url: str, async_engine: AsyncEngine
) -> None:
    registry = Registry()
    registry.register(ticket_contract(1, TicketV1))
    registry.register(ticket_contract(2, TicketV2))
    offered: list[ToolDefinition] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        offered[:] = info.function_tools
        if latest_tool_return(messages) is None:
            ticket = {"title": "printer on fire", "urgent": True}
            return ModelResponse(parts=[ToolCallPart("open_ticket", ticket)])
        return ModelResponse(parts=[TextPart("done")])

    toolset = OutboxToolset(registry, async_engine, wait=0.5)
    agent = Agent(
        FunctionModel(script), toolsets=[toolset], output_type=[str, DeferredToolRequests]
    )

    result = await agent.run("Open a ticket.")

    definition = offered[0]
    assert [d.name for d in offered] == ["open_ticket"]
    # The model's schema, closed: a field it does not name is refused, never dropped.
    assert definition.parameters_json_schema == {
        **TicketV2.model_json_schema(),
        "additionalProperties": False,
    }
    assert definition.description == "Open a support ticket."
    assert isinstance(result.output, DeferredToolRequests)  # nobody runs the consumer here
    (call,) = result.output.calls
    operation_id = parse_operation_id(result.output.metadata[call.tool_call_id]["operation_id"])
    async with async_engine.connect() as connection:
        assert (await get_outcome_async(connection, operation_id)).tool_version == 2


async def test_a_tool_call_made_again_finds_its_decision(
    database_url: str, async_engine: AsyncEngine
) -> None:
    toolset = OutboxToolset(sandbox_registry(), async_engine, wait=0.2)
    ctx = run_context(conversation_id="conv_again", tool_call_id="call_1")
    async with toolset:
        tool = (await toolset.get_tools(ctx))["send_refund"]
        deferrals = []
        for _ in range(2):  # a replayed or resumed run executes the same call again
            with pytest.raises(CallDeferred) as deferred:
                await toolset.call_tool("send_refund", dict(REFUND), ctx, tool)
            deferrals.append(deferred.value.metadata)
        # The same call id with another intent is not the same call: refused, not guessed.
        with pytest.raises(DecisionConflict):
            await toolset.call_tool("send_refund", {**REFUND, "amount_cents": 2600}, ctx, tool)

    assert deferrals[0] == deferrals[1]
    assert deferrals[0] is not None
    assert deferrals[0]["status"] == "pending"
    assert committed_counts(database_url).operations == 1


@pytest.mark.parametrize("canceller", ["asyncio", "anyio"])
async def test_a_cancelled_tool_call_still_ends_its_transaction(
    database_url: str, async_engine: AsyncEngine, canceller: str
) -> None:
    toolset = OutboxToolset(sandbox_registry(), async_engine, wait=SETTLE_SECONDS)
    ctx = run_context(conversation_id="conv_cancel", tool_call_id="call_1")
    scopes: list[anyio.CancelScope] = []

    async def call_tool(tool: ToolsetTool[Any]) -> None:
        # pydantic-ai cancels both ways: asyncio's task.cancel() once, and anyio's
        # scopes (hooks with a timeout) again on every turn of the loop until done.
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await toolset.call_tool("send_refund", dict(REFUND), ctx, tool)

    async with toolset:
        tool = (await toolset.get_tools(ctx))["send_refund"]
        with psycopg.connect(database_url) as blocker:
            # The recording waits mid-transaction, so the cancellation comes before any
            # commit could.
            blocker.execute("LOCK TABLE operations IN EXCLUSIVE MODE")
            call = asyncio.create_task(call_tool(tool))
            await eventually(
                lambda: asyncio.to_thread(waits_for_a_lock, database_url, blocker),
                within=10,
                what="the recording to wait for the lock",
            )
            if canceller == "asyncio":
                call.cancel()
            else:
                scopes[0].cancel()
            await asyncio.sleep(0)
            blocker.rollback()
        if canceller == "asyncio":
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            await call  # the scope absorbs its own cancellation

    # Cancelled as it was, the call's transaction ran to its end: committed, whole.
    counts = committed_counts(database_url)
    assert (counts.operations, counts.outbox) == (1, 1)


def waits_for_a_lock(database_url: str, blocker: psycopg.Connection) -> bool:
    rows = execute_admin(
        database_url,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database() AND pid <> %s",
        (blocker.info.backend_pid,),
    )
    return bool(rows[0][0])


def test_without_pydantic_ai_the_import_says_what_to_install() -> None:
    hide_pydantic_ai = (
        "import sys; sys.modules['pydantic_ai'] = None; import outbox.integrations.pydantic_ai"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_pydantic_ai],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == (
        "ModuleNotFoundError: outbox.integrations.pydantic_ai needs pydantic-ai: "
        "pip install 'effect-outbox[pydantic-ai]'"
    )
    assert "During handling" not in result.stderr


# --- helpers ---------------------------------------------------------------------------


def sandbox_registry() -> Registry:
    from outbox.sandbox.tools import build_registry

    return build_registry()


def run_context(*, conversation_id: str, tool_call_id: str) -> RunContext[None]:
    return RunContext(
        deps=None,
        model=TestModel(),
        usage=RunUsage(),
        conversation_id=conversation_id,
        tool_call_id=tool_call_id,
    )


class TicketV1(BaseModel):
    model_config = ConfigDict(strict=True)

    title: str


class TicketV2(BaseModel):
    model_config = ConfigDict(strict=True)

    title: str
    urgent: bool = False


async def _open_ticket(ticket: BaseModel, ctx: ExecutionContext) -> EffectResult:
    return EffectResult(provider_reference=f"tk_{ctx.idempotency_key[:8]}")


def ticket_contract(version: int, model: type[BaseModel]) -> ToolContract[Any]:
    return ToolContract(
        name="open_ticket",
        version=version,
        input_model=model,
        side_effect=SideEffect.IDEMPOTENT_WRITE,
        execute=_open_ticket,
        description="Open a support ticket.",
    )
