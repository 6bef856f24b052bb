"""A three-node RabbitMQ cluster on this machine, one node lost under both daemons:
nothing lost, nothing done twice, and both daemons carry on against the survivors.

The daemons run as subprocesses with OUTBOX_AMQP_URL listing the three nodes. They
connect to the first, which also holds the quorum queue's leader; the test ends that
node while operations are in flight (killed with SIGKILL, as a crash would, or stopped
with ``rabbitmqctl stop``, as an operator would), records more, and waits for every
one to settle. The daemons are never restarted.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import psycopg
import pytest
from pydantic import SecretStr

from harness.checker import check
from outbox import Settings
from outbox.migrate import declare_broker_topology

from support.dispatch_helpers import record_many
from support.rabbit_cluster import Node, RabbitCluster, rabbit_cluster
from support.system import Daemon, running_system
from support.waiting import eventually_sync

pytestmark = [
    pytest.mark.rabbit_cluster,
    # The cluster boots in 20-40 s on two cores; the run itself takes about as long.
    pytest.mark.timeout(240),
]

BEFORE = 150  # recorded before the kill; some are settled when it lands, most are not
AFTER = 50  # recorded while the daemons are finding the survivors
KILL_AFTER_COMMITTED = 40
FAILOVER_ACTIONS = ("broker.connected", "broker.address_failed")


@pytest.fixture
def cluster() -> Iterator[RabbitCluster]:
    with rabbit_cluster(3) as started:
        yield started


def states(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        rows = connection.execute("SELECT state, count(*) FROM operations GROUP BY state")
        return {str(state): int(count) for state, count in rows}


# What may come between two attempts of one operation: a lookup's answer, or a move back
# to ``prepared`` for an attempt that provably never reached the provider (its lease ran
# out before the call, or the provider could not take it: refused, held back by the
# breaker, no answer to the connect).
REASONS_TO_ATTEMPT_AGAIN = frozenset({"reconciled", "retry_not_sent", "wait_for_provider"})


def unexplained_second_attempts(database_url: str) -> dict[str, list[str]]:
    """Operations attempted again with nothing between the attempts that allows it,
    each with the events (name and policy) that did come between them."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT operation_id, name, coalesce(attributes->>'policy', '') "
            "FROM operation_events ORDER BY operation_id, id"
        ).fetchall()
    unexplained: dict[str, list[str]] = {}
    since_last_attempt: dict[str, list[tuple[str, str]]] = {}
    for operation, name, policy in rows:
        key, event = str(operation), str(name).removeprefix("operation.")
        if event != "attempted":
            if key in since_last_attempt:
                since_last_attempt[key].append((event, str(policy)))
            continue
        between = since_last_attempt.get(key)
        if between is not None and not any(
            event in REASONS_TO_ATTEMPT_AGAIN or policy in REASONS_TO_ATTEMPT_AGAIN
            for event, policy in between
        ):
            unexplained[key] = [f"{event}:{policy}" for event, policy in between]
        since_last_attempt[key] = []
    return unexplained


