"""A pydantic-ai agent refunds a damaged parcel; the payment provider loses the response.

The agent's tools come from the registry (``OutboxToolset``): the refund is recorded as
a decision, the dispatcher and the consumer carry it out, the lost response becomes an
unknown outcome, the reconciler finds the refund, and only then does the agent's tool
call return, so the agent tells the customer what actually happened, and the customer
is refunded once.

No API key, no network: the "LLM" below is a short script (pydantic-ai's
``FunctionModel``) standing in for a real model. Put ``Agent("openai:gpt-5", ...)`` in
its place and nothing else changes.

Like ``outbox demo``, it runs against the Postgres and RabbitMQ at
``OUTBOX_DATABASE_URL`` / ``OUTBOX_AMQP_URL`` in a database and broker names of its own,
starts the payment sandbox and the two daemons, and removes all of it at the end::

    .venv/bin/pip install -e '.[pydantic-ai]' && .venv/bin/python examples/agent_refund.py
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uuid
from typing import Any
from uuid import UUID

import psycopg
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import OperationState, OutboxError, agent_completed, store
from outbox.integrations.pydantic_ai import OutboxToolset, resume_results
from outbox.models import Operation, parse_operation_id
from outbox.sandbox import demo
from outbox.sandbox.processes import DaemonProcess
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.tools import build_registry
from outbox.settings import load_settings, sqlalchemy_url
from outbox.store import Store

CUSTOMER = "My parcel arrived damaged. Please refund the 25 EUR I paid (payment pay_parcel_42)."
REFUND = {"payment_id": "pay_parcel_42", "amount_cents": 2500, "reason": "parcel arrived damaged"}
INSTRUCTIONS = (
    "You are a support agent. Refund damaged parcels with send_refund. Tell the customer "
    "only what the tool's result says happened."
)
SETTLE_WITHIN_SECONDS = 60.0


def scripted_llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A stand-in for an LLM, not one: asks for the refund, then reads the tool's answer."""
    answers = [part for part in messages[-1].parts if isinstance(part, ToolReturnPart)]
    if not answers:
        return ModelResponse(parts=[ToolCallPart("send_refund", REFUND)])
    answer = answers[-1]
    result: Any = answer.content  # what OutboxToolset returns for a committed refund
    if answer.outcome == "success" and isinstance(result, dict):
        reference = result["provider_reference"]
        text = f"Your refund of 25.00 EUR is confirmed (provider reference {reference})."
    else:
        text = f"I could not refund this: {answer.model_response_str()}"
    return ModelResponse(parts=[TextPart(text)])


def refund_operation(messages: list[ModelMessage]) -> UUID:
    """The operation id the refund tool call answered with."""
    for message in messages:
        for part in message.parts if isinstance(message, ModelRequest) else ():
            result: Any = part.content if isinstance(part, ToolReturnPart) else None
            if isinstance(result, dict) and "operation_id" in result:
                return parse_operation_id(result["operation_id"])
    raise LookupError("the agent's run holds no answered refund")


async def converse(database_url: str) -> tuple[str, str, UUID]:
    """One customer request, answered once the refund has an outcome; returns the answer,
    the conversation id (the outbox run id) and the refund's operation id."""
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        toolset = OutboxToolset(build_registry(), engine)
        agent = Agent(
            FunctionModel(scripted_llm),
            instructions=INSTRUCTIONS,
            toolsets=[toolset],
            output_type=[str, DeferredToolRequests],
        )
        run = await agent.run(CUSTOMER, conversation_id=f"run_{uuid.uuid4().hex[:6]}")
        while isinstance(run.output, DeferredToolRequests):
            # Not settled within the tool call's wait (a slow machine): the run paused with
            # nothing held open; it goes on once the refund has its outcome.
            demo.say("   (the refund is still being settled: the run paused, and resumes then)")
            results = await resume_results(run.output, engine, timeout=SETTLE_WITHIN_SECONDS)
            run = await agent.run(message_history=run.all_messages(), deferred_tool_results=results)
        return run.output, run.conversation_id, refund_operation(run.all_messages())
    finally:
        await engine.dispose()


def operation(database_url: str, operation_id: UUID) -> Operation:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(store.get_operation(operation_id))


def tell(scratch: ScratchEnvironment) -> int:
    # The sandbox refunds, then closes the connection without an answer, every time.
    daemons: list[DaemonProcess] = []
    with SandboxProvider(faults=Faults(drop_response_every=1)) as provider:
        try:
            return tell_with(scratch, provider, daemons)
        finally:
            for daemon in daemons:
                daemon.stop()
            demo.clean_up(scratch)


def tell_with(
    scratch: ScratchEnvironment, provider: SandboxProvider, daemons: list[DaemonProcess]
) -> int:
    scratch.create()
    demo.say_created(scratch)
    environment = demo.daemon_environment(scratch.settings, provider)
    daemons.extend(demo.start(module, environment) for module in ("dispatcher", "consumer"))

    demo.say(f"   customer: {CUSTOMER}")
    answer, run_id, operation_id = asyncio.run(converse(scratch.database_url))
    demo.say(f"   agent:    {answer}\n")

    refund = operation(scratch.database_url, operation_id)
    for event in demo.events_of(scratch.database_url, refund):
        demo.say("   " + demo.trace_line(event, refund))
    confirmed = refund.state is OperationState.COMMITTED and "confirmed" in answer
    completed = agent_completed(run_id, "refund_confirmed" if confirmed else "refund_unconfirmed")
    name, _, fields = completed.partition(" ")
    demo.say(f"   {name:<25} {fields}")
    refunds = len(provider.ledger()["refunds"])
    demo.say(f"   provider ledger: {refunds} refund for one decision")
    return 0 if confirmed and refunds == 1 else 1


def main() -> int:
    # The story goes to stdout; the sandbox's and the runtime's own log lines would drown it.
    for noisy in ("outbox.sandbox.provider", "outbox.lifecycle", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so that the database, queues and daemons are removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = load_settings()
    demo.say("effect-outbox + pydantic-ai: an agent's refund whose response is lost")
    demo.say("(the model is a scripted stand-in for an LLM: no API key, no network)\n")
    try:
        demo.check_services(settings)
    except OutboxError as missing:
        print(f"agent_refund: {missing}", file=sys.stderr)
        return 1
    return tell(demo.scratch_for(settings))


if __name__ == "__main__":
    sys.exit(main())
