"""The public API, pinned before the house moves (#27): ``outbox.__all__`` with each
function's signature, and ``outbox.store.__all__``, the named operations every
component calls, and ``outbox.callbacks.__all__``, what a web app receiving callbacks
imports. A change here is deliberate: update the pin in the same commit and say
why (temporalio's tests/test_client_exports.py keeps the same watch)."""

from __future__ import annotations

import inspect
from typing import Any

import outbox
import outbox.callbacks
import outbox.store

PUBLIC = {
    "Approval": "class",
    "ApprovalCheck": "class",
    "ApprovalPolicy": "class",
    "ApprovalStatus": "class",
    "CallbackPolicy": "class",
    "CallbackProvider": "class",
    "CallbackReport": "class",
    "CallbackStatus": "class",
    "ConfigurationError": "class",
    "ContractRefused": "class",
    "DatabaseError": "class",
    "DecisionBlocked": "class",
    "DecisionConflict": "class",
    "DefinitiveRejection": "class",
    "EffectResult": "class",
    "EventName": "class",
    "ExecutionContext": "class",
    "Found": "class",
    "IllegalTransition": "class",
    "InProgress": "class",
    "InputRejected": "class",
    "LeaseLost": "class",
    "NotFound": "class",
    "NotSent": "class",
    "OnUnknown": "class",
    "Operation": "class",
    "OperationEvent": "class",
    "OperationNotFound": "class",
    "OperationState": "class",
    "OutboxError": "class",
    "Outcome": "class",
    "OutcomeStatus": "class",
    "OutcomeUnknown": "class",
    "OutcomeWatcher": "class",
    "ProviderLimits": "class",
    "ProviderUnavailable": "class",
    "RateLimited": "class",
    "RecordedDecision": "class",
    "Registry": "class",
    "RetryPolicy": "class",
    "SchemaMissing": "class",
    "Scheme": "class",
    "Settings": "class",
    "SideEffect": "class",
    "StillUnknown": "class",
    "ToolContract": "class",
    "ToolNotRegistered": "class",
    "TransientDatabaseError": "class",
    "Unreachable": "class",
    "agent_completed": "(run_id: 'str', outcome: 'str') -> 'str'",
    "await_outcome": (
        "(source: 'AsyncEngine | str | OutcomeWatcher', "
        "operation: 'UUID | RecordedDecision | Operation | Outcome', *, "
        "timeout: 'timedelta | float | None' = datetime.timedelta(seconds=30), "
        "until: 'Until' = 'attention') -> 'Outcome'"
    ),
    "await_outcome_sync": (
        "(source: 'SAEngine | str', "
        "operation: 'UUID | RecordedDecision | Operation | Outcome', *, "
        "timeout: 'timedelta | float | None' = datetime.timedelta(seconds=30), "
        "until: 'Until' = 'attention', "
        "poll_interval: 'float' = 1.0) -> 'Outcome'"
    ),
    "check_approval": "(connection: 'SyncConnection', operation_id: 'UUID') -> 'ApprovalCheck'",
    "check_approval_async": (
        "(connection: 'AsyncConnection', operation_id: 'UUID') -> 'ApprovalCheck'"
    ),
    "close_shared_watchers": "() -> 'None'",
    "get_outcome": "(connection: 'SyncConnection', operation_id: 'UUID') -> 'Outcome'",
    "get_outcome_async": "(connection: 'AsyncConnection', operation_id: 'UUID') -> 'Outcome'",
    "grant_approval": (
        "(connection: 'SyncConnection', operation_id: 'UUID', *, "
        "approved_by: 'str', ttl: 'timedelta', "
        "intent_hash: 'str | None' = None) -> 'Approval'"
    ),
    "grant_approval_async": (
        "(connection: 'AsyncConnection', operation_id: 'UUID', *, "
        "approved_by: 'str', ttl: 'timedelta', "
        "intent_hash: 'str | None' = None) -> 'Approval'"
    ),
    "intent_fingerprint": "(tool_name: 'str', tool_version: 'int', input_json: 'Any') -> 'str'",
    "record_decision": (
        "(connection: 'SyncConnection', registry: 'Registry', tool: 'str', "
        "tool_input: 'Mapping[str, Any] | BaseModel', *, run_id: 'str', "
        "decision_key: 'str | None' = None, tool_version: 'int | None' = None, "
        "traceparent: 'str | None' = None, own_transaction: 'bool' = False, "
        "lock_timeout: 'float' = 5.0) -> 'RecordedDecision'"
    ),
    "record_decision_async": (
        "(connection: 'AsyncConnection', registry: 'Registry', tool: 'str', "
        "tool_input: 'Mapping[str, Any] | BaseModel', *, run_id: 'str', "
        "decision_key: 'str | None' = None, tool_version: 'int | None' = None, "
        "traceparent: 'str | None' = None, own_transaction: 'bool' = False, "
        "lock_timeout: 'float' = 5.0) -> 'RecordedDecision'"
    ),
}
STORE = [
    "MAX_EVENTS_PAGE",
    "NOTIFY_CHANNEL",
    "RESOLUTION_EVIDENCE_LIMIT",
    "ArchivedOperation",
    "ArchivedSummary",
    "AsyncConnection",
    "AsyncStore",
    "Backlog",
    "BrokenLink",
    "CallbackReceipt",
    "ChainReport",
    "CheckpointChainReport",
    "CheckpointLink",
    "ClaimedDelivery",
    "ClaimedRow",
    "ConfirmedEffect",
    "ConsoleLogin",
    "Cursor",
    "DayCheckpoint",
    "DayDigest",
    "DayRecord",
    "DeadLetterDiscard",
    "DeliveryClaim",
    "DiscardRecord",
    "DropTiming",
    "EscalationFilter",
    "EscalationSelection",
    "EventsPage",
    "ExecutionBacklog",
    "FailedPublish",
    "HealthChange",
    "HistoryDay",
    "LockHolder",
    "MatchedEscalation",
    "NewDecision",
    "OperationFilter",
    "OperationPage",
    "OperationStats",
    "OperationSummary",
    "PendingApproval",
    "Plan",
    "PreparedWait",
    "PreparedWaits",
    "ProviderRow",
    "Row",
    "Step",
    "Store",
    "SyncConnection",
    "Waiting",
    "all_providers",
    "append_event",
    "approver_of",
    "archive_batch",
    "archived_events_page",
    "archived_facts",
    "archived_ids_with_prefix",
    "archived_operation",
    "archived_outcomes",
    "archived_states",
    "archived_summaries",
    "backend_activity",
    "book_provider_call",
    "callbacks_of",
    "chain_agent_reports",
    "check_approval",
    "checkpoint_day",
    "checkpoint_of_export",
    "claim",
    "claim_callback_batch",
    "claim_deliveries",
    "claim_many",
    "claim_outbox_batch",
    "claim_reconciliation_batch",
    "commit_many",
    "console_login",
    "day_digest",
    "day_records",
    "decide_approval",
    "defer_reconciliation",
    "delete_published_outbox_rows",
    "drop_partition",
    "escalate_undeliverable",
    "escalations_matching",
    "events",
    "events_page",
    "execution_gauges",
    "export_lines",
    "find_operation",
    "find_operations",
    "fingerprint_key",
    "get_operation",
    "give_back_provider_call",
    "history_days",
    "last_dead_letters",
    "last_escalations",
    "lease_for_reconciliation",
    "list_callbacks",
    "list_discarded_dead_letters",
    "list_operation_summaries",
    "listen_operation_changes",
    "listen_outbox_pending",
    "lock_blockers",
    "lock_operation",
    "mark_callback",
    "mark_outbox_failed",
    "mark_outbox_published",
    "nominate_probe",
    "operation_approvals",
    "operation_outcomes",
    "operation_outcomes_changed",
    "operation_stats",
    "operations_by_state",
    "operations_page",
    "operations_with_prefix",
    "outbox_backlog",
    "outbox_rows",
    "pending_approvals",
    "prepared_waits",
    "provider_events",
    "provider_health",
    "provider_still_unavailable",
    "recent_checkpoints",
    "record_callback",
    "record_decision",
    "record_discarded_dead_letters",
    "record_provider_answer",
    "record_provider_failure",
    "reject_denied_operations",
    "report_agent_completed",
    "requeue_stale_prepared",
    "resolve_operation",
    "rotate_keys",
    "take_provider_call",
    "take_provider_probe",
    "transition",
    "verify_chain",
    "verify_checkpoints",
    "wait_prepared",
    "wait_unknown",
    "waiting_operations_by_tool",
]


