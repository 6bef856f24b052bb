"""The consumer's policy explored: workers, a reconciler and a provider, interleaved.

The real decisions of :mod:`consumer.policy` run against a small model of the rest:
operations with leases and fencing tokens, guarded as the store guards them; workers that
claim, call and record; a reconciler that takes over expired leases and looks unknown
outcomes up. The provider can confirm, lose its answer, finish after the caller gave up,
refuse, be unreachable, forget a deduplication key once its window has passed, and be
looked up (honestly: "not found" only when nothing landed and nothing is in progress).
Workers and lookups stall or die at any step, time jumps past leases, and an operation is
delivered again whenever it is prepared and due. For the tools that declare them, the
provider also reports each effect that happened in a signed success callback, at any
step and as often as it likes, and the reconciler applies them as it does.

After every step: the provider holds at most one effect per operation, a committed write
has its effect, and no settled operation (committed, rejected, or handed to a person)
moves again. The two tests at the end pin what the model found that today's policy does
not guarantee; the model assumes the first of them away (see System.advance).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pydantic import BaseModel

from consumer import callback_decisions, policy
from consumer.policy import LEASE_LOST_BEFORE_CALL, Attempt, AttemptOutcome
from outbox.callback_policy import CallbackPolicy, CallbackProvider, CallbackStatus, Scheme
from outbox.contracts import OnUnknown, Registry, RetryPolicy, SideEffect, ToolContract
from outbox.models import Callback, Operation
from outbox.outcomes import (
    EffectResult,
    ExecutionContext,
    Found,
    NotFound,
    Reconciliation,
    StillUnknown,
)
from outbox.states import OperationState, is_legal

S = OperationState
START = datetime(2026, 3, 1, tzinfo=UTC)
DEADLINE = timedelta(seconds=10)
LEASE_MARGIN = timedelta(seconds=5)
WINDOW = timedelta(minutes=2)
RETRY = RetryPolicy(
    max_attempts=3,
    initial_backoff=timedelta(seconds=1),
    max_backoff=timedelta(seconds=30),
    jitter=0.0,
    reconcile_max_attempts=3,
)
SETTLED = frozenset({S.COMMITTED, S.REJECTED, S.ESCALATED})
MAX_OPERATIONS = 2


class Ticket(BaseModel):
    title: str


async def played_by_the_model(tool_input: Ticket, context: ExecutionContext) -> EffectResult:
    raise AssertionError("the model plays the provider")


async def looked_up_by_the_model(tool_input: Ticket, context: ExecutionContext) -> Reconciliation:
    raise AssertionError("the model plays the provider")


# The provider's signed success callbacks, as the contracts that declare them take them:
# they may settle an unknown outcome, and a tool without a lookup waits for one a while.
REPORTS = CallbackProvider(name="model", scheme=Scheme.STRIPE, read=lambda payload, _: None)
CALLED_BACK = CallbackPolicy(REPORTS, settles_unknown=True, wait=timedelta(seconds=16))


def _contracts() -> dict[str, ToolContract[Ticket]]:
    reconcile, escalate = OnUnknown.RECONCILE, OnUnknown.ESCALATE
    shapes: dict[str, tuple[SideEffect, bool, OnUnknown, CallbackPolicy | None]] = {
        "read_only": (SideEffect.READ_ONLY, False, reconcile, None),
        "idempotent": (SideEffect.IDEMPOTENT_WRITE, False, reconcile, None),
        "idempotent_looked_up": (SideEffect.IDEMPOTENT_WRITE, True, reconcile, None),
        "deduplicated": (SideEffect.DEDUPLICATED_WRITE, False, reconcile, None),
        "deduplicated_looked_up": (SideEffect.DEDUPLICATED_WRITE, True, reconcile, None),
        "non_repeatable_looked_up": (SideEffect.NON_REPEATABLE_WRITE, True, reconcile, None),
        "non_repeatable_escalated": (SideEffect.NON_REPEATABLE_WRITE, False, escalate, None),
        "idempotent_called_back": (SideEffect.IDEMPOTENT_WRITE, False, reconcile, CALLED_BACK),
        "deduplicated_called_back": (
            SideEffect.DEDUPLICATED_WRITE,
            False,
            reconcile,
            CALLED_BACK,
        ),
        "deduplicated_looked_up_called_back": (
            SideEffect.DEDUPLICATED_WRITE,
            True,
            reconcile,
            CALLED_BACK,
        ),
        "non_repeatable_called_back": (
            SideEffect.NON_REPEATABLE_WRITE,
            False,
            escalate,
            CALLED_BACK,
        ),
    }
    # Registered, so the model only runs contracts the runtime accepts.
    registry = Registry()
    return {
        name: registry.register(
            ToolContract(
                name=name,
                version=1,
                input_model=Ticket,
                side_effect=side_effect,
                execute=played_by_the_model,
                retry=RETRY,
                reconcile=looked_up_by_the_model if lookup else None,
                dedupe_window=WINDOW if side_effect is SideEffect.DEDUPLICATED_WRITE else None,
                on_unknown=on_unknown,
                deadline=DEADLINE,
                callbacks=callbacks,
            )
        )
        for name, (side_effect, lookup, on_unknown, callbacks) in shapes.items()
    }


CONTRACTS = _contracts()


def replays_blind(contract: ToolContract[Any]) -> bool:
    """A deduplicated write retried without a lookup: safe only while the key is kept."""
    return contract.side_effect is SideEffect.DEDUPLICATED_WRITE and contract.reconcile is None


class Behaviour(StrEnum):
    """What the provider does with one call."""

    CONFIRM = "confirm"
    LOSE_ANSWER = "lose_answer"  # does it; the answer is lost on the way back
    FINISH_LATE = "finish_late"  # takes the request, finishes after the caller's deadline
    REFUSE = "refuse"
    UNREACHABLE = "unreachable"  # the request never arrives


@dataclass
class Provider:
    """The target of every tool, keyed by operation id (the idempotency key)."""

    effects: Counter[uuid.UUID] = field(default_factory=Counter)
    in_progress: Counter[uuid.UUID] = field(default_factory=Counter)
    # Idempotency keys the target remembers, with the time it first saw each; None for
    # an idempotent write's target, which never forgets.
    keys: dict[uuid.UUID, datetime | None] = field(default_factory=dict)

    def call(
        self, operation: Operation, contract: ToolContract[Any], behaviour: Behaviour, now: datetime
    ) -> Attempt:
        key = operation.id
        if behaviour is Behaviour.UNREACHABLE:
            return Attempt(AttemptOutcome.NOT_SENT, "connect_refused")
        if contract.side_effect is SideEffect.READ_ONLY:
            return self._answer(key, behaviour)  # a read changes nothing
        if key in self.keys:
            # A replay: the target answers for the first request and does nothing new;
            # that answer may still be lost on the way back.
            if self.in_progress[key]:
                return Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "in_progress")
            if not self.effects[key]:
                return Attempt(AttemptOutcome.REJECTED, "refused")
            lost = behaviour in (Behaviour.LOSE_ANSWER, Behaviour.FINISH_LATE)
            return self._answer(key, Behaviour.LOSE_ANSWER if lost else Behaviour.CONFIRM)
        if contract.side_effect is SideEffect.IDEMPOTENT_WRITE:
            self.keys[key] = None
        elif contract.side_effect is SideEffect.DEDUPLICATED_WRITE:
            self.keys[key] = now
        if behaviour is Behaviour.FINISH_LATE:
            self.in_progress[key] += 1
        elif behaviour is not Behaviour.REFUSE:
            self.effects[key] += 1
        return self._answer(key, behaviour)

    def _answer(self, key: uuid.UUID, behaviour: Behaviour) -> Attempt:
        if behaviour is Behaviour.CONFIRM:
            return Attempt(AttemptOutcome.COMMITTED, "ok", EffectResult(f"ref_{key.int}"))
        if behaviour is Behaviour.REFUSE:
            return Attempt(AttemptOutcome.REJECTED, "refused")
        if behaviour is Behaviour.FINISH_LATE:
            return Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "deadline_exceeded")
        return Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "response_lost")

    def finish(self, key: uuid.UUID, *, lands: bool) -> None:
        """A request the caller gave up on ends: its effect lands, or it fails."""
        self.in_progress[key] -= 1
        if lands:
            self.effects[key] += 1
        elif not self.effects[key]:
            self.keys.pop(key, None)  # nothing stored for the key: a replay is a new request

    def forgettable(self, now: datetime) -> list[uuid.UUID]:
        """Keys a deduplicating target has kept for its whole window."""
        return [key for key, seen in self.keys.items() if seen is not None and now >= seen + WINDOW]

    def look_up(self, key: uuid.UUID, *, available: bool) -> Reconciliation:
        if not available:
            return StillUnknown("provider_unavailable")
        if self.effects[key]:
            return Found(provider_reference=f"ref_{key.int}")
        if self.in_progress[key]:
            return StillUnknown("in_progress")
        return NotFound()


@dataclass
class Hand:
    """An operation a worker claimed, and what its call came to once made."""

    claimed: Operation
    contract: ToolContract[Any]
    claimed_at: datetime
    attempt: Attempt | None = None


@dataclass
class Lookup:
    """An unknown outcome the reconciler leased for a lookup."""

    leased: Operation
    contract: ToolContract[Any]


class System:
    """Operations as the store keeps them, and the processes that move them."""

    def __init__(self) -> None:
        self.now = START
        self.rows: dict[uuid.UUID, Operation] = {}
        self.contracts: dict[uuid.UUID, ToolContract[Any]] = {}
        self.provider = Provider()
        self.hands: list[Hand] = []
        self.lookups: list[Lookup] = []
        # When the policy last sent each operation back to prepared without a lookup.
        self.blind_retries: dict[uuid.UUID, datetime] = {}
        # The provider's callbacks: recorded and not applied yet, and every one recorded.
        self.inbox: list[Callback] = []
        self.reported: dict[uuid.UUID, list[Callback]] = {}
        self.contradictions: list[str] = []

    def decide(self, contract: ToolContract[Any]) -> uuid.UUID:
        operation_id = uuid.UUID(int=len(self.rows) + 1)
        self.contracts[operation_id] = contract
        self.rows[operation_id] = Operation(
            id=operation_id,
            run_id="model",
            decision_key=None,
            tool_name=contract.name,
            tool_version=1,
            side_effect=contract.side_effect,
            input={"title": "printer"},
            input_fingerprint="ab" * 32,
            requires_approval=False,
            state=S.PREPARED,
            attempts=0,
            reconcile_attempts=0,
            lease_token=0,
            lease_owner=None,
            lease_expires_at=None,
            next_attempt_at=self.now,
            first_attempt_at=None,
            provider_reference=None,
            result=None,
            last_error_class=None,
            effect_possible=False,
            created_at=self.now,
            updated_at=self.now,
        )
        return operation_id

    def _update(self, row: Operation, **changes: Any) -> Operation:
        self.rows[row.id] = row.model_copy(update=changes)
        return self.rows[row.id]

    # --- the store's guarded writes

    def claim(self, operation_id: uuid.UUID) -> Operation | None:
        row = self.rows[operation_id]
        if row.state is not S.PREPARED or row.next_attempt_at > self.now:
            return None  # a duplicate delivery: suppressed, never executed
        return self._update(
            row,
            state=S.IN_FLIGHT,
            attempts=row.attempts + 1,
            lease_token=row.lease_token + 1,
            lease_expires_at=self.now + DEADLINE + LEASE_MARGIN,
            first_attempt_at=row.first_attempt_at or self.now,
        )

    def move(self, decided_with: Operation, move: policy.Transition) -> bool:
        row = self.rows[decided_with.id]
        if row.state is not move.source or row.lease_token != decided_with.lease_token:
            return False  # fenced: another process moved it first
        assert is_legal(move.source, move.target), f"{move.source} -> {move.target}"
        assert not move.effect_disproved or (move.source, move.target) == (
            S.OUTCOME_UNKNOWN,
            S.PREPARED,
        )
        row = self._update(
            row,
            state=move.target,
            # As transition_operation does: set by every unknown outcome, cleared only by
            # a lookup that proved the effect absent.
            effect_possible=move.target is S.OUTCOME_UNKNOWN
            or (row.effect_possible and not move.effect_disproved),
            lease_expires_at=None,
            last_error_class=move.error_class or row.last_error_class,
            next_attempt_at=row.next_attempt_at if move.delay is None else self.now + move.delay,
            reconcile_attempts=row.reconcile_attempts + move.reconcile_attempt,
            provider_reference=move.provider_reference or row.provider_reference,
        )
        if move.then is not None:
            # Same transaction in the store: nothing can come between the two moves.
            assert self.move(row, move.then.transition)
        return True

    def defer(self, decided_with: Operation, deferral: policy.Deferral) -> bool:
        row = self.rows[decided_with.id]
        if row.state is not S.OUTCOME_UNKNOWN or row.lease_token != decided_with.lease_token:
            return False
        self._update(
            row,
            reconcile_attempts=row.reconcile_attempts + 1,
            lease_expires_at=None,
            next_attempt_at=self.now + deferral.delay,
            last_error_class=deferral.code,
        )
        return True

    def apply(
        self,
        decided_with: Operation,
        decision: policy.Transition | policy.Escalation | policy.Deferral,
    ) -> None:
        if isinstance(decision, policy.Deferral):
            self.defer(decided_with, decision)
        elif isinstance(decision, policy.Escalation):
            self.move(decided_with, decision.transition)
        else:
            self.move(decided_with, decision)

    # --- the processes

    def claimable(self) -> list[uuid.UUID]:
        return [
            row.id
            for row in self.rows.values()
            if row.state is S.PREPARED and row.next_attempt_at <= self.now
        ]

    def deliver(self, operation_id: uuid.UUID) -> Hand | None:
        row, contract = self.rows[operation_id], self.contracts[operation_id]
        # As the worker's checks do, before the claim.
        if row.state is S.PREPARED and policy.blind_replay_too_late(row, contract, now=self.now):
            self.apply(row, policy.escalation_before_replay(row))
            return None
        claimed = self.claim(operation_id)
        if claimed is None:
            return None
        hand = Hand(claimed, self.contracts[operation_id], self.now)
        self.hands.append(hand)
        return hand

    def call(self, hand: Hand, behaviour: Behaviour) -> None:
        # As the worker does: with no time left before its lease, it does not call.
        if self.now >= hand.claimed_at + DEADLINE:
            hand.attempt = Attempt(AttemptOutcome.NOT_SENT, LEASE_LOST_BEFORE_CALL)
        else:
            hand.attempt = self.provider.call(hand.claimed, hand.contract, behaviour, self.now)

    def record(self, hand: Hand) -> None:
        assert hand.attempt is not None
        self.hands.remove(hand)
        self.move(hand.claimed, policy.after_attempt(hand.claimed, hand.contract, hand.attempt))

    def due_for_reconciler(self) -> list[uuid.UUID]:
        return [
            row.id
            for row in self.rows.values()
            if (
                row.state is S.OUTCOME_UNKNOWN
                and row.next_attempt_at <= self.now
                and (row.lease_expires_at is None or row.lease_expires_at < self.now)
            )
            or (
                row.state is S.IN_FLIGHT
                and row.lease_expires_at is not None
                and row.lease_expires_at < self.now
            )
        ]

    def reportable(self) -> list[uuid.UUID]:
        """Operations whose effect happened, of tools that declare the provider's callbacks:
        an honest provider reports only those."""
        return [
            key
            for key, contract in self.contracts.items()
            if contract.callbacks is not None and self.provider.effects[key]
        ]

    def report(self, operation_id: uuid.UUID) -> None:
        """The provider's success callback, recorded (at least once: again is a new event)."""
        callback = Callback(
            id=sum(map(len, self.reported.values())) + 1,
            provider=REPORTS.name,
            event_id=f"evt_{len(self.inbox)}",
            status=CallbackStatus.COMMITTED,
            named_operation_id=operation_id,
            operation_id=operation_id,
            provider_reference=f"ref_{operation_id.int}",
            payload_digest="d" * 64,
            received_at=self.now,
            outcome=None,
            applied_at=None,
        )
        self.inbox.append(callback)
        self.reported.setdefault(operation_id, []).append(callback)

    def apply_callbacks(self, operation_id: uuid.UUID | None = None) -> None:
        """The reconciler's inbox pass (every operation), or its look at one operation's
        callbacks before it decides about it; callbacks of operations in flight wait."""
        for callback in list(self.inbox):
            assert callback.operation_id is not None
            if operation_id is not None and callback.operation_id != operation_id:
                continue
            row = self.rows[callback.operation_id]
            contract = self.contracts[callback.operation_id]
            others = [c for c in self.reported[row.id] if c.id != callback.id]
            decision = callback_decisions.after_callback(
                row,
                contract,
                callback,
                success_reported=any(c.status is CallbackStatus.COMMITTED for c in others),
            )
            if decision is None:
                continue
            self.inbox.remove(callback)
            if decision.contradiction is not None:
                self.contradictions.append(f"{row.state}: {decision.contradiction}")
            if decision.move is not None:
                assert self.move(row, decision.move)

    def reconcile(self, operation_id: uuid.UUID) -> Lookup | None:
        """Triage as the reconciler does; returns the lookup it leased, if any."""
        row, contract = self.rows[operation_id], self.contracts[operation_id]
        if row.state is S.IN_FLIGHT:
            assert self.move(row, policy.after_lease_expired(row))
        self.apply_callbacks(operation_id)
        row = self.rows[operation_id]
        if row.state is not S.OUTCOME_UNKNOWN:
            return None  # a callback settled it
        decision = policy.for_unknown_outcome(row, contract, now=self.now)
        if isinstance(decision, policy.LookUp):
            leased = self._update(
                row,
                lease_token=row.lease_token + 1,
                lease_expires_at=self.now + DEADLINE + LEASE_MARGIN,
            )
            lookup = Lookup(leased, contract)
            self.lookups.append(lookup)
            return lookup
        if isinstance(decision, policy.Transition) and decision.target is S.PREPARED:
            self.blind_retries[operation_id] = self.now
        self.apply(row, decision)
        return None

    def look_up(self, lookup: Lookup, *, available: bool) -> None:
        self.lookups.remove(lookup)
        result = self.provider.look_up(lookup.leased.id, available=available)
        self.apply(lookup.leased, policy.after_lookup(lookup.leased, lookup.contract, result))

    def advance(self, step: timedelta) -> None:
        """Time passes, and the target forgets the keys it kept for their whole window."""
        self.now += step
        for key in self.provider.forgettable(self.now):
            del self.provider.keys[key]


