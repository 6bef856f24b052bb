from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import uuid4

import psycopg
import pytest

from outbox import (
    IllegalTransition,
    LeaseLost,
    Operation,
    OperationNotFound,
    OperationState,
    Registry,
)
from outbox import store as outbox_store
from outbox.states import LEGAL_TRANSITIONS
from outbox.store import Store

from support.db_helpers import execute_admin
from support.ops_helpers import LEASE, Ops

S = OperationState
ALL_PAIRS = [(source, target) for source in S for target in S if source is not target]
ILLEGAL_PAIRS = [pair for pair in ALL_PAIRS if pair not in LEGAL_TRANSITIONS]


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def test_sixteen_concurrent_claimers_exactly_one_wins(ops: Ops) -> None:
    operation = ops.new()
    claimers = 16
    barrier = threading.Barrier(claimers)
    outcomes: list[Operation | None] = []
    failures: list[BaseException] = []

    def claim(worker: int) -> None:
        try:
            with psycopg.connect(ops.database_url) as connection:
                barrier.wait(timeout=10)
                outcomes.append(
                    Store(connection).run(
                        outbox_store.claim(operation.id, owner=f"worker-{worker}", lease=LEASE)
                    )
                )
        except BaseException as failure:  # re-raised below, in the test thread
            failures.append(failure)

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert failures == []
    winners = [o for o in outcomes if o is not None]
    assert len(outcomes) == claimers
    assert len(winners) == 1
    stored = ops.get(operation.id)
    assert (stored.state, stored.attempts) == (S.IN_FLIGHT, 1)
    assert stored.lease_token == winners[0].lease_token > 0
    assert stored.lease_owner == winners[0].lease_owner
    assert ops.event_names(operation.id) == ["operation.prepared", "operation.attempted"]


