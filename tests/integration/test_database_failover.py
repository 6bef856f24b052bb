"""A database that fails over under running daemons, on a private primary and standby.

Fencing: the standby promoted after an asynchronous failover never saw the claim a
worker made on the old primary, so it hands the operation out again. The new holder's
token must differ from (and exceed) the old one, or the old worker's late write would
land under the new holder's lease.

A demoted primary: a server the daemons are connected to turns read-only (as a primary
does when a switchover demotes it) while the standby is promoted. Every write on the old
sessions is refused; the daemons must drop them and let libpq find the writable host,
not retry the read-only one forever, and say once that they moved."""

from __future__ import annotations

from typing import TypeVar
from uuid import UUID

import psycopg
import pytest
from pydantic import SecretStr

from outbox import OperationState, Registry, Settings, record_decision
from outbox import store as outbox_store
from outbox.migrate import migrate
from outbox.store import Plan, Store
from outbox.store.operations import ConfirmedEffect

from support import private_postgres
from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import counter_value, running_dispatcher
from support.logs import logged
from support.ops_helpers import LEASE
from support.pg_replication import replicated_pair
from support.waiting import eventually

pytestmark = pytest.mark.skipif(
    not private_postgres.installed(), reason="Postgres (initdb, pg_ctl) is not installed here"
)

S = OperationState
T = TypeVar("T")


REFUND = {"payment_id": "pay_1", "amount_cents": 5}
FAILOVERS = "outbox_database_failovers_total"


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


def decide(url: str, registry: Registry, run_id: str) -> UUID:
    with psycopg.connect(url) as connection:
        return record_decision(
            connection, registry, "send_refund", REFUND, run_id=run_id
        ).operation.id


async def test_daemons_on_a_demoted_primary_move_to_the_promoted_standby(
    settings: Settings, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    with replicated_pair(synchronous=False) as pair:
        migrate(pair.primary.url())
        url = pair.url()
        multi = settings.model_copy(
            update={"database_url": SecretStr(url), "reconcile_interval": 0.2}
        )
        async with (
            running_dispatcher(multi) as dispatcher,
            running_consumer(multi, registry) as consumer,
        ):
            before = decide(url, registry, "before")
            await eventually(
                in_state(url, before, S.COMMITTED), within=30, what="a refund on the primary"
            )

            # The switchover: the primary stops taking writes, the standby catches up
            # and is promoted; the daemons' sessions still reach the old one.
            pair.primary.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            pair.primary.execute("SELECT pg_reload_conf()")
            pair.wait_replayed()
            pair.standby.promote()
            pair.standby.wait_until_accepting_writes()

            async def both_moved() -> bool:
                return (
                    counter_value(dispatcher, FAILOVERS),
                    counter_value(consumer, FAILOVERS),
                ) == (1.0, 1.0)

            await eventually(both_moved, within=30, what="both daemons on the promoted standby")
            after = decide(url, registry, "after")
            await eventually(
                in_state(url, after, S.COMMITTED), within=30, what="a refund after the move"
            )

        assert pair.primary.execute(f"SELECT count(*) FROM operations WHERE id = '{after}'") == [
            (0,)
        ]
        moved = {"from": pair.primary.address, "to": pair.standby.address}
        assert logged(caplog, "dispatcher.database_failover", **moved)
        assert logged(caplog, "consumer.database_failover", **moved)