def attempted_again(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM (SELECT operation_id FROM operation_events "
            "WHERE name = 'operation.attempted' GROUP BY operation_id HAVING count(*) > 1) AS again"
        ).fetchone()
        return int(row[0]) if row else 0


def connected_to(daemon: Daemon, node: Node) -> bool:
    return any(
        "action=broker.connected" in line and f"broker={node.address}" in line
        for line in daemon.lines
    )


def on_a_survivor(daemon: Daemon, survivors: list[Node]) -> bool:
    return any(connected_to(daemon, node) for node in survivors)


@pytest.mark.parametrize("ending", ["killed", "stopped"])
def test_a_node_lost_under_both_daemons_loses_and_duplicates_nothing(
    settings: Settings, cluster: RabbitCluster, ending: str
) -> None:
    first, *survivors = cluster.nodes
    clustered = settings.model_copy(
        # As deployed: `outbox migrate --broker` declares the topology, the daemons
        # only check it is there.
        update={"amqp_url": SecretStr(cluster.amqp_url), "declare_topology": False}
    )
    asyncio.run(declare_broker_topology(clustered))
    queue = cluster.queue(first, settings.queue)
    assert queue["type"] == "quorum"
    assert sorted(queue["members"]) == sorted(node.name for node in cluster.nodes)
    assert queue["leader"] == first.name

    # A generous deadline for the provider: this test is about the broker, and on a
    # busy two-core machine (three extra nodes) a 1 s refund call can time out and end
    # in reconciliation or an escalation, which would hide what the broker did.
    with running_system(clustered, refund_deadline=10.0) as system:
        daemons = [system.start("dispatcher"), system.start("consumer")]

        def committed(count: int, *, within: float) -> None:
            """Until ``count`` operations are committed; failing, what each daemon said."""
            try:
                eventually_sync(
                    lambda: states(system.database_url).get("committed", 0) >= count,
                    within=within,
                    what=f"{count} operations committed",
                )
            except AssertionError as late:
                said = "\n".join(f"-- the {d.kind}:\n{d.tail(30)}" for d in daemons)
                raise AssertionError(f"{late}: {states(system.database_url)}\n{said}") from None

        for daemon in daemons:
            daemon.wait_for_line("session ready", within=30)
            assert connected_to(daemon, first), daemon.tail()

        record_many(system.database_url, system.registry, BEFORE, run_id="before")
        committed(KILL_AFTER_COMMITTED, within=30)
        # Read as the fault begins: a graceful stop tells the clients first and takes
        # seconds to halt the node, and the daemons, already on a survivor by then, may
        # finish every decision before it returns.
        at_kill = states(system.database_url)
        if ending == "killed":
            cluster.kill(first)  # a crash: sockets reset, no word to clients or peers
        else:
            cluster.stop(first)  # an operator's stop: clients are told, then the node halts
        record_many(system.database_url, system.registry, AFTER, run_id="after")

        for daemon in daemons:
            eventually_sync(
                functools.partial(on_a_survivor, daemon, survivors),
                within=30,
                what=f"the {daemon.kind} connected to a surviving node",
            )
        total = BEFORE + AFTER
        committed(total, within=60)
        for daemon in daemons:
            assert daemon.running(), f"the {daemon.kind} exited:\n{daemon.tail()}"
        outputs = {daemon.kind: daemon.output() for daemon in daemons}

    # The kill landed in the middle of the run, not before it or after it.
    assert at_kill.get("committed", 0) < BEFORE, at_kill
    # Every decision ends committed, with exactly one refund at the provider and one
    # attempt in the event log: nothing lost, nothing executed twice.
    assert states(system.database_url) == {"committed": total}
    verdict = check(system.database_url, total, system.provider)
    assert verdict.held, verdict.examples
    assert (verdict.effects, verdict.lost, verdict.duplicate_effects) == (total, 0, 0)
    refunds = system.provider.ledger()["refunds_by_key"]
    assert len(refunds) == total
    assert set(refunds.values()) == {1}
    # A second attempt only where a lookup proved the first never reached the provider,
    # or where the first provably never reached it (its lease ran out before the call on
    # a loaded machine, or the provider could not take it). Deliveries in hand when the
    # connection drops finish in the consumer's own tasks and lose only their ack.
    assert verdict.blind_retries == 0, verdict.examples
    assert unexplained_second_attempts(system.database_url) == {}
    retried = attempted_again(system.database_url)
    # Both daemons lost their session to the broker, connected to a survivor and
    # carried on in the same process: one start line each.
    for kind, output in outputs.items():
        assert "peer=broker" in output, f"{kind}: no broker session lost"
        assert output.count(f"action={kind}.started") == 1, kind
    # The queue lives on: a survivor leads it, with its three members still listed.
    after = cluster.queue(survivors[0], settings.queue)
    assert after["leader"] in {node.name for node in survivors}
    assert sorted(after["members"]) == sorted(node.name for node in cluster.nodes)
    print(
        f"\n{ending} {first.name} at {at_kill}; all {total} committed, one refund each; "
        f"{verdict.duplicate_deliveries_suppressed} duplicate deliveries suppressed; "
        f"{retried} attempted again, each after proof the first never reached the provider; "
        f"new leader {after['leader']}"
    )
    for kind, output in outputs.items():
        for line in output.splitlines():
            if any(f"action={a}" in line for a in FAILOVER_ACTIONS) or "session_lost" in line:
                print(f"{kind}: {line}")