def test_claim_sets_a_lease_and_a_new_fencing_token_each_time(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    assert operation.lease_expires_at is not None
    assert operation.lease_expires_at > operation.updated_at + LEASE - timedelta(seconds=1)
    back = ops.move(operation, S.PREPARED)
    again = ops.move(back, S.IN_FLIGHT)

    assert 0 < operation.lease_token < again.lease_token
    assert again.attempts == 2
    assert back.lease_owner is None
    assert back.lease_expires_at is None


@pytest.mark.parametrize(("source", "target"), sorted(LEGAL_TRANSITIONS))
def test_every_legal_transition_works_and_appends_its_event(
    ops: Ops, source: OperationState, target: OperationState
) -> None:
    operation = ops.at(source)
    events_before = ops.event_names(operation.id)

    moved = ops.move(operation, target)

    assert moved.state is target
    assert ops.get(operation.id).state is target
    events_after = ops.event_names(operation.id)
    assert len(events_after) == len(events_before) + 1
    expected = {
        S.IN_FLIGHT: "operation.attempted",
        S.COMMITTED: "operation.committed",
        S.REJECTED: "operation.rejected",
        S.PREPARED: "operation.retry_scheduled",
        S.OUTCOME_UNKNOWN: "operation.outcome_unknown",
        S.ESCALATED: "operation.escalated",
    }[target]
    assert events_after[-1] == expected


@pytest.mark.parametrize(("source", "target"), ILLEGAL_PAIRS)
def test_every_illegal_transition_is_refused_and_changes_nothing(
    ops: Ops, source: OperationState, target: OperationState
) -> None:
    operation = ops.at(source)
    events_before = ops.event_names(operation.id)

    if target is S.IN_FLIGHT:
        # claim is the only road to in_flight, and it only leaves prepared
        assert ops.run(outbox_store.claim(operation.id, owner="w", lease=LEASE)) is None
    else:
        with pytest.raises(IllegalTransition, match=f"{source} -> {target} is not a legal"):
            ops.run(
                outbox_store.transition(
                    operation.id, source=source, target=target, lease_token=operation.lease_token
                )
            )

    assert ops.get(operation.id) == operation
    assert ops.event_names(operation.id) == events_before


@pytest.mark.parametrize(("source", "target"), ILLEGAL_PAIRS)
def test_the_database_itself_refuses_every_illegal_edge(
    ops: Ops, database_url: str, source: OperationState, target: OperationState
) -> None:
    operation = ops.at(source)
    lease = "lease_owner = 'w', lease_expires_at = now() + interval '1 minute'"
    no_lease = "lease_owner = NULL, lease_expires_at = NULL"
    with pytest.raises(psycopg.errors.CheckViolation) as raised:
        execute_admin(
            database_url,
            f"UPDATE operations SET state = %s, {lease if target is S.IN_FLIGHT else no_lease} "
            "WHERE id = %s",
            (str(target), operation.id),
        )

    assert raised.value.diag.constraint_name in (
        "operations_legal_transition",
        "operations_terminal",
    )
    assert ops.get(operation.id).state is source


def test_a_stale_lease_token_is_refused(ops: Ops) -> None:
    first_claim = ops.at(S.IN_FLIGHT)
    # The first worker pauses; its lease is handed on and the operation is claimed again.
    ops.move(first_claim, S.PREPARED)
    second_claim = ops.move(ops.get(first_claim.id), S.IN_FLIGHT)
    events_before = ops.event_names(first_claim.id)

    with pytest.raises(LeaseLost, match="another worker") as raised:
        ops.run(
            outbox_store.transition(
                first_claim.id,
                source=S.IN_FLIGHT,
                target=S.COMMITTED,
                lease_token=first_claim.lease_token,
                provider_reference="re_zombie",
            )
        )

    assert str(second_claim.lease_token) in str(raised.value)
    assert ops.get(first_claim.id) == second_claim
    assert ops.event_names(first_claim.id) == events_before


def test_leaving_in_flight_without_a_lease_token_is_refused(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    with pytest.raises(IllegalTransition, match="lease token"):
        ops.run(outbox_store.transition(operation.id, source=S.IN_FLIGHT, target=S.COMMITTED))
    assert ops.get(operation.id).state is S.IN_FLIGHT


def test_a_transition_from_a_state_the_operation_left_is_refused(ops: Ops) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)
    ops.move(operation, S.COMMITTED)

    with pytest.raises(IllegalTransition, match="is committed, not outcome_unknown"):
        ops.run(outbox_store.transition(operation.id, source=S.OUTCOME_UNKNOWN, target=S.ESCALATED))


def test_unknown_operation_is_reported_as_not_found(ops: Ops) -> None:
    missing = uuid4()
    calls: list[Callable[[], object]] = [
        lambda: ops.run(outbox_store.get_operation(missing)),
        lambda: ops.run(
            outbox_store.transition(missing, source=S.OUTCOME_UNKNOWN, target=S.ESCALATED)
        ),
    ]
    for call in calls:
        with pytest.raises(OperationNotFound, match=str(missing)):
            call()
    assert ops.run(outbox_store.claim(missing, owner="w", lease=LEASE)) is None


def test_commit_records_provider_reference_result_and_clears_the_lease(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    committed = ops.run(
        outbox_store.transition(
            operation.id,
            source=S.IN_FLIGHT,
            target=S.COMMITTED,
            lease_token=operation.lease_token,
            provider_reference="re_123",
            result={"status": "succeeded"},
        )
    )
    events = ops.run(outbox_store.events(operation.id))

    assert (committed.provider_reference, committed.result) == ("re_123", {"status": "succeeded"})
    assert (committed.lease_owner, committed.lease_expires_at) == (None, None)
    assert events[-1].attributes == {
        "from": "in_flight",
        "to": "committed",
        "provider_reference": "re_123",
    }


def test_returning_to_prepared_queues_a_new_outbox_row_after_the_backoff(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    retried = ops.run(
        outbox_store.transition(
            operation.id,
            source=S.IN_FLIGHT,
            target=S.PREPARED,
            lease_token=operation.lease_token,
            error_class="connection_refused",
            delay=timedelta(seconds=30),
        )
    )
    rows = ops.run(outbox_store.outbox_rows(operation.id))

    assert len(rows) == 2
    assert rows[-1].available_at == retried.next_attempt_at
    assert retried.next_attempt_at >= retried.updated_at + timedelta(seconds=30)
    assert retried.last_error_class == "connection_refused"
    assert (
        ops.run(outbox_store.events(operation.id))[-1].attributes["reason"] == "connection_refused"
    )


def test_waiting_for_approval_returns_to_prepared_without_a_new_outbox_row(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    ops.run(
        outbox_store.transition(
            operation.id,
            source=S.IN_FLIGHT,
            target=S.PREPARED,
            lease_token=operation.lease_token,
            requeue=False,
        )
    )
    assert len(ops.run(outbox_store.outbox_rows(operation.id))) == 1


def test_claim_many_claims_each_prepared_operation_once_with_its_own_lease(ops: Ops) -> None:
    fresh, taken = ops.new(), ops.at(S.IN_FLIGHT)
    short = timedelta(seconds=5)

    claimed = ops.run(
        outbox_store.claim_many([(fresh.id, short), (taken.id, LEASE)], owner="worker-b")
    )

    assert list(claimed) == [fresh.id]
    stored = ops.get(fresh.id)
    assert claimed[fresh.id] == stored
    assert (stored.state, stored.attempts) == (S.IN_FLIGHT, 1)
    assert stored.lease_token > 0
    assert stored.lease_expires_at is not None
    assert stored.lease_expires_at < stored.updated_at + LEASE - timedelta(seconds=30)
    assert ops.event_names(fresh.id)[-1] == "operation.attempted"
    assert ops.get(taken.id) == taken
    assert ops.run(outbox_store.claim_many([], owner="worker-b")) == {}


def delivered(operation: Operation, **message: Any) -> outbox_store.DeliveryClaim:
    """The claim a message about ``operation`` makes, with what ``message`` changes."""
    claim = outbox_store.DeliveryClaim(
        operation.id,
        operation.tool_name,
        operation.tool_version,
        operation.input_fingerprint,
        lease=LEASE,
    )
    return dataclasses.replace(claim, **message)


def test_claim_deliveries_claims_only_what_a_claim_many_after_the_checks_would(
    ops: Ops,
) -> None:
    fresh, taken = ops.new(), ops.at(S.IN_FLIGHT)
    forged = ops.new(amount_cents=101)
    # Above 50,000 cents a person must approve: the approvals are read before a claim.
    approval = ops.new(amount_cents=60_000)
    assert approval.requires_approval
    later = ops.new(amount_cents=102)
    execute_admin(
        ops.database_url,
        "UPDATE operations SET next_attempt_at = now() + interval '1 hour' WHERE id = %s",
        (later.id,),
    )
    untouched = [taken, forged, approval, ops.get(later.id)]
    short = timedelta(seconds=5)

    claimed = ops.run(
        outbox_store.claim_deliveries(
            [
                delivered(fresh, lease=short),
                delivered(taken),
                delivered(forged, input_fingerprint="0" * 64),
                delivered(approval),
                delivered(later),
                delivered(ops.new(amount_cents=103), tool_name="file_ticket"),
                delivered(ops.new(amount_cents=104), tool_version=2),
            ],
            owner="worker-b",
        )
    )

    assert list(claimed) == [fresh.id]
    stored = ops.get(fresh.id)
    assert claimed[fresh.id].operation == stored
    assert (stored.state, stored.attempts, stored.lease_owner) == (S.IN_FLIGHT, 1, "worker-b")
    assert stored.lease_expires_at is not None
    assert stored.lease_expires_at < stored.updated_at + LEASE - timedelta(seconds=30)
    assert ops.events(fresh.id)[-1].name == "operation.attempted"
    assert ops.events(fresh.id)[-1].attributes == {
        "attempt": 1,
        "lease_token": stored.lease_token,
        "worker": "worker-b",
    }
    assert [ops.get(operation.id) for operation in untouched] == untouched
    assert ops.run(outbox_store.claim_deliveries([], owner="worker-b")) == {}


def test_claim_deliveries_returns_the_row_as_the_checks_knew_it(ops: Ops) -> None:
    first = ops.at(S.IN_FLIGHT)
    retried = ops.move(first, S.PREPARED)

    (claimed,) = ops.run(
        outbox_store.claim_deliveries([delivered(retried)], owner="worker-b")
    ).values()

    assert claimed.operation.attempts == 2
    assert claimed.operation.first_attempt_at == first.first_attempt_at
    assert claimed.before.attempts == 1
    assert claimed.before.state is S.PREPARED
    assert claimed.before.first_attempt_at == first.first_attempt_at
    # A first attempt: its time is this claim's, and the row before had none.
    (fresh,) = ops.run(
        outbox_store.claim_deliveries([delivered(ops.new(amount_cents=7))], owner="w")
    ).values()
    assert fresh.operation.first_attempt_at is not None
    assert (fresh.before.attempts, fresh.before.first_attempt_at) == (0, None)


def test_commit_many_writes_what_transition_writes(ops: Ops) -> None:
    one, other = ops.at(S.IN_FLIGHT), ops.at(S.IN_FLIGHT)
    single = ops.run(
        outbox_store.transition(
            one.id,
            source=S.IN_FLIGHT,
            target=S.COMMITTED,
            lease_token=one.lease_token,
            provider_reference="re_1",
            result={"status": "ok"},
            attributes={"attempt": 1},
        )
    )
    batched = ops.run(
        outbox_store.commit_many(
            [
                outbox_store.ConfirmedEffect(
                    operation=other,
                    provider_reference="re_1",
                    result={"status": "ok"},
                    attributes={"attempt": 1},
                )
            ]
        )
    )[other.id]

    assert batched == ops.get(other.id)
    assert (batched.state, batched.provider_reference, batched.result) == (
        single.state,
        single.provider_reference,
        single.result,
    )
    assert (batched.lease_owner, batched.lease_expires_at) == (None, None)
    assert ops.events(other.id)[-1].attributes == ops.events(one.id)[-1].attributes
    assert ops.event_names(other.id) == ops.event_names(one.id)


def test_commit_many_refuses_a_stale_lease_token_and_commits_the_rest(ops: Ops) -> None:
    zombie = ops.at(S.IN_FLIGHT)
    ops.move(zombie, S.PREPARED)
    reclaimed = ops.move(ops.get(zombie.id), S.IN_FLIGHT)
    live = ops.at(S.IN_FLIGHT)
    events_before = ops.event_names(zombie.id)

    committed = ops.run(
        outbox_store.commit_many(
            [
                outbox_store.ConfirmedEffect(
                    operation=operation, provider_reference="re_x", result={}, attributes={}
                )
                for operation in (zombie, live)
            ]
        )
    )

    assert list(committed) == [live.id]
    assert ops.get(zombie.id) == reclaimed
    assert ops.event_names(zombie.id) == events_before
    assert ops.get(live.id).state is S.COMMITTED


def test_only_a_lookup_that_proved_the_effect_absent_clears_a_possible_effect(ops: Ops) -> None:
    operation = ops.at(S.IN_FLIGHT)
    assert not operation.effect_possible
    unknown = ops.move(operation, S.OUTCOME_UNKNOWN)
    assert unknown.effect_possible

    # A blind retry and a new attempt leave the mark: they prove nothing about the first.
    retried = ops.move(unknown, S.PREPARED)
    again = ops.move(ops.move(retried, S.IN_FLIGHT), S.OUTCOME_UNKNOWN)
    assert (retried.effect_possible, again.effect_possible) == (True, True)
    with pytest.raises(IllegalTransition, match="prove an effect absent"):
        ops.run(
            outbox_store.transition(
                again.id, source=S.OUTCOME_UNKNOWN, target=S.ESCALATED, effect_disproved=True
            )
        )

    absent = ops.run(
        outbox_store.transition(
            again.id,
            source=S.OUTCOME_UNKNOWN,
            target=S.PREPARED,
            lease_token=again.lease_token,
            reconcile_attempt=True,
            effect_disproved=True,
        )
    )
    assert (absent.state, absent.effect_possible) == (S.PREPARED, False)