class WorkerFate(StrEnum):
    """What becomes of a worker once it has claimed a delivery."""

    RECORDS = "records"
    STALLS_BEFORE_CALL = "stalls_before_call"  # resumes at a later step, or never
    STALLS_BEFORE_RECORD = "stalls_before_record"
    DIES_AFTER_CALL = "dies_after_call"  # its lease runs out; the reconciler takes over


class LookupFate(StrEnum):
    """What becomes of a lookup the reconciler leased."""

    ANSWERED = "answered"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    STALLS = "stalls"  # answers at a later step, perhaps after its lease ran out
    DIES = "dies"


class ConsumerModel(RuleBasedStateMachine):
    """Each step is one process's turn. A delivery of an operation that is not prepared
    and due is a duplicate the claim refuses, so only those that are get delivered."""

    def __init__(self) -> None:
        super().__init__()
        self.system = System()
        self.settled: dict[uuid.UUID, OperationState] = {}

    @initialize(name=st.sampled_from(sorted(CONTRACTS)))
    def first_decision(self, name: str) -> None:
        self.system.decide(CONTRACTS[name])

    @precondition(lambda self: len(self.system.rows) < MAX_OPERATIONS)
    @rule(name=st.sampled_from(sorted(CONTRACTS)))
    def decide(self, name: str) -> None:
        self.system.decide(CONTRACTS[name])

    @precondition(lambda self: self.system.claimable())
    @rule(
        data=st.data(),
        behaviour=st.sampled_from(list(Behaviour)),
        fate=st.sampled_from(list(WorkerFate)),
    )
    def delivery(self, data: st.DataObject, behaviour: Behaviour, fate: WorkerFate) -> None:
        operation_id = data.draw(st.sampled_from(self.system.claimable()))
        hand = self.system.deliver(operation_id)
        if hand is None:  # a replay too late for its window: a person decides instead
            assert self.system.rows[operation_id].state is S.ESCALATED
            return
        if fate is WorkerFate.STALLS_BEFORE_CALL:
            return
        self.system.call(hand, behaviour)
        if fate is WorkerFate.RECORDS:
            self.system.record(hand)
        elif fate is WorkerFate.DIES_AFTER_CALL:
            self.system.hands.remove(hand)

    @precondition(lambda self: self.system.hands)
    @rule(data=st.data(), behaviour=st.sampled_from(list(Behaviour)))
    def stalled_worker_resumes(self, data: st.DataObject, behaviour: Behaviour) -> None:
        hand = data.draw(st.sampled_from(self.system.hands))
        if hand.attempt is None:
            self.system.call(hand, behaviour)
        self.system.record(hand)

    @precondition(lambda self: self.system.due_for_reconciler())
    @rule(data=st.data(), fate=st.sampled_from(list(LookupFate)))
    def reconciler_pass(self, data: st.DataObject, fate: LookupFate) -> None:
        lookup = self.system.reconcile(data.draw(st.sampled_from(self.system.due_for_reconciler())))
        if lookup is None or fate is LookupFate.STALLS:
            return
        if fate is LookupFate.DIES:
            self.system.lookups.remove(lookup)
        else:
            self.system.look_up(lookup, available=fate is LookupFate.ANSWERED)

    @precondition(lambda self: self.system.lookups)
    @rule(data=st.data(), available=st.booleans())
    def stalled_lookup_answers(self, data: st.DataObject, available: bool) -> None:
        self.system.look_up(data.draw(st.sampled_from(self.system.lookups)), available=available)

    @precondition(lambda self: +self.system.provider.in_progress)
    @rule(data=st.data(), lands=st.booleans())
    def late_request_ends(self, data: st.DataObject, lands: bool) -> None:
        key = data.draw(st.sampled_from(sorted(+self.system.provider.in_progress)))
        self.system.provider.finish(key, lands=lands)

    @precondition(lambda self: self.system.reportable())
    @rule(data=st.data())
    def provider_reports_an_effect(self, data: st.DataObject) -> None:
        self.system.report(data.draw(st.sampled_from(self.system.reportable())))

    @precondition(lambda self: self.system.inbox)
    @rule()
    def reconciler_applies_the_inbox(self) -> None:
        self.system.apply_callbacks()

    @rule(seconds=st.sampled_from([1, 5, 16, 60, 150]))
    def time_passes(self, seconds: int) -> None:
        self.system.advance(timedelta(seconds=seconds))

    @invariant()
    def an_honest_providers_callbacks_contradict_nothing(self) -> None:
        # Every callback here reports an effect that happened, with its own reference: a
        # contradiction would be a false alarm that pages someone.
        assert self.system.contradictions == []

    @invariant()
    def at_most_one_effect_per_operation(self) -> None:
        assert max(self.system.provider.effects.values(), default=0) <= 1

    @invariant()
    def a_committed_write_has_its_effect(self) -> None:
        for row in self.system.rows.values():
            if row.state is S.COMMITTED and row.side_effect is not SideEffect.READ_ONLY:
                assert self.system.provider.effects[row.id] == 1

    @invariant()
    def a_rejected_write_has_no_effect_and_none_to_come(self) -> None:
        # What "rejected" tells the agent: not done, and never will be.
        for row in self.system.rows.values():
            if row.state is S.REJECTED and row.side_effect is not SideEffect.READ_ONLY:
                assert self.system.provider.effects[row.id] == 0
                assert self.system.provider.in_progress[row.id] == 0

    @invariant()
    def no_settled_operation_moves_again(self) -> None:
        for row in self.system.rows.values():
            if row.id in self.settled:
                assert row.state is self.settled[row.id]
            elif row.state in SETTLED:
                self.settled[row.id] = row.state


