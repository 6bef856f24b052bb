"""The consumer's log lines, span attributes and metric label values, shared by the
worker, the claims, the effects and the reconciler."""

from __future__ import annotations

import logging
from typing import Any

from consumer.policy import AttemptOutcome, EscalationReason
from outbox import tracing
from outbox.connections import SLOW_VERDICTS
from outbox.contracts import Registry, ToolContract
from outbox.daemon import is_transient_database_error
from outbox.errors import OutboxError
from outbox.fingerprint_key import keyed_fingerprint
from outbox.intent import TAMPER_CHECKS
from outbox.logs import log_fields
from outbox.metrics import ConsumerMetrics, prime
from outbox.models import CallbackOutcome, Operation
from outbox.states import OperationState

# The closed sets of label values the consumer reports (tests/unit/test_metric_labels.py
# keeps the literals in the code inside them). Each is exported at 0 from the start.
DELIVERY_RESULTS = (
    "processed",
    "duplicate",
    "invalid",
    "awaiting_approval",
    "tampered",
    "escalated",
    "unreadable",
    "retry_later",
    "waiting",
    "sent_alone",
)
DEAD_LETTER_REASONS = (
    "oversized",
    "malformed",
    "unknown_operation",
    "envelope_mismatch",
    "unknown_tool",
)
RECONCILIATION_RESULTS = ("committed", "not_found", "still_unknown", "unreachable")
# The policy's reasons, and the two the checks and the stale sweep give themselves.
ESCALATION_REASONS = (
    *(str(reason) for reason in EscalationReason),
    "tampered",
    "undeliverable",
    "unreadable",
)
# What the reconciler does with a provider callback; unmatched ones never reach it.
CALLBACK_OUTCOMES = tuple(
    str(outcome) for outcome in CallbackOutcome if outcome is not CallbackOutcome.UNMATCHED
)
# The stored values the consumer may find unreadable (bounds.load's marker).
UNREADABLE_COLUMNS = ("input",)
# The outcomes whose time from the decision is observed; an escalation is counted by
# outbox_escalations_total and waits for a person, so it is not timed.
TIMED_OUTCOMES = frozenset({OperationState.COMMITTED, OperationState.REJECTED})

# One logger for the whole consumer, under the name every one of its lines has carried
# (logger=consumer.worker) since the reconciler lived in the worker: filters match on it.
logger = logging.getLogger("consumer.worker")


def log(level: int, action: str, text: str, **fields: object) -> None:
    """One line as data (see :func:`outbox.logs.log_fields`)."""
    log_fields(logger, level, action, text, **fields)


def log_refresh_failed(error: Exception, action: str, text: str) -> None:
    """A loop's read failed; it keeps its last values and tries again at the next turn.
    A database that is away or an error of ours is a warning; anything else an error."""
    expected = isinstance(error, OutboxError) or is_transient_database_error(error)
    log(logging.WARNING if expected else logging.ERROR, action, text, error=type(error).__name__)


def log_fenced(operation: Operation, fenced: Exception, **fields: object) -> None:
    """Another process took the operation over (our lease expired): its record wins,
    ours would overwrite evidence; the reconciler has settled it or will."""
    log(
        logging.WARNING,
        "consumer.write_fenced",
        "another process took the operation over; its record wins",
        id=operation.display_id,
        **fields,
        reason=type(fenced).__name__,
    )


def span_attributes(
    operation: Operation, contract: ToolContract[Any], fingerprint_key: str | None
) -> dict[str, tracing.AttributeValue]:
    # Ids, counters and the keyed short fingerprint only: never the tool input.
    attributes: dict[str, tracing.AttributeValue] = {
        "outbox.operation_id": str(operation.id),
        "outbox.tool": contract.name,
        "outbox.tool_version": contract.version,
        "outbox.attempt": operation.attempts,
    }
    if fingerprint_key is not None:
        attributes["outbox.fingerprint"] = keyed_fingerprint(
            fingerprint_key, operation.input_fingerprint
        )
    return attributes


def prime_metrics(metrics: ConsumerMetrics, registry: Registry) -> None:
    """Export every label set this consumer can report at 0, before its first event:
    for the tools it runs, and the results and reasons that do not name a tool."""
    tools = sorted({contract.name for contract in registry})
    looked_up = sorted({contract.name for contract in registry if contract.reconcile})
    prime(metrics.deliveries, DELIVERY_RESULTS)
    prime(metrics.dead_lettered, DEAD_LETTER_REASONS)
    prime(metrics.effect_attempts, tools, [str(outcome) for outcome in AttemptOutcome])
    prime(metrics.effect_duration, tools)
    prime(metrics.decision_to_outcome, tools)
    prime(metrics.reconciliations, looked_up, RECONCILIATION_RESULTS)
    prime(metrics.escalations, tools, ESCALATION_REASONS)
    prime(metrics.tampered, tools, TAMPER_CHECKS)
    prime(metrics.unreadable, tools, UNREADABLE_COLUMNS)
    prime(metrics.callbacks_applied, tools, CALLBACK_OUTCOMES)
    prime(metrics.callbacks_contradicted, tools)
    prime(metrics.slow_transactions, SLOW_VERDICTS)


def observe_outcome(metrics: ConsumerMetrics, moved: Operation) -> None:
    """The time from the decision to the outcome just recorded for ``moved``, if it is
    one that is timed. Both ends are the database's clock: the operation's creation and
    the transaction that moved it."""
    if moved.state in TIMED_OUTCOMES:
        waited = (moved.updated_at - moved.created_at).total_seconds()
        metrics.decision_to_outcome.labels(moved.tool_name).observe(max(0.0, waited))
