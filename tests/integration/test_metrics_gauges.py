"""What Prometheus sees: each daemon's /metrics over HTTP, parsed as Prometheus parses it."""

from __future__ import annotations

import asyncio

import psycopg

from outbox import OperationState, Registry, Settings, record_decision

from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import record_many, running_dispatcher
from support.scraping import Samples, scrape
from support.waiting import eventually

S = OperationState
ALLOWED_LABELS = {"tool", "state", "outcome", "reason", "result", "peer", "check", "le"}


def operations_gauge(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["state"]: value
        for (name, labels), value in samples.items()
        if name == "outbox_operations"
    }


async def test_the_dispatcher_exports_operations_by_state_with_zeros(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 3)
    async with running_dispatcher(settings) as dispatcher:
        # The session refreshes the gauges as it starts; no consumer, so all stay prepared.
        async def counted() -> bool:
            by_state = operations_gauge(await asyncio.to_thread(scrape, dispatcher.metrics_port))
            return by_state.get("prepared") == 3.0

        await eventually(counted, within=10, what="3 prepared operations in the gauge")
        by_state = operations_gauge(await asyncio.to_thread(scrape, dispatcher.metrics_port))

    # Every state is exported, so an alert on one of them sees 0, not "no data".
    assert by_state == {str(state): (3.0 if state is S.PREPARED else 0.0) for state in S}


async def test_the_consumer_exports_attempts_and_deliveries(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    with psycopg.connect(database_url) as connection:
        operation_id = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 1250},
            run_id="run",
        ).operation.id
        connection.commit()
    async with (
        running_dispatcher(settings) as dispatcher,
        running_consumer(settings, registry) as consumer,
    ):
        await eventually(
            in_state(database_url, operation_id, S.COMMITTED), within=30, what="committed"
        )
        consumer_samples = await asyncio.to_thread(scrape, consumer.metrics_port)
        # Refreshed on a timer in the daemon; called here so the test need not wait 5 s.
        async with await psycopg.AsyncConnection.connect(database_url) as connection:
            await dispatcher.refresh_backlog(connection)
        dispatcher_samples = await asyncio.to_thread(scrape, dispatcher.metrics_port)

    attempts = ("outbox_effect_attempts_total", {"tool": "send_refund", "outcome": "committed"})
    deliveries = ("outbox_consumer_deliveries_total", {"result": "processed"})
    for name, labels in (attempts, deliveries):
        assert consumer_samples[(name, frozenset(labels.items()))] == 1.0
    assert operations_gauge(dispatcher_samples)["committed"] == 1.0
    assert operations_gauge(dispatcher_samples)["prepared"] == 0.0
    # Never an id among the labels, on either daemon.
    for samples in (consumer_samples, dispatcher_samples):
        for _, label_pairs in samples:
            assert {key for key, _ in label_pairs} <= ALLOWED_LABELS