# Under ten seconds. Fixed (derandomized, no example database) so that CI runs the same
# sequences every time; a local run with derandomize=False explores new ones.
ConsumerModel.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
)
TestConsumerModel = ConsumerModel.TestCase


# --- what the model found: gaps in today's policy, pinned until they are closed


def test_a_blind_replay_that_would_run_after_the_window_goes_to_a_person() -> None:
    system = System()
    operation_id = system.decide(CONTRACTS["deduplicated"])
    system.deliver(operation_id)
    (hand,) = system.hands
    system.call(hand, Behaviour.LOSE_ANSWER)  # the effect happened; the answer is lost
    system.record(hand)
    system.advance(WINDOW / 2)
    system.reconcile(operation_id)  # well inside the window: retry the same key
    assert system.rows[operation_id].state is S.PREPARED
    system.advance(WINDOW)  # the consumers were slow to get to it; the target forgot
    assert not system.provider.keys
    delivered = system.deliver(operation_id)

    assert delivered is None
    assert system.rows[operation_id].state is S.ESCALATED
    assert system.provider.effects[operation_id] == 1


def test_an_operation_whose_effect_may_have_happened_is_never_called_rejected() -> None:
    system = System()
    operation_id = system.decide(CONTRACTS["idempotent"])
    for behaviour in (Behaviour.LOSE_ANSWER, Behaviour.UNREACHABLE, Behaviour.UNREACHABLE):
        system.deliver(operation_id)
        (hand,) = system.hands
        system.call(hand, behaviour)
        system.record(hand)
        system.advance(timedelta(seconds=5))
        if system.rows[operation_id].state is S.OUTCOME_UNKNOWN:
            system.reconcile(operation_id)  # an idempotent write: retry the same input
            system.advance(timedelta(seconds=5))

    assert system.provider.effects[operation_id] == 1  # the first attempt did it
    assert system.rows[operation_id].state is not S.REJECTED  # what the agent is told
