"""The operation state machine (docs/design.md section 5).

``schema.sql`` enforces the same edges with a trigger; a unit test keeps the two in
step, so a change to one without the other fails the suite.
"""

from __future__ import annotations

from enum import StrEnum


class OperationState(StrEnum):
    PREPARED = "prepared"
    IN_FLIGHT = "in_flight"
    COMMITTED = "committed"
    REJECTED = "rejected"
    OUTCOME_UNKNOWN = "outcome_unknown"
    ESCALATED = "escalated"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({OperationState.COMMITTED, OperationState.REJECTED})

_S = OperationState

LEGAL_TRANSITIONS: frozenset[tuple[OperationState, OperationState]] = frozenset(
    {
        (_S.PREPARED, _S.IN_FLIGHT),
        # Never attempted, and never to be without a person: a row that disagrees with
        # what the consumer recomputes, or a message dead-lettered over and over.
        (_S.PREPARED, _S.ESCALATED),
        # Never attempted, and never to be: a denied approval, an operator's cancel.
        (_S.PREPARED, _S.REJECTED),
        (_S.IN_FLIGHT, _S.COMMITTED),
        (_S.IN_FLIGHT, _S.REJECTED),
        (_S.IN_FLIGHT, _S.PREPARED),
        (_S.IN_FLIGHT, _S.OUTCOME_UNKNOWN),
        (_S.OUTCOME_UNKNOWN, _S.COMMITTED),
        (_S.OUTCOME_UNKNOWN, _S.PREPARED),
        (_S.OUTCOME_UNKNOWN, _S.ESCALATED),
        (_S.ESCALATED, _S.COMMITTED),
        (_S.ESCALATED, _S.REJECTED),
        (_S.ESCALATED, _S.PREPARED),
    }
)

# Leaving these states means some process may have talked to the provider on the
# operation's behalf, so the write must prove it still holds the lease it claimed.
FENCED_SOURCES = frozenset({_S.IN_FLIGHT})


def is_legal(source: OperationState, target: OperationState) -> bool:
    return (source, target) in LEGAL_TRANSITIONS


def legal_targets(source: OperationState) -> list[OperationState]:
    return sorted((t for s, t in LEGAL_TRANSITIONS if s == source), key=list(_S).index)


class EventName(StrEnum):
    """Lifecycle event names, as they appear in the event table and the log."""

    PREPARED = "operation.prepared"
    ATTEMPTED = "operation.attempted"
    COMMITTED = "operation.committed"
    REJECTED = "operation.rejected"
    RETRY_SCHEDULED = "operation.retry_scheduled"
    OUTCOME_UNKNOWN = "operation.outcome_unknown"
    RECONCILED = "operation.reconciled"
    RECONCILE_DEFERRED = "operation.reconcile_deferred"
    REQUEUED = "operation.requeued"
    ESCALATED = "operation.escalated"
    RESOLVED = "operation.resolved"
    APPROVAL_GRANTED = "operation.approval_granted"
    APPROVAL_DENIED = "operation.approval_denied"
    APPROVAL_REQUIRED = "operation.approval_required"
    # A delivery for an operation already past ``prepared``: acked, never executed.
    DELIVERY_SUPPRESSED = "operation.delivery_suppressed"
    # The stored row disagrees with what the consumer derives from its input and the
    # contract: never executed, escalated with the check that failed.
    TAMPERED = "operation.tampered"
    # The consumer dead-lettered a message of this operation (its reason in attributes):
    # evidence for the escalation once requeueing it keeps failing.
    DEAD_LETTERED = "operation.dead_lettered"
    # A verified provider callback about this operation was recorded in the inbox (written
    # by outbox_record_callback, never by a component): evidence, moving nothing.
    CALLBACK_RECEIVED = "operation.callback_received"
    # A provider callback disagrees with how the operation stands (a success for a
    # rejected or prepared one, another reference, a failure after success): a person's.
    CONTRADICTED = "operation.contradicted"
    # Its provider could not take its calls or lookups (an open breaker, a Retry-After, a
    # call that got no answer): it waits, spending no attempt and no lookup. Written when
    # the wait begins, not at every recheck.
    WAITING = "operation.waiting"


class Waiting(StrEnum):
    """What a move does to the operation's wait for its provider (``waiting_since``)."""

    START = "start"
    """Begin the wait, or go on with the one already begun."""
    END = "end"
    """The provider answered: the wait is over."""
    KEEP = "keep"
