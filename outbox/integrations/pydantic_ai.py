"""pydantic-ai tools whose side effects the runtime owns.

:class:`OutboxToolset` offers every tool of a :class:`~outbox.Registry` to a pydantic-ai
agent: one tool per contract, at its latest version, with the contract's input model as
the parameters' schema. A call records the decision in a short transaction of its own,
then waits a bounded time for the outcome, and answers the model by what it found:

- **committed**: the tool's result (``status``, ``operation_id``,
  ``provider_reference``, ``result``);
- **rejected**: a failed tool result (pydantic-ai's ``ToolFailed``): the effect did not
  and will not happen, and calling again with the same input is refused again;
- **pending, awaiting approval, escalated**: the call is deferred (``CallDeferred``, with
  ``operation_id`` and ``status`` in its metadata). The run ends with
  ``DeferredToolRequests`` and nothing held open; :func:`resume_results` answers them
  once the operations settle, for a follow-up run.

Input the contract refuses goes back to the model as a retry (``ModelRetry``) with the
problems by field name, never the values; nothing is recorded.

A decision is identified by the conversation (pydantic-ai's ``conversation_id``: a
resumed run gets a new ``run_id`` but keeps it) and the tool call id. A call executed
again, by a replayed or resumed run, finds the decision it recorded the first time
instead of making a second one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, Self
from uuid import UUID

from pydantic_core import SchemaValidator, core_schema
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.awaiting import Outcome, OutcomeStatus, OutcomeWatcher
from outbox.contracts import Registry, ToolContract
from outbox.errors import InputRejected, OutboxError, TransientDatabaseError
from outbox.intent import prepare_decision
from outbox.models import RecordedDecision, display_operation_id, parse_operation_id
from outbox.recording import record_decision_whole
from outbox.tracing import current_traceparent

try:
    from pydantic_ai import (
        CallDeferred,
        DeferredToolRequests,
        DeferredToolResults,
        ModelRetry,
        RunContext,
        ToolDefinition,
        ToolFailed,
    )
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
except ModuleNotFoundError as missing:
    if missing.name is None or missing.name.partition(".")[0] != "pydantic_ai":
        raise
    raise ModuleNotFoundError(
        "outbox.integrations.pydantic_ai needs pydantic-ai: "
        "pip install 'effect-outbox[pydantic-ai]'"
    ) from None

__all__ = [
    "DEFAULT_RESUME_TIMEOUT",
    "DEFAULT_WAIT",
    "OperationsUnsettled",
    "OutboxToolset",
    "resume_results",
]

DEFAULT_WAIT = timedelta(seconds=10)
"""How long a tool call waits for its outcome before it defers."""
DEFAULT_RESUME_TIMEOUT = timedelta(seconds=30)
# How long recording a decision may take, its transaction cut past it; a cancelled tool
# call waits that long at most for its decision's transaction to end.
RECORDING_DEADLINE_SECONDS = 30.0
# A run with a deadline is cancelled when it passes, and the deferral that would have
# let the app resume goes with it: a call stops waiting this long before.
DEADLINE_MARGIN_SECONDS = 1.0

# Any JSON object. The contract's own validation (strict, JSON round trip, size and depth
# limits) is the one that decides, in record_decision: a second validator here could
# accept what it refuses, and pydantic-ai's retry prompt for a ValidationError repeats
# the offending values, where InputRejected names only the fields.
_ANY_OBJECT = SchemaValidator(
    core_schema.dict_schema(
        keys_schema=core_schema.str_schema(), values_schema=core_schema.any_schema()
    )
)
# What InputRejected names when the decision's identity is at fault, not the model's
# input: asking the model to try again cannot fix those.
_IDENTITY_PROBLEMS = frozenset({"run_id", "decision_key", "traceparent"})
_METADATA_KEY = "effect_outbox"


def _conversation_id(ctx: RunContext[Any]) -> str:
    if not ctx.conversation_id:
        raise OutboxError(
            "the pydantic-ai run has no conversation_id to use as the outbox run id; pass "
            "run_id=... to OutboxToolset"
        )
    return ctx.conversation_id


def _seconds(value: timedelta | float) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise ValueError("a wait must not be negative")
    return seconds


class OutboxToolset(AbstractToolset[Any]):
    """Serves a registry's tools to a pydantic-ai agent; the runtime performs the effects.

    ::

        toolset = OutboxToolset(registry, engine)
        agent = Agent(model, toolsets=[toolset], output_type=[str, DeferredToolRequests])

    ``engine`` is an :class:`~sqlalchemy.ext.asyncio.AsyncEngine` on the outbox database;
    each decision is recorded in a transaction of its own on it. ``wait`` bounds how long
    a call waits for its outcome (less when the run's deadline is nearer). ``watcher``
    shares an :class:`~outbox.OutcomeWatcher` the caller runs; without one the toolset
    opens its own when pydantic-ai enters it for a run and closes it after the last run
    that entered it. ``run_id`` maps the run context to the outbox run id (default: the
    conversation id). ``max_retries`` is how often the model may fix input the contract
    refused. The toolset serves one event loop at a time: its watcher belongs to the loop
    that entered it.

    A tool call id that already names another decision in the conversation (a provider
    that reuses ids) raises :class:`~outbox.DecisionConflict` and stops the run: which
    call the model meant cannot be guessed, and nothing was recorded for it.
    """

    def __init__(
        self,
        registry: Registry,
        engine: AsyncEngine,
        *,
        wait: timedelta | float = DEFAULT_WAIT,
        watcher: OutcomeWatcher | None = None,
        run_id: Callable[[RunContext[Any]], str] | None = None,
        max_retries: int = 1,
        id: str | None = None,
    ) -> None:
        self.registry = registry
        self.engine = engine
        self.wait_seconds = _seconds(wait)
        self.max_retries = max_retries
        self._run_id = run_id or _conversation_id
        self._id = id
        self._shared_watcher = watcher
        self._own_watcher: OutcomeWatcher | None = None
        self._entered = 0
        self._definitions: dict[tuple[str, int], ToolDefinition] = {}

    @property
    def id(self) -> str | None:
        return self._id

    async def __aenter__(self) -> Self:
        self._entered += 1
        if self._shared_watcher is None and self._own_watcher is None:
            # Set before the first await: a run entering concurrently shares this one.
            watcher = self._own_watcher = OutcomeWatcher(self.engine)
            try:
                await watcher.start()
            except BaseException:
                self._entered -= 1
                self._own_watcher = None
                raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._entered = max(0, self._entered - 1)
        if self._entered == 0 and self._own_watcher is not None:
            watcher, self._own_watcher = self._own_watcher, None
            await watcher.close()

    def _watcher(self) -> OutcomeWatcher:
        watcher = self._shared_watcher or self._own_watcher
        if watcher is None:
            raise OutboxError(
                "OutboxToolset is not entered: pass it to an Agent (which enters it around "
                "each run), or use `async with toolset:`"
            )
        return watcher

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        latest: dict[str, ToolContract[Any]] = {}
        for contract in self.registry:  # in (name, version) order: the latest comes last
            latest[contract.name] = contract
        return {
            name: ToolsetTool(
                toolset=self,
                tool_def=self._definition(contract),
                max_retries=self.max_retries,
                args_validator=_ANY_OBJECT,
            )
            for name, contract in latest.items()
        }

    def _definition(self, contract: ToolContract[Any]) -> ToolDefinition:
        definition = self._definitions.get(contract.key)
        if definition is None:
            definition = self._definitions[contract.key] = ToolDefinition(
                name=contract.name,
                parameters_json_schema=contract.input_schema(),
                description=contract.description.strip() or None,
                metadata={
                    _METADATA_KEY: {
                        "tool_version": contract.version,
                        "side_effect": str(contract.side_effect),
                    }
                },
            )
        return definition

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        watcher = self._watcher()
        recorded = await self._record(name, tool_args, ctx, _offered_version(tool))
        try:
            outcome = await watcher.wait(recorded, timeout=self._wait_seconds(ctx))
        except TransientDatabaseError:
            # The decision is committed; only reading its outcome failed. The run pauses
            # on it like on any unsettled one, and resuming reads it again.
            raise CallDeferred(
                metadata=_deferral(recorded.operation.id, OutcomeStatus.PENDING, None, name)
            ) from None
        return _answer(outcome)

    async def _record(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], version: int | None
    ) -> RecordedDecision:
        if ctx.tool_call_id is None:
            raise OutboxError("pydantic-ai called the tool without a tool_call_id")
        try:
            decision = prepare_decision(
                self.registry,
                name,
                tool_args,
                run_id=self._run_id(ctx),
                decision_key=ctx.tool_call_id,
                tool_version=version,
                traceparent=current_traceparent(),
            )
        except InputRejected as rejected:
            if _IDENTITY_PROBLEMS.intersection(rejected.problems):
                raise
            # The message names fields and rules, never values (outbox.decisions).
            raise ModelRetry(rejected.message) from None
        # A cancelled call (a sibling failed, the run was stopped or timed out) lets the
        # transaction end first, within its deadline, and stays cancelled; a rerun of the
        # same call finds the decision by its key.
        return await record_decision_whole(
            self.engine, decision, seconds=RECORDING_DEADLINE_SECONDS
        )

    def _wait_seconds(self, ctx: RunContext[Any]) -> float:
        remaining = ctx.remaining_time()
        if remaining is None:
            return self.wait_seconds
        return max(0.0, min(self.wait_seconds, remaining - DEADLINE_MARGIN_SECONDS))


def _offered_version(tool: ToolsetTool[Any]) -> int | None:
    # The version whose schema the model was shown, even if a newer one was registered since.
    ours = (tool.tool_def.metadata or {}).get(_METADATA_KEY)
    version = ours.get("tool_version") if isinstance(ours, Mapping) else None
    return version if isinstance(version, int) else None


def _answer(outcome: Outcome) -> dict[str, Any]:
    if outcome.status is OutcomeStatus.COMMITTED:
        return _committed_result(outcome)
    if outcome.status is OutcomeStatus.REJECTED:
        raise ToolFailed(_rejection_message(outcome))
    raise CallDeferred(
        metadata=_deferral(outcome.operation_id, outcome.status, outcome.reason, outcome.tool)
    )


def _committed_result(outcome: Outcome) -> dict[str, Any]:
    return {
        "status": str(OutcomeStatus.COMMITTED),
        "operation_id": outcome.display_id,
        "provider_reference": outcome.provider_reference,
        "result": outcome.result or {},
    }


def _rejection_message(outcome: Outcome) -> str:
    # `reason` is a code from a closed alphabet (the tool's rejection code), safe to show.
    return (
        f"{outcome.tool} was rejected ({outcome.reason or 'no reason given'}): it was not "
        f"done and will not be. Operation {outcome.display_id}. Calling it again with the "
        "same input is rejected again."
    )


def _deferral(
    operation_id: UUID, status: OutcomeStatus, reason: str | None, tool: str
) -> dict[str, Any]:
    return {
        "operation_id": display_operation_id(operation_id),
        "status": str(status),
        "reason": reason,
        "tool": tool,
    }


# --- resuming ---------------------------------------------------------------------------


class OperationsUnsettled(OutboxError):
    """Some deferred operations had not settled when :func:`resume_results` stopped waiting.

    Nothing is lost: keep the ``DeferredToolRequests`` (and the message history) and call
    :func:`resume_results` again later. ``outcomes`` holds the latest outcome of each
    unsettled operation by tool call id, ``status`` telling who is on it (the runtime, or
    a person: ``awaiting_approval``, ``escalated``).
    """

    def __init__(self, outcomes: Mapping[str, Outcome]) -> None:
        self.outcomes = dict(outcomes)
        listed = ", ".join(
            f"{outcome.display_id} {outcome.status}" for outcome in self.outcomes.values()
        )
        super().__init__(
            f"{len(self.outcomes)} deferred operation(s) not settled yet ({listed}); keep the "
            "DeferredToolRequests and resume later"
        )


async def resume_results(
    requests: DeferredToolRequests,
    source: OutcomeWatcher | AsyncEngine | str,
    *,
    timeout: timedelta | float | None = DEFAULT_RESUME_TIMEOUT,  # noqa: ASYNC109
    unsettled: Literal["raise", "report"] = "raise",
) -> DeferredToolResults:
    """Wait for the operations :class:`OutboxToolset` deferred, and answer their calls.

    Returns ``DeferredToolResults`` for the follow-up run (``agent.run(
    message_history=..., deferred_tool_results=...)``): the tool's result for a committed
    operation, ``ToolFailed`` for a rejected one. Waits until each is final (committed or
    rejected), all at once, at most ``timeout`` (None: as long as it takes).

    An operation still unsettled then (the runtime still on it, or a person not yet done
    approving or deciding) raises :class:`OperationsUnsettled` by default: the run stays
    paused, and calling again later picks up where this left off. ``unsettled="report"``
    answers it instead with its current status and a note not to call again, for an app
    that would rather let the conversation go on; the model then learns the final
    outcome only by asking for it some other way.

    Deferred calls of other toolsets are left out: merge their results in with
    ``DeferredToolResults.update``. ``source`` is an :class:`~outbox.OutcomeWatcher`, or an
    engine or URL of the outbox database for a watcher opened for this call.
    """
    operations = {
        call.tool_call_id: operation_id
        for call in requests.calls
        if (operation_id := _deferred_operation(requests.metadata.get(call.tool_call_id)))
        is not None
    }
    if not operations:
        return DeferredToolResults()
    if isinstance(source, OutcomeWatcher):
        outcomes = await _wait_all(source, operations, timeout)
    else:
        async with OutcomeWatcher(source) as watcher:
            outcomes = await _wait_all(watcher, operations, timeout)
    pending = {call_id: outcome for call_id, outcome in outcomes.items() if not outcome.final}
    if pending and unsettled == "raise":
        raise OperationsUnsettled(pending)
    return DeferredToolResults(
        calls={call_id: _resumed_answer(outcome) for call_id, outcome in outcomes.items()}
    )


def _deferred_operation(metadata: Mapping[str, Any] | None) -> UUID | None:
    if not metadata or metadata.get("status") not in set(OutcomeStatus):
        return None
    operation_id = metadata.get("operation_id")
    if not isinstance(operation_id, str):
        return None
    try:
        return parse_operation_id(operation_id)
    except ValueError:
        return None


async def _wait_all(
    watcher: OutcomeWatcher,
    operations: Mapping[str, UUID],
    timeout: timedelta | float | None,  # noqa: ASYNC109
) -> dict[str, Outcome]:
    call_ids = list(operations)
    outcomes = await asyncio.gather(
        *(watcher.wait(operations[call_id], timeout=timeout, until="final") for call_id in call_ids)
    )
    return dict(zip(call_ids, outcomes, strict=True))


def _resumed_answer(outcome: Outcome) -> dict[str, Any] | ToolFailed:
    if outcome.status is OutcomeStatus.COMMITTED:
        return _committed_result(outcome)
    if outcome.status is OutcomeStatus.REJECTED:
        return ToolFailed(_rejection_message(outcome))
    return {
        "status": str(outcome.status),
        "operation_id": outcome.display_id,
        "reason": outcome.reason,
        "note": (
            "not settled yet, and "
            + (
                "a person is on it"
                if outcome.needs_person
                else "the runtime is still carrying it out"
            )
            + ": do not call the tool again for this request, that would be a second one"
        ),
    }
