"""Three tools on three quorum queues (``OUTBOX_TOOL_QUEUES``), one consumer process
reading each: every decision ends committed with exactly one refund, each through its
tool's queue. On the local broker, then on a three-node RabbitMQ cluster on this
machine, each queue's leader on another node, and the node that leads one of them
killed mid-stream: nothing lost and nothing done twice.

Each queue is declared first through the node that is to lead it (the cluster places a
quorum queue's leader on the node its declaration came through), then ``outbox migrate
--broker`` runs as a deployment would and finds them there. One consumer reads each
queue (``OUTBOX_CONSUME_QUEUE``), connected first to that queue's leader; the
dispatcher is on the first node. The test kills the second node, which leads the
second tool's queue and holds that queue's consumer's connection.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import psycopg
import pytest
from pydantic import SecretStr

from harness.checker import check
from outbox import Settings, record_decision
from outbox.broker import Topology
from outbox.migrate import declare_broker_topology

from support.broker_helpers import message_count
from support.queue_tools import TOOLS, build_registry
from support.rabbit_cluster import Node, RabbitCluster, rabbit_cluster
from support.system import Daemon, System, running_system
from support.waiting import eventually_sync

pytestmark = pytest.mark.timeout(240)

TESTS = Path(__file__).resolve().parents[1]
BEFORE = 150  # recorded before the kill, fifty a tool
AFTER = 60  # recorded while the second tool's queue finds its new leader
KILL_AFTER_COMMITTED = 40


@pytest.fixture
def cluster() -> Iterator[RabbitCluster]:
    with rabbit_cluster(3) as started:
        yield started


def states(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        rows = connection.execute("SELECT state, count(*) FROM operations GROUP BY state")
        return {str(state): int(count) for state, count in rows}


def committed_per_tool(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT tool_name, count(*) FROM operations WHERE state = 'committed' "
            "GROUP BY tool_name"
        )
        return {str(tool): int(count) for tool, count in rows}


def record(database_url: str, count: int, *, run_id: str) -> None:
    """``count`` refunds, the three tools in turn, each decision committed at once."""
    registry = build_registry()
    with psycopg.connect(database_url) as connection:
        for n in range(count):
            with connection.transaction():
                record_decision(
                    connection,
                    registry,
                    TOOLS[n % len(TOOLS)],
                    {"payment_id": f"pay_{run_id}_{n}", "amount_cents": 100 + n},
                    run_id=run_id,
                    decision_key=f"call_{n}",
                )


async def declare_through(node: Node, queue: str, topology: Topology) -> None:
    """The queue declared through ``node``, which then leads it; arguments as migrate's."""
    connection = await aio_pika.connect(node.url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=topology.queue_arguments)


def grouped(settings: Settings, amqp_url: str) -> tuple[Settings, list[str]]:
    """``settings`` on ``amqp_url`` with a queue per tool, as deployed: `outbox migrate
    --broker` declares the topology, the daemons only check it is there."""
    queues = [f"{settings.queue}.{tool}" for tool in TOOLS]
    groups = ";".join(f"{queue}={tool}" for queue, tool in zip(queues, TOOLS, strict=True))
    update = {"amqp_url": SecretStr(amqp_url), "declare_topology": False, "tool_queues": groups}
    return settings.model_copy(update=update), queues


def start_daemons(system: System, queues: list[str], consumer_urls: list[str]) -> list[Daemon]:
    """The dispatcher, and one consumer for each queue (``consumer_urls[i]`` its broker
    addresses), running the three refund tools."""
    common = {
        **system.environment,
        "OUTBOX_TOOLS": "support.queue_tools",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(TESTS), system.environment.get("PYTHONPATH")])
        ),
    }
    daemons = [Daemon("dispatcher", common)]
    for queue, urls in zip(queues, consumer_urls, strict=True):
        environment = {**common, "OUTBOX_CONSUME_QUEUE": queue, "OUTBOX_AMQP_URL": urls}
        daemons.append(Daemon("consumer", environment))
    system.daemons.extend(daemons)
    for daemon in daemons:
        daemon.wait_for_line("session ready", within=60)
    return daemons


