"""The chaos run's checker: from the event log and the provider's ledger, whether the
guarantee held. Every decision ends in exactly one confirmed effect, one definitive
rejection or one escalation; no decision has two effects; no operation is called again
after an unknown outcome that nobody proved absent; every operation's events walk the
state machine to the state its row is in; nothing stays in flight past its lease."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from outbox import store
from outbox.models import OperationEvent
from outbox.sandbox.provider import SandboxProvider
from outbox.states import EventName, OperationState, is_legal
from outbox.store import Store

SETTLED = (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED)


@dataclass
class Verdict:
    decisions: int
    effects: int = 0
    rejected: int = 0
    escalated: int = 0
    lost: int = 0
    duplicate_effects: int = 0
    duplicate_deliveries_suppressed: int = 0
    committed_without_one_refund: int = 0
    refunds_without_an_effect_state: int = 0
    outcome_unknown_opened: int = 0
    reconciled: int = 0
    blind_retries: int = 0
    illegal_sequences: int = 0
    in_flight_past_lease: int = 0
    escalation_reasons: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    # From the end of the last fault to the last settlement; reported, not judged: the
    # drain deadline (the liveness bound) is what fails a run that does not settle.
    settle_s: float | None = None
    last_settled_at: datetime | None = None

    @property
    def held(self) -> bool:
        return not (
            self.lost
            or self.duplicate_effects
            or self.blind_retries
            or self.illegal_sequences
            or self.in_flight_past_lease
            or self.committed_without_one_refund
            or self.refunds_without_an_effect_state
        )


def check(database_url: str, decisions: int, provider: SandboxProvider) -> Verdict:
    verdict = Verdict(decisions=decisions)
    refunds: dict[str, int] = {
        str(key): int(count) for key, count in provider.ledger()["refunds_by_key"].items()
    }
    verdict.duplicate_effects = sum(count - 1 for count in refunds.values() if count > 1)
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        summaries = runner.run(store.list_operation_summaries(limit=decisions * 2 + 100))
        effect_states: set[str] = set()
        for summary in summaries:
            state = summary.state
            if state is OperationState.COMMITTED:
                verdict.effects += 1
                if refunds.get(str(summary.id), 0) != 1:
                    verdict.committed_without_one_refund += 1
                    verdict.examples.append(
                        f"{summary.id} committed with {refunds.get(str(summary.id), 0)} refunds"
                    )
            elif state is OperationState.REJECTED:
                verdict.rejected += 1
            elif state is OperationState.ESCALATED:
                verdict.escalated += 1
            elif state is OperationState.IN_FLIGHT:
                operation = runner.run(store.get_operation(summary.id))
                expires = operation.lease_expires_at
                if expires is not None and expires < datetime.now(UTC):
                    verdict.in_flight_past_lease += 1
                    verdict.examples.append(f"{summary.id} in flight past its lease")
            if state in (OperationState.COMMITTED, OperationState.ESCALATED):
                effect_states.add(str(summary.id))
            events = runner.run(store.events(summary.id))
            check_sequence(verdict, str(summary.id), state, events)
    # A refund may exist for a committed operation, or one escalated to a person with
    # its outcome unsettled; for anything else it is an effect nobody accounts for.
    verdict.refunds_without_an_effect_state = len(set(refunds) - effect_states)
    verdict.lost = decisions - (verdict.effects + verdict.rejected + verdict.escalated)
    return verdict


def check_sequence(
    verdict: Verdict, operation_id: str, final: OperationState, events: list[OperationEvent]
) -> None:
    """Walk one operation's events: every transition legal and from the state the walk
    is in, the walk ending in the operation's state, and no attempt after an unknown
    outcome unless a lookup proved the effect absent or the outcome was a definite
    failure scheduled for retry."""
    state: OperationState | None = None
    unproven_unknown = False
    for event in events:
        name = event.name
        if name == EventName.OUTCOME_UNKNOWN:
            verdict.outcome_unknown_opened += 1
        elif name == EventName.RECONCILED:
            verdict.reconciled += 1
        elif name == EventName.DELIVERY_SUPPRESSED:
            verdict.duplicate_deliveries_suppressed += 1
        elif name == EventName.ESCALATED:
            verdict.escalation_reasons[str(event.attributes.get("reason", "unknown"))] += 1
        if name == EventName.PREPARED:
            source, target = None, OperationState.PREPARED
        elif name == EventName.ATTEMPTED:
            source, target = OperationState.PREPARED, OperationState.IN_FLIGHT
            if unproven_unknown:
                verdict.blind_retries += 1
                verdict.examples.append(f"{operation_id} attempted again after an unknown outcome")
        elif "from" in event.attributes and "to" in event.attributes:
            source = OperationState(str(event.attributes["from"]))
            target = OperationState(str(event.attributes["to"]))
        else:
            continue  # an event that changes no state (deferred lookups, approvals)
        if target in SETTLED and (
            verdict.last_settled_at is None or event.created_at > verdict.last_settled_at
        ):
            verdict.last_settled_at = event.created_at
        if source != state or (source is not None and not is_legal(source, target)):
            verdict.illegal_sequences += 1
            verdict.examples.append(f"{operation_id}: {name} {source}->{target} while {state}")
            return
        if target is OperationState.OUTCOME_UNKNOWN:
            unproven_unknown = True
        elif target is OperationState.PREPARED and (
            (name == EventName.RECONCILED and event.attributes.get("result") == "not_found")
            or name == EventName.RETRY_SCHEDULED
        ):
            unproven_unknown = False
        state = target
    if state is not final:
        verdict.illegal_sequences += 1
        verdict.examples.append(f"{operation_id}: events end in {state}, the row is {final}")