# What a web app of the user's imports to receive callbacks itself (docs/callbacks.md):
# outbox.callbacks, a package since #47 (verify, inbox, server, cli).
CALLBACKS = {
    "DEFAULT_MAX_BODY": "int",
    "REFUSED_STATUS": "dict",
    "CallbackReceiver": "class",
    "Endpoint": "class",
    "Received": "class",
    "digest": "(body: 'bytes') -> 'str'",
    "record_callback": "(connection: 'SyncConnection', receiver: 'CallbackReceiver', "
    "provider: 'str', body: 'bytes', headers: 'Mapping[str, str]') -> 'Received'",
    "record_callback_async": "(connection: 'AsyncConnection', receiver: 'CallbackReceiver', "
    "provider: 'str', body: 'bytes', headers: 'Mapping[str, str]') -> 'Received'",
}


def shape(obj: Any) -> str:
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return str(inspect.signature(obj))
    return type(obj).__name__


def test_the_public_names_and_signatures_are_pinned() -> None:
    assert {name: shape(getattr(outbox, name)) for name in outbox.__all__} == PUBLIC


def test_the_callbacks_entry_points_are_pinned() -> None:
    exported = outbox.callbacks.__all__
    assert {name: shape(getattr(outbox.callbacks, name)) for name in exported} == CALLBACKS


def test_the_store_operations_are_pinned() -> None:
    assert outbox.store.__all__ == STORE
    assert all(hasattr(outbox.store, name) for name in STORE)


def test_every_public_name_is_exported_once() -> None:
    assert len(set(outbox.__all__)) == len(outbox.__all__)
    assert len(set(STORE)) == len(STORE)
