"""Fencing across a failover: the standby promoted after an asynchronous failover never
saw the claim a worker made on the old primary, so it hands the operation out again. The
new holder's token must differ from (and exceed) the old one, or the old worker's late
write would land under the new holder's lease."""

from __future__ import annotations

from typing import TypeVar
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Registry, record_decision
from outbox import store as outbox_store
from outbox.migrate import migrate
from outbox.store import Plan, Store
from outbox.store.operations import ConfirmedEffect

from support import private_postgres
from support.ops_helpers import LEASE
from support.pg_replication import replicated_pair

pytestmark = pytest.mark.skipif(
    not private_postgres.installed(), reason="Postgres (initdb, pg_ctl) is not installed here"
)

S = OperationState
T = TypeVar("T")


def run(url: str, plan: Plan[T]) -> T:
    with psycopg.connect(url) as connection:
        return Store(connection).run(plan)


def test_a_claim_lost_in_the_failover_cannot_fence_in_the_new_holder(registry: Registry) -> None:
    with replicated_pair(synchronous=False) as pair:
        migrate(pair.primary.url())
        with psycopg.connect(pair.url()) as connection:
            recorded = record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": "pay_1", "amount_cents": 5},
                run_id="failover",
            )
        operation_id: UUID = recorded.operation.id
        pair.wait_replayed()
        pair.detach_standby()

        # Written on the old primary only: the standby will never know this claim.
        old = run(pair.url(), outbox_store.claim(operation_id, owner="old-worker", lease=LEASE))
        assert old is not None
        pair.fail_over()

        new = run(pair.url(), outbox_store.claim(operation_id, owner="new-worker", lease=LEASE))
        assert new is not None, "the promoted standby still has the operation prepared"
        late = run(
            pair.url(),
            outbox_store.commit_many(
                [
                    ConfirmedEffect(
                        operation=old, provider_reference="re_old", result={}, attributes={}
                    )
                ]
            ),
        )
        stored = run(pair.url(), outbox_store.get_operation(operation_id))

        assert late == {}
        assert stored.state is S.IN_FLIGHT
        assert (stored.lease_owner, stored.lease_token) == ("new-worker", new.lease_token)
        assert new.lease_token > old.lease_token
