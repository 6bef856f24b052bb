"""The chaos run's checker: from the event log, the callbacks inbox and the provider's
ledger, whether the guarantee held. Every decision ends in exactly one confirmed effect,
one definitive rejection or one escalation; no decision has two effects (refunds by
key, emails by reference); no operation is called again after an unknown outcome that
nobody proved absent; every operation's events walk the state machine to the state its
row is in; nothing stays in flight past its lease.

And the runtime must stay useful while it is slow (issue #22) and when providers report
by callback (#25): no decision is escalated as ``undeliverable`` (the harness's
consumers serve every tool and live throughout, so the consumers could always have
handled it); at most 1% of the decisions are escalated for a reason no fault of the run
forces (see :func:`escalation_excused`); no callback contradicts a recorded ending; and
after the last overload ends, goodput is back to 90% of the run's quiet rate within 30 s
(:func:`recovery_seconds`). A provider that is down makes the runtime wait (#44): an
outage shorter than a tool's ``outage_tolerance`` excuses no escalation of it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from uuid import UUID

import psycopg

from outbox import store
from outbox.callback_policy import CallbackStatus
from outbox.models import Callback, OperationEvent
from outbox.sandbox.provider import SandboxProvider
from outbox.states import EventName, OperationState, is_legal
from outbox.store import Store

SETTLED = (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED)
# Never a fault's due: the consumers live throughout and serve every tool.
UNDELIVERABLE = "undeliverable"
# Escalations for a reason no fault of the run forces: at most this share of decisions.
ESCALATION_SHARE_LIMIT = 0.01
# For a tool with no lookup, a provider that keeps an outcome unknown (a dropped
# response whose callback was dropped, forged or stale too; a consumer killed mid-call)
# leaves only a person: the contract says so.
NO_LOOKUP_REASONS = frozenset(
    {"escalate_by_contract", "effect_possible", "retry_budget_exhausted", "no_reconcile"}
)
# With a lookup, a lookup that could not ask the provider (a 503, a 429, no answer)
# costs none of the budget: the operation waits for the provider instead. Only an outage
# longer than the tool's outage_tolerance may end in a person, and then with the reason
# the runtime gives for it; a budget used up then is excused too (it was spent on the
# outage's edges), but never after a shorter outage.
LOOKUP_FAILED_REASONS = frozenset({"reconcile_budget_exhausted"})
PROVIDER_UNAVAILABLE = "provider_unavailable"
# The sandbox's outage answers this before it reads a request: nothing was done, so an
# unknown outcome opened on it (and whatever person that leads to) is the runtime's
# mistake, never the fault's, however the tool is contracted.
OUTAGE_ANSWER = "service_unavailable"
# After the last overload ends, goodput must be back to this share of the quiet rate
# within RECOVERY_BOUND_SECONDS, judged over windows this long.
RECOVERY_SHARE = 0.9
RECOVERY_BOUND_SECONDS = 30.0
GOODPUT_WINDOW_SECONDS = 5.0


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
    committed_without_one_email: int = 0
    emails_without_an_effect_state: int = 0
    escalation_reasons: Counter[str] = field(default_factory=Counter)
    # Escalations a fault of the run forces (escalation_excused); the rest count
    # against ESCALATION_SHARE_LIMIT.
    escalations_excused: int = 0
    # Callbacks (#25): operations a callback contradicted (operation.contradicted, or
    # escalated `contradicted`), unknown outcomes a callback settled or sent back to
    # be tried again, and what the inbox still holds.
    contradictions: int = 0
    settled_by_callback: int = 0
    retried_by_callback: int = 0
    callbacks_unapplied: int = 0
    callbacks_unmatched: int = 0
    # Recovery after the last overload (None: no overload ran, or never recovered;
    # recovery_judged tells which).
    recovery_judged: bool = False
    recovery_s: float | None = None
    quiet_rate: float | None = None
    examples: list[str] = field(default_factory=list)
    # From the end of the last fault to the last settlement; reported, not judged: the
    # drain deadline (the liveness bound) is what fails a run that does not settle.
    settle_s: float | None = None
    last_settled_at: datetime | None = None
    # The longest time the run kept the provider (or its lookups) down, in seconds.
    provider_outage_s: float = 0.0

    @property
    def undeliverable(self) -> int:
        return self.escalation_reasons[UNDELIVERABLE]

    @property
    def escalated_unexcused(self) -> int:
        return self.escalated - self.escalations_excused

    @property
    def escalated_share(self) -> float:
        """The share of decisions escalated for a reason no fault of the run forces."""
        return self.escalated_unexcused / self.decisions if self.decisions else 0.0

    @property
    def recovered(self) -> bool:
        return not self.recovery_judged or (
            self.recovery_s is not None and self.recovery_s <= RECOVERY_BOUND_SECONDS
        )

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
            or self.committed_without_one_email
            or self.emails_without_an_effect_state
            or self.undeliverable
            or self.escalated_share > ESCALATION_SHARE_LIMIT
            or self.contradictions
            or not self.recovered
        )


def escalation_excused(
    reason: str,
    *,
    has_lookup: bool,
    outage: timedelta = timedelta(0),
    outage_tolerance: timedelta | None = None,
    callback_came_first: bool = False,
    unknown_on_outage_answer: bool = False,
) -> bool:
    """Whether a fault of the run forces this escalation: for a tool with no lookup, an
    outcome the provider kept unknown (its contract hands those to a person) and whose
    success callback had not arrived when a person was handed it; ``provider_unavailable``
    (and, for a tool with a lookup, a reconcile budget used up) only when the run's
    longest provider ``outage`` outlasted the tool's ``outage_tolerance`` (None: not
    known, so never). Never ``undeliverable``, ``contradicted``, ``tampered`` or
    ``unreadable``, and never an operation whose outcome went unknown on the outage's
    own answer (``unknown_on_outage_answer``), which says nothing was done."""
    if unknown_on_outage_answer:
        return False
    outlasted = outage_tolerance is not None and outage > outage_tolerance
    if reason == PROVIDER_UNAVAILABLE:
        return outlasted
    if not has_lookup:
        # A verified success callback in the inbox before the escalation should have
        # settled it: a person was handed what the provider had already told us.
        return reason in NO_LOOKUP_REASONS and not callback_came_first
    return outlasted and reason in LOOKUP_FAILED_REASONS


def longest_outage(spans: Sequence[tuple[float, float]]) -> timedelta:
    """The longest time the provider was down without a break, from the run's outage
    windows (start and end, monotonic seconds): windows that overlap or touch are one
    outage, since an operation waits through both."""
    longest = 0.0
    merged: tuple[float, float] | None = None
    for start, end in sorted(spans):
        if merged is not None and start <= merged[1]:
            merged = (merged[0], max(merged[1], end))
        else:
            merged = (start, end)
        longest = max(longest, merged[1] - merged[0])
    return timedelta(seconds=longest)


def check(
    database_url: str,
    decisions: int,
    provider: SandboxProvider,
    *,
    tools_without_lookup: frozenset[str] = frozenset(),
    provider_outage: timedelta = timedelta(0),
    outage_tolerances: Mapping[str, timedelta] | None = None,
) -> Verdict:
    """The verdict on a run: ``tools_without_lookup``, ``provider_outage`` (the longest
    time the run kept the provider, or its lookups, down) and ``outage_tolerances`` (each
    tool's, by name) decide which escalations a fault forced."""
    tolerances = outage_tolerances or {}
    verdict = Verdict(decisions=decisions, provider_outage_s=provider_outage.total_seconds())
    ledger = provider.ledger()
    refunds: dict[str, int] = {
        str(key): int(count) for key, count in ledger["refunds_by_key"].items()
    }
    emails: dict[str, int] = {
        str(reference): int(count) for reference, count in ledger["emails_by_reference"].items()
    }
    verdict.duplicate_effects = sum(
        count - 1 for count in (*refunds.values(), *emails.values()) if count > 1
    )
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        first_success = _first_success_callbacks(
            runner.run(store.list_callbacks(limit=CALLBACK_LIMIT))
        )
        summaries = runner.run(store.list_operation_summaries(limit=decisions * 2 + 100))
        effect_states: set[str] = set()
        for summary in summaries:
            state = summary.state
            has_lookup = summary.tool_name not in tools_without_lookup
            if state is OperationState.COMMITTED:
                verdict.effects += 1
                _check_one_effect(verdict, str(summary.id), has_lookup, refunds, emails)
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
            if state is OperationState.ESCALATED:
                reason, escalated_at = _escalation(events)
                success_at = first_success.get(summary.id)
                verdict.escalations_excused += escalation_excused(
                    reason,
                    has_lookup=has_lookup,
                    outage=provider_outage,
                    outage_tolerance=tolerances.get(summary.tool_name),
                    callback_came_first=(
                        success_at is not None
                        and escalated_at is not None
                        and success_at < escalated_at
                    ),
                    unknown_on_outage_answer=_unknown_on_outage_answer(events),
                )
        pending = runner.run(store.list_callbacks(pending=True, limit=CALLBACK_LIMIT))
        unmatched = runner.run(store.list_callbacks(unmatched=True, limit=CALLBACK_LIMIT))
    verdict.callbacks_unapplied, verdict.callbacks_unmatched = len(pending), len(unmatched)
    # A refund or email may exist for a committed operation, or one escalated to a
    # person with its outcome unsettled; for anything else it is an effect nobody
    # accounts for.
    verdict.refunds_without_an_effect_state = len(set(refunds) - effect_states)
    verdict.emails_without_an_effect_state = len(set(emails) - effect_states)
    verdict.lost = decisions - (verdict.effects + verdict.rejected + verdict.escalated)
    return verdict


# More than any run leaves: the inbox is listed whole.
CALLBACK_LIMIT = 100_000


def _check_one_effect(
    verdict: Verdict,
    operation_id: str,
    has_lookup: bool,
    refunds: dict[str, int],
    emails: dict[str, int],
) -> None:
    """A committed operation has exactly one effect at the provider: a refund under its
    key (the tools with a lookup), or an email under its reference (send_email)."""
    if has_lookup:
        if refunds.get(operation_id, 0) != 1:
            verdict.committed_without_one_refund += 1
            verdict.examples.append(
                f"{operation_id} committed with {refunds.get(operation_id, 0)} refunds"
            )
    elif emails.get(operation_id, 0) != 1:
        verdict.committed_without_one_email += 1
        verdict.examples.append(
            f"{operation_id} committed with {emails.get(operation_id, 0)} emails"
        )


def _escalation(events: list[OperationEvent]) -> tuple[str, datetime | None]:
    """The reason and time of an operation's last escalation."""
    escalations = [
        event
        for event in events
        if event.name == EventName.ESCALATED
        or (event.attributes.get("to") == str(OperationState.ESCALATED))
    ]
    if not escalations:
        return "unknown", None
    last = escalations[-1]
    return str(last.attributes.get("reason", "unknown")), last.created_at


def _unknown_on_outage_answer(events: list[OperationEvent]) -> bool:
    """Whether any of the operation's moves to ``outcome_unknown`` was for the outage's
    own answer."""
    return any(
        event.attributes.get("to") == str(OperationState.OUTCOME_UNKNOWN)
        and event.attributes.get("reason") == OUTAGE_ANSWER
        for event in events
    )


def _first_success_callbacks(callbacks: list[Callback]) -> dict[UUID, datetime]:
    """When each operation's first verified success callback reached the inbox."""
    first: dict[UUID, datetime] = {}
    for callback in callbacks:
        if callback.operation_id is None or callback.status != CallbackStatus.COMMITTED:
            continue
        known = first.get(callback.operation_id)
        if known is None or callback.received_at < known:
            first[callback.operation_id] = callback.received_at
    return first


def check_sequence(
    verdict: Verdict, operation_id: str, final: OperationState, events: list[OperationEvent]
) -> None:
    """Walk one operation's events: every transition legal and from the state the walk
    is in, the walk ending in the operation's state, and no attempt after an unknown
    outcome unless a lookup proved the effect absent or the outcome was a definite
    failure scheduled for retry."""
    state: OperationState | None = None
    unproven_unknown = False
    contradicted = False
    for event in events:
        name = event.name
        if name == EventName.OUTCOME_UNKNOWN:
            verdict.outcome_unknown_opened += 1
        elif name == EventName.RECONCILED:
            verdict.reconciled += 1
            if event.attributes.get("method") == "callback":
                if event.attributes.get("result") == "committed":
                    verdict.settled_by_callback += 1
                elif event.attributes.get("result") == "not_found":
                    verdict.retried_by_callback += 1
        elif name == EventName.DELIVERY_SUPPRESSED:
            verdict.duplicate_deliveries_suppressed += 1
        escalates = name == EventName.ESCALATED or (
            event.attributes.get("to") == str(OperationState.ESCALATED)
        )
        reason = str(event.attributes.get("reason", "unknown"))
        if escalates:
            verdict.escalation_reasons[reason] += 1
        if not contradicted and (
            name == EventName.CONTRADICTED or (escalates and reason == "contradicted")
        ):
            # Once an operation, however many events say so (an illegal walk stops early).
            contradicted = True
            verdict.contradictions += 1
            verdict.examples.append(f"{operation_id}: a callback contradicted its recorded ending")
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


# --- recovery after an overload -------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The run's counts at one moment (monotonic seconds): decisions recorded, goodput
    (committed or rejected: an answer the agent can use), settled (goodput and
    escalations) and waiting by design (an unknown outcome waiting for its callback or
    its next lookup, which no speed of the runtime would settle sooner)."""

    at: float
    recorded: int
    goodput: int
    settled: int
    waiting: int = 0

    @property
    def backlog(self) -> int:
        """Decisions the runtime could be working on: neither settled nor waiting."""
        return self.recorded - self.settled - self.waiting


def quiet_rate(samples: Sequence[Sample], until: float, *, least: int = 5) -> float | None:
    """Goodput per second before ``until`` (the first fault), from the first answer on:
    the daemons' start-up is not the system's speed. None if the quiet phase saw fewer
    than ``least`` answers or under a second of them."""
    quiet = [s for s in samples if s.at <= until]
    answered = [s for s in quiet if s.goodput > 0]
    if not answered:
        return None
    first, last = answered[0], quiet[-1]
    span = last.at - first.at
    if last.goodput < least or span < 1.0:
        return None
    # The first answering sample's goodput accrued before it: count from there.
    return (last.goodput - first.goodput) / span


def recovery_seconds(
    samples: Sequence[Sample],
    ended_at: float,
    rate: float,
    quiet_backlog: int,
    *,
    window: float = GOODPUT_WINDOW_SECONDS,
    share: float = RECOVERY_SHARE,
) -> float | None:
    """How long after ``ended_at`` (the last overload's end) the system is back: the
    start of the first window of ``window`` seconds, starting then or later, whose
    goodput reaches ``share`` of what it could have answered, or the first moment the
    backlog is no larger than it was when quiet (nothing waits: no rate to reach).

    What a window could have answered is ``rate`` (the quiet goodput), but never more
    than what there was to answer: the decisions recorded during it and the backlog at its
    start beyond the quiet one (what the quiet phase also had in hand is the pipeline,
    not work left over). The quiet rate is measured while the start-up backlog drains, so it can
    exceed the rate decisions are offered at; a runtime that keeps up with the stream
    after the overload has recovered even though it can no longer reach it.

    None if neither happens within the samples. When the samples stop before
    ``ended_at`` (the run's work was done and sampling over before the overload's end,
    which then came with the daemons' stop), the last one stands for that moment:
    nothing was recorded after it."""
    after = [s for s in samples if s.at >= ended_at]
    if not after and samples:
        after = [replace(samples[-1], at=ended_at)]
    for index, start in enumerate(after):
        if start.backlog <= quiet_backlog:
            return start.at - ended_at
        for end in after[index + 1 :]:
            span = end.at - start.at
            if span >= window:
                excess = start.backlog - quiet_backlog
                answerable = (excess + end.recorded - start.recorded) / span
                if (end.goodput - start.goodput) / span >= share * min(rate, answerable):
                    return start.at - ended_at
                break
    return None
