"""The tool registry as MCP tools, with the guarantee (``outbox mcp``).

Every registered contract (its latest version) becomes one MCP tool. A call does not run
the tool: it records the decision in its own short transaction, the dispatcher and the
consumers carry it to one effect, and the call waits a bounded time for the outcome and
answers with it (structured) plus one sentence the model can act on.

MCP has no idempotency key, and JSON-RPC request ids restart with every connection, so
the decision's identity is a value the client chooses and sends again when it retries:
``_meta["io.effect-outbox/decision-key"]``. The same key with the same arguments is both
safe and a status check; with other arguments it is refused. Writes that must not
happen twice are refused without a key; a read or an idempotent write may go without.

Approvals never travel through MCP (no elicitation): a client can answer those itself.
They stay on the operator path, ``outbox approvals grant``.

Built on the SDK's low-level ``Server``: schemas come from each contract's
``input_model``, and nothing in the SDK validates arguments there, so
:func:`outbox.decisions.prepare_decision` does.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, cast
from uuid import UUID

import anyio
import psycopg
from mcp import MCPError
from mcp.server import Server, ServerRequestContext
from mcp.types import (
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
    ToolAnnotations,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.awaiting import Outcome, OutcomeStatus, OutcomeWatcher, get_outcome_async
from outbox.connections import DatabaseBounds, bounded_transaction, command_parameters
from outbox.contracts import Registry, SideEffect, ToolContract
from outbox.decisions import record_decision_async
from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    DecisionConflict,
    InputRejected,
    OperationNotFound,
    OutboxError,
    SchemaMissing,
    ToolNotRegistered,
)
from outbox.failover import ServerTracker, follow_failovers
from outbox.intent import MAX_ID_LENGTH, prepare_decision
from outbox.logs import log_fields
from outbox.mcp_server import BEARER_PRINCIPAL as BEARER_PRINCIPAL
from outbox.mcp_server import DEFAULT_RUN_ID, DEFAULT_WAIT_SECONDS
from outbox.mcp_server import LOOPBACK_PRINCIPAL as LOOPBACK_PRINCIPAL
from outbox.models import RecordedDecision, display_operation_id, parse_operation_id
from outbox.schema import schema_is_current_async
from outbox.settings import Settings

logger = logging.getLogger("outbox.mcp")

# Reverse-DNS prefix for our `_meta` keys; MCP reserves `*.modelcontextprotocol/` and `*.mcp/`.
META_PREFIX = "io.effect-outbox"
DECISION_KEY_META = f"{META_PREFIX}/decision-key"
RUN_ID_META = f"{META_PREFIX}/run-id"
OPERATION_META = f"{META_PREFIX}/operation"
RECORDED_META = f"{META_PREFIX}/recorded"
CONTRACT_META = f"{META_PREFIX}/contract"

STATUS_TOOL = "outbox_operation_status"
# A waiting call tells a caller that asked for progress where it stands this often.
PROGRESS_INTERVAL_SECONDS = 1.0
APPLICATION_NAME = "outbox-mcp"

# Where the HTTP guard leaves the authenticated principal for the handlers: the name
# the caller's token maps to, or LOOPBACK_PRINCIPAL when no token is configured.
PRINCIPAL_SCOPE_KEY = "outbox.mcp.principal"

# Writes whose repeat would be a second effect unless it carries the same identity.
KEY_REQUIRED = frozenset({SideEffect.DEDUPLICATED_WRITE, SideEffect.NON_REPEATABLE_WRITE})

INSTRUCTIONS = (
    "Each tool records a decision that the effect-outbox runtime carries out exactly once, "
    "then answers with its outcome and one sentence saying what to do next. Follow that "
    "sentence: a call repeated with the same decision key returns the same operation and "
    "never a second effect. Approvals are given by a person through the operator's tools, "
    "never through this conversation."
)


@dataclass(frozen=True)
class ServerOptions:
    run_id: str = DEFAULT_RUN_ID
    """The run a call belongs to when its `_meta` names none; decision keys are unique
    per run, so it must stay the same across restarts for a retry to find its decision."""
    wait: float = DEFAULT_WAIT_SECONDS
    """How long a call waits for the outcome before it answers ``pending``."""
    require_key: bool = False
    """Refuse keyless calls of every class, reads and idempotent writes included."""


# --- tools/list ----------------------------------------------------------------------


def outcome_schema() -> dict[str, Any]:
    return Outcome.model_json_schema(mode="serialization")


def key_required(contract: ToolContract[Any], options: ServerOptions) -> bool:
    return options.require_key or contract.side_effect in KEY_REQUIRED


def contract_meta(contract: ToolContract[Any], options: ServerOptions) -> dict[str, Any]:
    """The enforced contract, for hosts and people; the annotations only hint at it."""
    window = contract.dedupe_window
    return {
        "name": contract.name,
        "version": contract.version,
        "side_effect": contract.side_effect.value,
        "additive_only": contract.additive_only,
        "decision_key": "required" if key_required(contract, options) else "optional",
        "approval": contract.approval.explanation if contract.approval.required else None,
        "dedupe_window_seconds": window.total_seconds() if window is not None else None,
        "on_unknown": contract.on_unknown.value,
        "card": contract.card(),
    }


def contract_tool(contract: ToolContract[Any], options: ServerOptions) -> Tool:
    return Tool(
        name=contract.name,
        description=contract.description
        or f"{contract.name} v{contract.version} ({contract.side_effect.value})",
        input_schema=contract.input_schema(),
        output_schema=outcome_schema(),
        annotations=ToolAnnotations.model_validate(contract.mcp_annotations()),
        meta={CONTRACT_META: contract_meta(contract, options)},
    )


def status_tool() -> Tool:
    return Tool(
        name=STATUS_TOOL,
        description="Where an operation an earlier call of this server recorded stands now: "
        "committed, rejected, pending, awaiting_approval or escalated, with the sentence that "
        "says what to do. Changes nothing. Use it when you cannot call the tool again with "
        "the same decision key.",
        input_schema={
            "type": "object",
            "properties": {
                "operation_id": {
                    "type": "string",
                    "description": "the operation id an earlier answer gave (op_<uuid>)",
                }
            },
            "required": ["operation_id"],
            "additionalProperties": False,
        },
        output_schema=outcome_schema(),
        annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
    )


def registry_tools(registry: Registry, options: ServerOptions) -> list[Tool]:
    """One tool per contract name, at its latest version, and the status tool."""
    names = sorted({contract.name for contract in registry})
    if STATUS_TOOL in names:
        raise ConfigurationError(
            f"a tools module registers a tool named {STATUS_TOOL!r}, which `outbox mcp` "
            "serves itself; rename that tool"
        )
    return [contract_tool(registry.get(name), options) for name in names] + [status_tool()]


# --- what the model reads --------------------------------------------------------------


def sentence(outcome: Outcome, *, keyed: bool, approval: str | None = None) -> str:
    """One sentence per status that tells the model what to do next."""
    operation = outcome.display_id
    if outcome.status is OutcomeStatus.COMMITTED:
        evidence = (
            f"provider reference {outcome.provider_reference}"
            if outcome.provider_reference
            else operation
        )
        return f"Done: {outcome.tool} committed ({evidence})."
    if outcome.status is OutcomeStatus.REJECTED:
        return (
            f"Not done: {outcome.tool} was rejected ({outcome.reason or 'no reason recorded'}). "
            "Do not retry with the same key; a changed request is a new decision."
        )
    if outcome.status is OutcomeStatus.AWAITING_APPROVAL:
        return (
            f"Waiting for a person to approve {operation} ({approval or 'approval required'}). "
            "Tell the user; do not retry."
        )
    if outcome.status is OutcomeStatus.ESCALATED:
        return (
            f"The outcome of {operation} is unknown and a person is checking it with the "
            "evidence. Do not retry; tell the user."
        )
    # A keyless call repeated would be a new decision: only the status tool finds this one.
    again = "call again with the same arguments and decision key, or " if keyed else ""
    return (
        f"Accepted as {operation} and not settled yet. To check, {again}call {STATUS_TOOL} "
        f"with operation_id {operation}; do not start a new call."
    )


def answer(
    outcome: Outcome, *, keyed: bool, approval: str | None = None, created: bool | None = None
) -> CallToolResult:
    meta: dict[str, Any] = {OPERATION_META: outcome.display_id}
    if created is not None:
        meta[RECORDED_META] = "new" if created else "existing"
    return CallToolResult(
        content=[TextContent(text=sentence(outcome, keyed=keyed, approval=approval))],
        structured_content=outcome.model_dump(mode="json"),
        is_error=outcome.status is OutcomeStatus.REJECTED,
        meta=meta,
    )


def refusal(text: str) -> CallToolResult:
    """A call the model should correct; nothing of it was recorded."""
    return CallToolResult(content=[TextContent(text=text)], is_error=True)


def missing_key_refusal(contract: ToolContract[Any]) -> CallToolResult:
    why = (
        "this server requires one for every call"
        if contract.side_effect not in KEY_REQUIRED
        else "it changes something that must not happen twice"
    )
    return refusal(
        f"Not done: {contract.name} needs a decision key ({why}), and nothing was recorded. "
        f'Send a value unique to this decision in the request _meta under "{DECISION_KEY_META}" '
        "(for example the tool call id), and send the same value again when you retry."
    )


CONFLICT = (
    "Not done: this decision key was used for a different request (another tool or other "
    "arguments), and nothing was recorded. A retry must send the original arguments; a new "
    "decision needs a new decision key."
)
UNRECORDED = (
    "Not done yet: the runtime could not record this call (its database did not answer). "
    "Call again with the same arguments and decision key; that is safe and will not repeat "
    "an effect."
)

_DATABASE_FAILURES = (DatabaseError, SQLAlchemyError, psycopg.Error, OSError)


# --- tools/call ------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, result: CallToolResult, reason: str) -> None:
        super().__init__(reason)
        self.result = result
        self.reason = reason


@dataclass(frozen=True)
class _Identity:
    run_id: str
    decision_key: str
    keyed: bool


class ToolHost:
    """What a running server holds: the registry, one engine and one outcome watcher."""

    def __init__(
        self,
        registry: Registry,
        options: ServerOptions,
        engine: AsyncEngine,
        watcher: OutcomeWatcher,
        bounds: DatabaseBounds,
    ) -> None:
        self.registry = registry
        self.options = options
        self.engine = engine
        self.watcher = watcher
        self.bounds = bounds

    async def call(
        self, ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> CallToolResult:
        if params.name == STATUS_TOOL:
            return await self.status(ctx, params)
        contract = self._contract(params.name)
        arguments = params.arguments or {}
        try:
            identity = self._identity(ctx, contract)
            self._validate(contract, arguments, identity)
            recorded = await self._record(contract, arguments, identity)
        except _Refused as refused:
            log_fields(
                logger,
                logging.INFO,
                "mcp.refused",
                "refused a tool call",
                tool=contract.name,
                reason=refused.reason,
            )
            return refused.result
        outcome = await self._wait(ctx, recorded.operation.id)
        if outcome is None:
            return refusal(
                f"Recorded as {recorded.operation.display_id}, but its status could not be "
                "read. Call again with the same arguments and decision key to check; that "
                "will not repeat the effect."
            )
        log_fields(
            logger,
            logging.INFO,
            "mcp.answered",
            "answered a tool call",
            tool=contract.name,
            id=outcome.display_id,
            status=str(outcome.status),
            created=recorded.created,
        )
        return answer(
            outcome,
            keyed=identity.keyed,
            approval=contract.approval.explanation,
            created=recorded.created,
        )

    async def status(
        self, ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> CallToolResult:
        raw = (params.arguments or {}).get("operation_id")
        try:
            operation_id = parse_operation_id(raw) if isinstance(raw, str) else None
        except ValueError:
            operation_id = None
        if operation_id is None:
            return refusal(
                "operation_id must be the id an earlier answer gave, op_<uuid> (or a bare uuid)."
            )
        try:
            run_id = self._run_id(ctx)
            outcome = await self._read(operation_id)
        except _Refused as refused:
            return refused.result
        except OperationNotFound:
            outcome = None
        except _DATABASE_FAILURES as error:
            self._log_database_failure("status", error)
            return refusal(
                "The runtime's database did not answer; ask again shortly. Nothing was changed."
            )
        # Another run's operation reads as absent, so that ids cannot be probed across runs.
        if outcome is None or outcome.run_id != run_id:
            return refusal(
                f"No operation {display_operation_id(operation_id)} was recorded in this run."
            )
        # keyed=False: whoever asks here may have no key to call again with.
        return answer(outcome, keyed=False, approval=self._approval_explanation(outcome))

    # -- steps ---------------------------------------------------------------------------

    def _contract(self, name: str) -> ToolContract[Any]:
        try:
            return self.registry.get(name)
        except ToolNotRegistered:
            # A protocol error, as MCP asks for an unknown tool; the name is not echoed.
            raise MCPError(
                code=INVALID_PARAMS,
                message="unknown tool: call tools/list for the tools this server offers",
            ) from None

    def _identity(self, ctx: ServerRequestContext[Any], contract: ToolContract[Any]) -> _Identity:
        run_id = self._run_id(ctx)
        key = _request_meta(ctx).get(DECISION_KEY_META)
        if key is None:
            if key_required(contract, self.options):
                raise _Refused(missing_key_refusal(contract), "missing_decision_key")
            # A repeat of a read or an idempotent write is harmless: a fresh identity.
            return _Identity(run_id=run_id, decision_key=str(uuid.uuid4()), keyed=False)
        if not isinstance(key, str):
            raise _Refused(
                refusal(f'Not done: the _meta value "{DECISION_KEY_META}" must be a string.'),
                "decision_key_not_a_string",
            )
        return _Identity(run_id=run_id, decision_key=key, keyed=True)

    def _run_id(self, ctx: ServerRequestContext[Any]) -> str:
        client_run_id = _request_meta(ctx).get(RUN_ID_META, self.options.run_id)
        if not isinstance(client_run_id, str):
            raise _Refused(
                refusal(f'Not done: the _meta value "{RUN_ID_META}" must be a string.'),
                "run_id_not_a_string",
            )
        if ctx.request is None:
            # stdio (or in process): the client is the process that started this server.
            return client_run_id
        principal = _principal(ctx.request)
        if principal is None:
            raise _Refused(
                refusal("Not done: this HTTP endpoint has no authenticated caller."),
                "no_principal",
            )
        # Bound to the caller, so that nobody else can read or collide with its decisions.
        return f"{principal}:{client_run_id}"

    def _validate(
        self, contract: ToolContract[Any], arguments: Mapping[str, Any], identity: _Identity
    ) -> None:
        """Refuse bad input before a connection is taken (the SDK validates nothing)."""
        try:
            prepare_decision(
                self.registry,
                contract.name,
                arguments,
                run_id=identity.run_id,
                decision_key=identity.decision_key,
                tool_version=contract.version,
            )
        except InputRejected as rejected:
            raise _Refused(_input_refusal(rejected), "input_rejected") from None

    async def _record(
        self, contract: ToolContract[Any], arguments: Mapping[str, Any], identity: _Identity
    ) -> RecordedDecision:
        try:
            # A client timeout cancels this handler; a commit cut in half would leave the
            # client unsure, so recording finishes (or fails) whole. Its transaction is
            # bounded, so the shield cannot hold a call forever.
            with anyio.CancelScope(shield=True):
                async with bounded_transaction(self.engine, self.bounds.transaction) as conn:
                    recorded = await record_decision_async(
                        conn,
                        self.registry,
                        contract.name,
                        arguments,
                        run_id=identity.run_id,
                        decision_key=identity.decision_key,
                        tool_version=contract.version,
                    )
        except InputRejected as rejected:
            raise _Refused(_input_refusal(rejected), "input_rejected") from None
        except DecisionConflict:
            raise _Refused(refusal(CONFLICT), "decision_conflict") from None
        except (OutboxError, *_DATABASE_FAILURES) as error:
            self._log_database_failure("record", error)
            raise _Refused(refusal(UNRECORDED), "not_recorded") from None
        return recorded

    async def _wait(self, ctx: ServerRequestContext[Any], operation_id: UUID) -> Outcome | None:
        """The outcome once it is final or needs a person, else after ``wait`` seconds the
        latest one; None if it could not be read at all."""
        outcome: Outcome | None = None
        if self.options.wait > 0:
            # One waiter for the whole wait: the watcher answers every call of the process
            # with one query per change or poll, however many calls wait.
            async with anyio.create_task_group() as progress:
                progress.start_soon(
                    _report_progress, ctx, display_operation_id(operation_id), self.options.wait
                )
                try:
                    outcome = await self.watcher.wait(operation_id, timeout=self.options.wait)
                except (OutboxError, *_DATABASE_FAILURES) as error:
                    self._log_database_failure("wait", error)
                progress.cancel_scope.cancel()
        if outcome is not None:
            return outcome
        try:
            return await self._read(operation_id)
        except (OutboxError, *_DATABASE_FAILURES) as error:
            self._log_database_failure("read", error)
            return None

    async def _read(self, operation_id: UUID) -> Outcome:
        async with self.engine.connect() as conn:
            return await get_outcome_async(conn, operation_id)

    def _approval_explanation(self, outcome: Outcome) -> str | None:
        try:
            return self.registry.get(outcome.tool, outcome.tool_version).approval.explanation
        except OutboxError:
            return None

    @staticmethod
    def _log_database_failure(step: str, error: BaseException) -> None:
        # The class only: driver messages can quote statements and their parameters.
        log_fields(
            logger,
            logging.WARNING,
            "mcp.database_failed",
            "a database step failed",
            step=step,
            error=type(error).__name__,
        )


def _request_meta(ctx: ServerRequestContext[Any]) -> Mapping[str, Any]:
    return cast("Mapping[str, Any]", ctx.meta or {})


def _principal(request: Any) -> str | None:
    scope = getattr(request, "scope", None)
    principal = scope.get(PRINCIPAL_SCOPE_KEY) if isinstance(scope, Mapping) else None
    return principal if isinstance(principal, str) and principal else None


def _input_refusal(rejected: InputRejected) -> CallToolResult:
    # InputRejected names fields and rules, never the values sent.
    return refusal(
        f"Not done: {rejected.message}. Nothing was recorded; correct the arguments and call again."
    )


async def _report_progress(ctx: ServerRequestContext[Any], operation: str, total: float) -> None:
    """Every second of the wait, until cancelled. Nothing is sent unless the caller asked
    for progress. A wait still running means the operation is pending: any other status
    would have ended it."""
    started = anyio.current_time()
    while (elapsed := anyio.current_time() - started) < total:
        await anyio.sleep(min(PROGRESS_INTERVAL_SECONDS, total - elapsed))
        # A caller gone away cannot hear it; its retry with the same key finds the decision.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await ctx.session.report_progress(
                min(anyio.current_time() - started, total), total, f"{operation} is pending"
            )


# --- the server ------------------------------------------------------------------------


def _log_database_failover(previous: str, current: str) -> None:
    log_fields(
        logger,
        logging.WARNING,
        "mcp.database_failover",
        "the database is on another server now; new sessions go there",
        **{"from": previous, "to": current},
    )


def _package_version() -> str:
    try:
        return version("effect-outbox")
    except PackageNotFoundError:
        return ""


def build_server(
    registry: Registry, settings: Settings, options: ServerOptions | None = None
) -> Server[ToolHost]:
    """An MCP server for ``registry``. Its lifespan opens one engine and one outcome
    watcher on ``settings.database_url`` (and fails at once if the database cannot be
    reached); every connection the server serves shares them."""
    options = options or ServerOptions()
    if options.wait < 0:
        raise ConfigurationError("--wait must not be negative")
    if not 1 <= len(options.run_id) <= MAX_ID_LENGTH or "\x00" in options.run_id:
        # Refused here rather than on every call.
        raise ConfigurationError(f"--run-id must be 1 to {MAX_ID_LENGTH} characters")
    tools = registry_tools(registry, options)

    @asynccontextmanager
    async def lifespan(_server: Server[ToolHost]) -> AsyncIterator[ToolHost]:
        bounds = DatabaseBounds.from_settings(settings)
        engine = create_async_engine(
            settings.sqlalchemy_url,
            pool_size=10,
            max_overflow=10,
            connect_args={"application_name": APPLICATION_NAME, **bounds.libpq_parameters()},
        )
        follow_failovers(engine, ServerTracker(_log_database_failover))
        try:
            watcher = OutcomeWatcher(engine, connect_parameters=command_parameters(settings))
            async with watcher:
                # Checked once the watcher could connect (an unreachable database is
                # reported as that): without it every call would be answered "the
                # database did not answer, call again", which no retry can cure.
                async with engine.connect() as connection:
                    if not await schema_is_current_async(connection):
                        raise SchemaMissing()
                log_fields(
                    logger,
                    logging.INFO,
                    "mcp.ready",
                    "serving tools",
                    tools=len(tools),
                    wait_s=options.wait,
                )
                yield ToolHost(registry, options, engine, watcher, bounds)
        finally:
            await engine.dispose()

    async def list_tools(
        ctx: ServerRequestContext[ToolHost], params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(
        ctx: ServerRequestContext[ToolHost], params: CallToolRequestParams
    ) -> CallToolResult:
        return await ctx.lifespan_context.call(ctx, params)

    return Server(
        "effect-outbox",
        version=_package_version(),
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
