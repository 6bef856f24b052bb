"""What the role tests share: the groups, the tables, the queries each component runs,
logins per group and seeded operations to act on.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.errors

from outbox import Operation, OperationState, Registry, record_decision
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.store import Plan, Store

from support.db_helpers import execute_admin

S = OperationState


LEASE = timedelta(seconds=60)


AGENT, DISPATCHER, CONSUMER, OPERATOR, CALLBACKS = outbox_schema.ROLES


TABLES = (
    "operation_status",
    "operations",
    "outbox",
    "operation_events",
    "approvals",
    "outbox_schema_version",
    "outbox_schema_applied",
    "outbox_deployment",
    "operation_event_heads",
    "callbacks",
    "provider_health",
    "provider_events",
    "provider_calls",
    "discarded_dead_letters",
    "history",
    "history_checkpoints",
    "history_keys_0",
    "history_keys_1",
    "history_key_generations",
    "history_checkpoint_head",
)


# Not group roles: `outbox migrate` runs as the schema's owner, and the chaos harness
# (harness/diagnostics.py, not in the wheel) as an administrator of its own database;
# roles.sql grants them nothing.
MIGRATE, CHAOS = "outbox migrate", "python -m harness.chaos"

# `outbox history` as an operator (archive, export, status; `ops show` and `ops verify` of
# an archived operation), and `outbox history drop`, which only the tables' owner can run
# (a detach needs ownership of history; roles.sql grants no group that).
HISTORY, HISTORY_DROP = "outbox history", "outbox history drop"

# The agent's await_outcome (and get_outcome) of an operation that moved to history, as
# outbox_agent: the archived decision keys, and history's ids and keys alone.
AWAIT_ARCHIVED = "await_outcome of an archived operation"


# `outbox console` runs as outbox_operator too: its reads besides those of `outbox ops`.
# tests/integration/console/ runs every page and action as a login that holds
# only that role, which proves the grants cover them.
CONSOLE = "outbox console"


# Which statements of queries.sql each component runs. A query nobody claims fails
# test_every_query_belongs_to_a_component: whoever adds one decides who needs it,
# and the test of that component below proves the grants cover it.
COMPONENT_QUERIES: dict[str, set[str]] = {
    AGENT: {
        "insert_decision",
        "get_operation_by_decision_key",
        "fingerprint_key",
        "listen_operation_changes",
        "operation_outcomes",
        "operation_outcomes_changed",
        "latest_approval",
        # agent.completed, reported without a lock on any chain head.
        "report_agent_completed",
    },
    DISPATCHER: {
        "listen_outbox_pending",
        "claim_outbox_batch",
        "mark_outbox_published",
        "mark_outbox_failed",
        "outbox_backlog",
        "operations_analyzed_rows",
        "count_operations_by_state",
        "operations_by_state",
        "delete_published_outbox_rows",
        # The liveness probe of a transaction past its soft deadline, and whom one that
        # waits for a lock waits for.
        "backend_activity",
        "lock_blockers",
    },
    CONSUMER: {
        "get_operation",
        "latest_approval",
        "insert_event",
        "get_operations",
        "claim_deliveries",
        "claim_operations",
        "commit_operations",
        "transition_operation",
        "requeue_stale_prepared",
        "escalate_undeliverable",
        "reject_denied_operations",
        "fingerprint_key",
        "claim_reconciliation_batch",
        "lease_for_reconciliation",
        "defer_reconciliation",
        "schema_is_current",
        "execution_gauges",
        "backend_activity",
        "lock_blockers",
        # Applying provider callbacks (consumer/callbacks.py).
        "claim_callback_batch",
        "operation_callbacks",
        "apply_callback",
        "lock_operation",
        # The provider breaker (consumer/providers.py) and the operations that wait.
        "ensure_provider_health",
        "lock_provider_health",
        "write_provider_health",
        "insert_provider_event",
        "provider_health_rows",
        "waiting_operations_by_tool",
        "count_waited_operations",
        "release_waiting_operations",
        "wait_prepared_for_provider",
        "wait_unknown_for_provider",
        "book_provider_call",
        "nominate_probe",
        "share_provider_health",
        "take_provider_call",
        "give_back_provider_call",
        # The reconciler chains the agents' reports.
        "chain_agent_reports",
    },
    OPERATOR: {
        "list_operation_summaries",
        # `ops list --tool T`: the same list read a state group at a time (issue #48).
        "list_tool_operation_summaries",
        # The reason and time of each escalated operation's latest escalation, and each
        # dead letter's operation's latest dead-lettering (`outbox dlq list`).
        "last_reasons",
        # `ops resolve` over a filter and the console's batch preview select by it.
        "escalations_matching",
        # `ops show op_74ca7733`: the short id the console prints, in the hot tables and
        # in history (a prefix both hold is ambiguous).
        "operation_ids_in_range",
        "history_ids_in_range",
        "get_operation",
        # `ops show` and the console read a timeline a page at a time, never whole.
        "list_events_page",
        "list_outbox_rows",
        "latest_approval",
        "transition_operation",
        "list_approval_candidates",
        "insert_approval",
        # `outbox stats` and the overview: counted while the table is small, the
        # settled states estimated from a sample past EXACT_SETTLED_COUNT_BELOW.
        "operations_analyzed_rows",
        "count_operations_by_tool_and_state",
        "estimate_operations_by_tool_and_state",
        "transaction_without_jit",
        "outbox_backlog",
        "verify_event_chains",
        # Short fingerprints are the keyed ones, and who decided an approval is shown.
        "fingerprint_key",
        "console_operation_approvals",
        # `ops show` lists an operation's callbacks; `outbox callbacks list` the inbox.
        "operation_callbacks",
        "list_callbacks",
        # `outbox providers`: the breakers, their outages and who waits.
        "all_provider_health",
        "list_provider_events",
        "waiting_operations_by_tool",
        # `outbox dlq discard` records each dead letter first; `outbox dlq discarded`.
        "record_discarded_dead_letter",
        "list_discarded_dead_letters",
    },
    # `outbox callbacks` and record_callback(): one write path, and the catalog at start.
    CALLBACKS: {"record_callback", "schema_is_current"},
    HISTORY: {
        "history_archive_batch",
        "history_checkpoint_day",
        "history_export_page",
        "history_days",
        # `history status` of a day whose drop was recorded and which is still attached.
        "history_day_rows",
        "history_recent_checkpoints",
        "history_operation",
        "history_day_digest",
        "history_checkpoint_of_export",
        "verify_checkpoint_chain",
        # `history verify --days`: what the checkpoints record of each day, and a day's
        # digest as versions before 16 computed it (an export of a day past 100,000).
        "history_day_records",
        "history_day_flat_digest",
        # `ops show` and the console's page of an archived operation, `ops list --archived`.
        "history_operation_facts",
        "history_events_page",
        "history_summaries",
        # A dead letter whose operation moved: `outbox dlq list`, the console's page.
        "history_states",
    },
    AWAIT_ARCHIVED: {"archived_outcomes"},
    HISTORY_DROP: {
        "history_days",
        "history_checkpoint_day",
        "history_day_digest",
        "history_export_page",
        "history_rotate_keys",
    },
    MIGRATE: {
        "database_exists",
        "take_migration_lock",
        "has_schema_version_table",
        "schema_version",
        "current_schema",
        "schema_creators",
        "has_schema_digest_table",
        "applied_schema_digest",
        "record_schema_digest",
        "set_lock_timeout",
        "schema_lock_holders",
    },
    # The checker judges each operation's whole timeline (harness/checker.py).
    CHAOS: {"terminate_backends", "session_snapshot", "list_events"},
    CONSOLE: {
        "console_login",
        "console_operations_page",
        "console_tool_operations_page",
        "console_operation_approvals",
        # The overview's count of what the prepared operations wait for.
        "console_prepared_waits",
    },
}


def run(url: str, plan: Plan[Any]) -> Any:
    """One plan in its own committed transaction, connected as ``url``'s user."""
    with psycopg.connect(url) as connection:
        return Store(connection).run(plan)


def snapshot(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every outbox table, as a superuser sees them."""
    return {
        table: execute_admin(database_url, f"SELECT * FROM {table} ORDER BY 1") for table in TABLES
    }


def new_operation(url: str, registry: Registry, amount_cents: int = 100) -> Operation:
    with psycopg.connect(url) as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents},
            run_id="run",
        )
    return recorded.operation


def advance(url: str, operation: Operation, *targets: OperationState) -> Operation:
    """Move an operation along legal edges, as ``url``'s user, one commit per edge."""
    for target in targets:
        if target is S.IN_FLIGHT:
            claimed = run(url, outbox_store.claim(operation.id, owner="w", lease=LEASE))
            assert claimed is not None
            operation = claimed
        else:
            operation = run(
                url,
                outbox_store.transition(
                    operation.id,
                    source=operation.state,
                    target=target,
                    lease_token=operation.lease_token,
                    error_class="lookups_unavailable" if target is S.ESCALATED else None,
                ),
            )
    return operation


def escalated(url: str, registry: Registry) -> Operation:
    return advance(url, new_operation(url, registry), S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED)
