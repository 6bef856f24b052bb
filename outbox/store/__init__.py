"""The store: the only code that executes SQL, cut by who runs it.

- :mod:`~outbox.store.runner`: steps, plans, and the runners that execute a plan on
  any supported connection, inside the caller's transaction;
- :mod:`~outbox.store.operations`: recording decisions, reading, claiming, committing
  and moving operations, shared by every component;
- :mod:`~outbox.store.approvals`: granting, denying and checking approvals;
- :mod:`~outbox.store.callbacks`: the provider callbacks inbox;
- :mod:`~outbox.store.awaiting`: the agent's reads while it awaits outcomes;
- :mod:`~outbox.store.dispatch`: the dispatcher's outbox rows and gauges;
- :mod:`~outbox.store.reconcile`: the reconciler's leases, lookups and endings;
- :mod:`~outbox.store.providers`: the provider breaker, its events, and the operations
  that wait for a provider;
- :mod:`~outbox.store.gauges`: what waits to be executed, for the consumer's gauges,
  and the backends' activity for the liveness probe;
- :mod:`~outbox.store.evidence`: checking the lifecycle events' hash chain;
- :mod:`~outbox.store.history`: moving settled operations into history, exporting
  and dropping its days, and reading an archived operation;
- :mod:`~outbox.store.operator`: the operator's listings, statistics and resolutions;
- :mod:`~outbox.store.console`: the operator console's keyset pages and approval history.

Every statement they run is named in ``outbox/sql/queries.sql``, as are the two that
only the chaos harness runs (``harness/diagnostics.py``, which the wheel leaves out).
The DDL and database administration live in :mod:`outbox.schema`, which callers import
directly: it runs its statements through :mod:`outbox.store.runner`, so a re-export here
would make the two packages import each other.

Callers use the package as one namespace (``from outbox import store``;
``store.transition(...)``), so everything public is re-exported here.
"""

from __future__ import annotations

from outbox.states import Waiting
from outbox.store.approvals import check_approval, decide_approval
from outbox.store.awaiting import (
    listen_operation_changes,
    operation_outcomes,
    operation_outcomes_changed,
)
from outbox.store.callbacks import (
    CallbackReceipt,
    callbacks_of,
    claim_callback_batch,
    list_callbacks,
    lock_operation,
    mark_callback,
    record_callback,
)
from outbox.store.console import (
    MAX_EVENTS_PAGE,
    ConsoleLogin,
    Cursor,
    EventsPage,
    OperationFilter,
    OperationPage,
    PreparedWait,
    PreparedWaits,
    console_login,
    events_page,
    operation_approvals,
    operations_page,
    prepared_waits,
)
from outbox.store.dispatch import (
    NOTIFY_CHANNEL,
    Backlog,
    ClaimedRow,
    FailedPublish,
    claim_outbox_batch,
    delete_published_outbox_rows,
    listen_outbox_pending,
    mark_outbox_failed,
    mark_outbox_published,
    operations_by_state,
    outbox_backlog,
)
from outbox.store.evidence import BrokenLink, ChainReport, verify_chain
from outbox.store.gauges import (
    ExecutionBacklog,
    LockHolder,
    backend_activity,
    execution_gauges,
    lock_blockers,
)
from outbox.store.history import (
    DayCheckpoint,
    DropTiming,
    HistoryDay,
    archive_batch,
    archived_operation,
    checkpoint_day,
    drop_partition,
    export_lines,
    history_days,
    recent_checkpoints,
    rotate_keys,
)
from outbox.store.operations import (
    ClaimedDelivery,
    ConfirmedEffect,
    DeliveryClaim,
    NewDecision,
    append_event,
    chain_agent_reports,
    claim,
    claim_deliveries,
    claim_many,
    commit_many,
    events,
    find_operation,
    find_operations,
    fingerprint_key,
    get_operation,
    outbox_rows,
    record_decision,
    report_agent_completed,
    transition,
)
from outbox.store.operator import (
    RESOLUTION_EVIDENCE_LIMIT,
    DeadLetterDiscard,
    DiscardRecord,
    EscalationFilter,
    EscalationSelection,
    MatchedEscalation,
    OperationStats,
    OperationSummary,
    PendingApproval,
    approver_of,
    escalations_matching,
    last_dead_letters,
    last_escalations,
    list_discarded_dead_letters,
    list_operation_summaries,
    operation_stats,
    operations_with_prefix,
    pending_approvals,
    record_discarded_dead_letters,
    resolve_operation,
)
from outbox.store.providers import (
    HealthChange,
    ProviderRow,
    all_providers,
    book_provider_call,
    give_back_provider_call,
    nominate_probe,
    provider_events,
    provider_health,
    provider_still_unavailable,
    record_provider_answer,
    record_provider_failure,
    take_provider_call,
    take_provider_probe,
    wait_prepared,
    wait_unknown,
    waiting_operations_by_tool,
)
from outbox.store.reconcile import (
    claim_reconciliation_batch,
    defer_reconciliation,
    escalate_undeliverable,
    lease_for_reconciliation,
    reject_denied_operations,
    requeue_stale_prepared,
)
from outbox.store.runner import (
    AsyncConnection,
    AsyncStore,
    Plan,
    Row,
    Step,
    Store,
    SyncConnection,
)

__all__ = [
    "MAX_EVENTS_PAGE",
    "NOTIFY_CHANNEL",
    "RESOLUTION_EVIDENCE_LIMIT",
    "AsyncConnection",
    "AsyncStore",
    "Backlog",
    "BrokenLink",
    "CallbackReceipt",
    "ChainReport",
    "ClaimedDelivery",
    "ClaimedRow",
    "ConfirmedEffect",
    "ConsoleLogin",
    "Cursor",
    "DayCheckpoint",
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
    "archived_operation",
    "backend_activity",
    "book_provider_call",
    "callbacks_of",
    "chain_agent_reports",
    "check_approval",
    "checkpoint_day",
    "claim",
    "claim_callback_batch",
    "claim_deliveries",
    "claim_many",
    "claim_outbox_batch",
    "claim_reconciliation_batch",
    "commit_many",
    "console_login",
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
    "wait_prepared",
    "wait_unknown",
    "waiting_operations_by_tool",
]
