"""The MCP server of ``outbox mcp``: what a tool call does, and the server's lifespan.

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
:func:`outbox.intent.prepare_decision` does. What is listed is in
:mod:`outbox.mcp.tools`; what the model reads, in :mod:`outbox.mcp.answers`.
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
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.awaiting import Outcome, OutcomeWatcher, get_outcome_async
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.connections import DatabaseBounds, command_parameters
from outbox.contracts import Registry, ToolContract
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
from outbox.mcp.answers import (
    CONFLICT,
    UNRECORDED,
    answer,
    input_refusal,
    missing_key_refusal,
    refusal,
)
from outbox.mcp.config import PRINCIPAL_SCOPE_KEY, ServerOptions
from outbox.mcp.tools import (
    DECISION_KEY_META,
    RUN_ID_META,
    STATUS_TOOL,
    key_required,
    registry_tools,
)
from outbox.models import RecordedDecision, display_operation_id, parse_operation_id
from outbox.recording import record_decision_whole
from outbox.schema import schema_is_current_async
from outbox.settings import Settings
from outbox.store import NewDecision
from outbox.tracing import current_traceparent

logger = logging.getLogger("outbox.mcp")

# A waiting call tells a caller that asked for progress where it stands this often.
PROGRESS_INTERVAL_SECONDS = 1.0
APPLICATION_NAME = "outbox-mcp"


INSTRUCTIONS = (
    "Each tool records a decision that the effect-outbox runtime carries out exactly once, "
    "then answers with its outcome and one sentence saying what to do next. Follow that "
    "sentence: a call repeated with the same decision key returns the same operation and "
    "never a second effect. Approvals are given by a person through the operator's tools, "
    "never through this conversation."
)


_DATABASE_FAILURES = (DatabaseError, SQLAlchemyError, psycopg.Error, OSError)


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
        decision_lock_timeout: float = DECISION_LOCK_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.options = options
        self.engine = engine
        self.watcher = watcher
        self.bounds = bounds
        self.decision_lock_timeout = decision_lock_timeout

    async def call(
        self, ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> CallToolResult:
        if params.name == STATUS_TOOL:
            return await self.status(ctx, params)
        contract = self._contract(params.name)
        arguments = params.arguments or {}
        try:
            identity = self._identity(ctx, contract)
            recorded = await self._record(self._prepare(contract, arguments, identity))
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

    def _prepare(
        self, contract: ToolContract[Any], arguments: Mapping[str, Any], identity: _Identity
    ) -> NewDecision:
        """Validate once, before a connection is taken (the SDK validates nothing)."""
        try:
            return prepare_decision(
                self.registry,
                contract.name,
                arguments,
                run_id=identity.run_id,
                decision_key=identity.decision_key,
                tool_version=contract.version,
                traceparent=current_traceparent(),
            )
        except InputRejected as rejected:
            raise _Refused(input_refusal(rejected), "input_rejected") from None

    async def _record(self, decision: NewDecision) -> RecordedDecision:
        try:
            # A client timeout cancels this handler: the recording still ends whole,
            # within the transaction's bound.
            return await record_decision_whole(
                self.engine,
                decision,
                seconds=self.bounds.transaction,
                lock_timeout=self.decision_lock_timeout,
            )
        except DecisionConflict:
            raise _Refused(refusal(CONFLICT), "decision_conflict") from None
        except (OutboxError, *_DATABASE_FAILURES) as error:
            self._log_database_failure("record", error)
            raise _Refused(refusal(UNRECORDED), "not_recorded") from None

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
                yield ToolHost(
                    registry, options, engine, watcher, bounds, settings.decision_lock_timeout
                )
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