def committed(system: System, daemons: list[Daemon], count: int, *, within: float) -> None:
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


def one_refund_each(system: System, total: int) -> int:
    """Every decision committed with one refund, a third of them each tool's; the
    duplicate deliveries the consumers suppressed."""
    assert states(system.database_url) == {"committed": total}
    assert committed_per_tool(system.database_url) == dict.fromkeys(TOOLS, total // len(TOOLS))
    verdict = check(system.database_url, total, system.provider)
    assert verdict.held, verdict.examples
    assert (verdict.effects, verdict.lost, verdict.duplicate_effects) == (total, 0, 0)
    refunds = system.provider.ledger()["refunds_by_key"]
    assert len(refunds) == total
    assert set(refunds.values()) == {1}
    assert verdict.blind_retries == 0, verdict.examples
    return verdict.duplicate_deliveries_suppressed


def test_three_consumers_each_read_their_tools_queue_and_every_decision_commits_once(
    settings: Settings, amqp_server_url: str
) -> None:
    local, queues = grouped(settings, amqp_server_url)
    asyncio.run(declare_broker_topology(local))
    total = 60
    with running_system(local, refund_deadline=10.0) as system:
        daemons = start_daemons(system, queues, [amqp_server_url] * len(queues))
        record(system.database_url, total, run_id="local")
        committed(system, daemons, total, within=60)
        outputs = [daemon.output() for daemon in daemons]
    one_refund_each(system, total)
    # Each consumer took deliveries from its own queue only: the default queue is empty
    # and no consumer was told of a tool it was not given.
    assert asyncio.run(message_count(amqp_server_url, local.queue)) == 0
    for output in outputs:
        assert "unknown_tool" not in output


@pytest.mark.rabbit_cluster
def test_three_tools_on_three_queues_lose_and_repeat_nothing_when_a_leaders_node_dies(
    settings: Settings, cluster: RabbitCluster
) -> None:
    clustered, queues = grouped(settings, cluster.amqp_url)
    topology = Topology.from_settings(clustered)
    for node, queue in zip(cluster.nodes, queues, strict=True):
        asyncio.run(declare_through(node, queue, topology))
    asyncio.run(declare_broker_topology(clustered))
    first, second, third = cluster.nodes
    leaders = [cluster.queue(first, queue)["leader"] for queue in queues]
    assert leaders == [node.name for node in cluster.nodes]
    victim, victims_queue = second, queues[1]

    with running_system(clustered, refund_deadline=10.0) as system:
        # Each consumer connects first to its queue's leader: the consumer of the second
        # queue loses its connection and its queue's leader at once. The dispatcher is
        # on the first node.
        daemons = start_daemons(
            system,
            queues,
            [
                ",".join(node.url for node in cluster.nodes[i:] + cluster.nodes[:i])
                for i in range(len(queues))
            ],
        )

        record(system.database_url, BEFORE, run_id="before")
        committed(system, daemons, KILL_AFTER_COMMITTED, within=60)
        at_kill = states(system.database_url)
        cluster.kill(victim)
        record(system.database_url, AFTER, run_id="after")

        total = BEFORE + AFTER
        committed(system, daemons, total, within=120)
        for daemon in daemons:
            assert daemon.running(), f"the {daemon.kind} exited:\n{daemon.tail()}"
        outputs = [daemon.output() for daemon in daemons]

    assert at_kill.get("committed", 0) < BEFORE, at_kill
    suppressed = one_refund_each(system, total)
    # The second queue's consumer lost its node and carried on against a survivor.
    assert "peer=broker" in outputs[2], outputs[2][-3000:]
    after = cluster.queue(first, victims_queue)
    assert after["leader"] in {first.name, third.name}
    print(
        f"\nkilled {victim.name} (leader of {victims_queue}) at {at_kill}; all {total} "
        f"committed, one refund each, {committed_per_tool(system.database_url)}; "
        f"{suppressed} duplicate deliveries suppressed; "
        f"new leader {after['leader']}"
    )
