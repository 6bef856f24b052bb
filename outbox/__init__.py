"""effect-outbox: the model proposes an action; the runtime owns the effect.

An agent service registers its tools with side-effect contracts and records each
decision in its own database transaction; the dispatcher and consumer daemons carry
every recorded decision to exactly one confirmed effect, one definitive rejection or
one escalation to a person.
"""

from __future__ import annotations

from outbox.awaiting import (
    Outcome,
    OutcomeStatus,
    OutcomeWatcher,
    await_outcome,
    await_outcome_sync,
    close_shared_watchers,
    get_outcome,
    get_outcome_async,
)
from outbox.callback_policy import (
    CallbackPolicy,
    CallbackProvider,
    CallbackReport,
    CallbackStatus,
    Scheme,
)
from outbox.contracts import (
    ApprovalPolicy,
    OnUnknown,
    ProviderLimits,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
)
from outbox.decisions import (
    check_approval,
    check_approval_async,
    grant_approval,
    grant_approval_async,
    record_decision,
    record_decision_async,
)
from outbox.errors import (
    ConfigurationError,
    ContractRefused,
    DatabaseError,
    DecisionBlocked,
    DecisionConflict,
    IllegalTransition,
    InputRejected,
    LeaseLost,
    OperationNotFound,
    OutboxError,
    SchemaMissing,
    ToolNotRegistered,
    TransientDatabaseError,
)
from outbox.fingerprint import intent_fingerprint
from outbox.lifecycle import agent_completed
from outbox.models import (
    Approval,
    ApprovalCheck,
    ApprovalStatus,
    Operation,
    OperationEvent,
    RecordedDecision,
)
from outbox.outcomes import (
    DefinitiveRejection,
    EffectResult,
    ExecutionContext,
    Found,
    InProgress,
    NotFound,
    NotSent,
    OutcomeUnknown,
    ProviderUnavailable,
    RateLimited,
    StillUnknown,
    Unreachable,
)
from outbox.settings import Settings
from outbox.states import EventName, OperationState

__all__ = [
    "Approval",
    "ApprovalCheck",
    "ApprovalPolicy",
    "ApprovalStatus",
    "CallbackPolicy",
    "CallbackProvider",
    "CallbackReport",
    "CallbackStatus",
    "ConfigurationError",
    "ContractRefused",
    "DatabaseError",
    "DecisionBlocked",
    "DecisionConflict",
    "DefinitiveRejection",
    "EffectResult",
    "EventName",
    "ExecutionContext",
    "Found",
    "IllegalTransition",
    "InProgress",
    "InputRejected",
    "LeaseLost",
    "NotFound",
    "NotSent",
    "OnUnknown",
    "Operation",
    "OperationEvent",
    "OperationNotFound",
    "OperationState",
    "OutboxError",
    "Outcome",
    "OutcomeStatus",
    "OutcomeUnknown",
    "OutcomeWatcher",
    "ProviderLimits",
    "ProviderUnavailable",
    "RateLimited",
    "RecordedDecision",
    "Registry",
    "RetryPolicy",
    "SchemaMissing",
    "Scheme",
    "Settings",
    "SideEffect",
    "StillUnknown",
    "ToolContract",
    "ToolNotRegistered",
    "TransientDatabaseError",
    "Unreachable",
    "agent_completed",
    "await_outcome",
    "await_outcome_sync",
    "check_approval",
    "check_approval_async",
    "close_shared_watchers",
    "get_outcome",
    "get_outcome_async",
    "grant_approval",
    "grant_approval_async",
    "intent_fingerprint",
    "record_decision",
    "record_decision_async",
]
