"""What Prometheus sees of events: the counters and histograms on each daemon's
/metrics. A labelled counter that appears only with its first event is born at 1, and
rate() and increase() read that first event as 0; so every closed label set is exported
at 0 from the start. The closed sets are the code's own (tests/unit/test_metric_labels.py
checks that they hold every value the code reports)."""

from __future__ import annotations

import asyncio
import importlib.metadata

import psycopg
import pytest
from pydantic import SecretStr

from consumer.policy import AttemptOutcome
from consumer.telemetry import (
    DEAD_LETTER_REASONS,
    DELIVERY_RESULTS,
    ESCALATION_REASONS,
    RECONCILIATION_RESULTS,
)
from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from dispatcher.publisher import PUBLISH_FAILURE_REASONS
from harness.proxy import tcp_proxy_for, url_through
from outbox import OperationState, Registry, Settings
from outbox.daemon import PEERS
from outbox.intent import TAMPER_CHECKS

from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import counter_value, record_many, record_one, running_dispatcher
from support.logs import records_of
from support.ports import closed_port
from support.sample_tools import Ledger
from support.scraping import Samples, label_sets, scrape, value
from support.waiting import eventually

S = OperationState


def backdate(database_url: str, statement: str) -> None:
    """As the test's superuser, triggers off: rows as an hour of history left them."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(statement)
        connection.commit()


def pairs(tools: set[str], values: set[str]) -> set[tuple[str, ...]]:
    return {(tool, found) for tool in tools for found in values}


def all_zero(samples: Samples, *names: str) -> bool:
    return all(found == 0.0 for (sample, _), found in samples.items() if sample in names)


async def test_every_closed_label_set_is_exported_at_zero_before_the_first_event(
    settings: Settings, registry: Registry
) -> None:
    async with (
        running_dispatcher(settings) as dispatcher,
        running_consumer(settings, registry) as consumer,
    ):
        consumer_samples = await asyncio.to_thread(scrape, consumer.metrics_port)
        dispatcher_samples = await asyncio.to_thread(scrape, dispatcher.metrics_port)

    tools = {contract.name for contract in registry}
    looked_up = {contract.name for contract in registry if contract.reconcile is not None}
    c, d = consumer_samples, dispatcher_samples
    assert label_sets(c, "outbox_consumer_dead_lettered_total", "reason") == {
        (reason,) for reason in DEAD_LETTER_REASONS
    }
    assert label_sets(c, "outbox_consumer_deliveries_total", "result") == {
        (result,) for result in DELIVERY_RESULTS
    }
    assert label_sets(c, "outbox_consumer_tampered_total", "tool", "check") == pairs(
        tools, set(TAMPER_CHECKS)
    )
    assert label_sets(c, "outbox_effect_attempts_total", "tool", "outcome") == pairs(
        tools, {str(outcome) for outcome in AttemptOutcome}
    )
    assert label_sets(c, "outbox_reconciliations_total", "tool", "result") == pairs(
        looked_up, set(RECONCILIATION_RESULTS)
    )
    assert label_sets(c, "outbox_escalations_total", "tool", "reason") == pairs(
        tools, set(ESCALATION_REASONS)
    )
    for histogram in ("outbox_effect_duration_seconds", "outbox_decision_to_outcome_seconds"):
        assert label_sets(c, f"{histogram}_count", "tool") == {(tool,) for tool in tools}
    assert value(c, "outbox_consumer_reconnects_total") == 0.0
    assert label_sets(d, "outbox_dispatcher_publish_failures_total", "reason") == {
        (reason,) for reason in PUBLISH_FAILURE_REASONS
    }
    assert label_sets(d, "outbox_dispatcher_reconnects_total", "peer") == {
        (peer,) for peer in PEERS
    }
    assert all_zero(
        c,
        "outbox_consumer_dead_lettered_total",
        "outbox_consumer_deliveries_total",
        "outbox_consumer_tampered_total",
        "outbox_effect_attempts_total",
        "outbox_reconciliations_total",
        "outbox_escalations_total",
    )
    assert all_zero(
        d, "outbox_dispatcher_publish_failures_total", "outbox_dispatcher_reconnects_total"
    )


async def test_connect_attempts_that_fail_are_not_counted_as_reconnects(
    settings: Settings, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    consumer = Consumer(settings.model_copy(update={"amqp_url": SecretStr(unreachable)}), registry)
    task = asyncio.create_task(consumer.run())
    try:

        async def tried_three_times() -> bool:
            return len(records_of(caplog, "consumer.session_lost")) >= 3

        await eventually(tried_three_times, within=20, what="three failed broker connects")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, timeout=20)

    # The counter's meaning, as the dispatcher's: sessions lost, not connect attempts.
    assert counter_value(consumer, "outbox_consumer_reconnects_total") == 0.0


async def test_a_lost_broker_session_is_one_reconnect_for_either_daemon(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    async with tcp_proxy_for(amqp_server_url, 5672) as proxy:
        through = settings.model_copy(
            update={"amqp_url": SecretStr(url_through(amqp_server_url, proxy.port))}
        )
        async with (
            running_dispatcher(through) as dispatcher,
            running_consumer(through, registry) as consumer,
        ):
            assert proxy.cut() == 2
            # Something to publish and execute: both must have a session again for it.
            operation_id = record_one(database_url, registry)
            await eventually(
                in_state(database_url, operation_id, S.COMMITTED),
                within=30,
                what="committed after both reconnected",
            )
            reconnects = (
                counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="broker"),
                counter_value(consumer, "outbox_consumer_reconnects_total"),
            )

    assert reconnects == (1.0, 1.0)


async def test_publish_latency_counts_from_the_decision_not_from_the_last_failed_publish(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 1)
    # A row whose publishes failed for an hour: written then, available again only now.
    backdate(
        database_url,
        "UPDATE outbox SET created_at = now() - interval '1 hour', available_at = now(), "
        "publish_attempts = 12, last_error = 'unroutable: broker returned the message'",
    )
    dispatcher = Dispatcher(settings)

    report = await dispatcher.drain()

    assert report.published == 1
    name = "outbox_dispatcher_commit_to_confirm_seconds"
    assert counter_value(dispatcher, f"{name}_count") == 1.0
    assert counter_value(dispatcher, f"{name}_sum") >= 3600


async def test_the_time_from_decision_to_outcome_is_observed_per_tool(
    settings: Settings, registry: Registry, ledger: Ledger, database_url: str
) -> None:
    # Two decisions made an hour ago: one will be refused, one confirmed.
    record_one(database_url, registry, payment_id="pay_1")
    record_one(database_url, registry, payment_id="pay_2")
    backdate(database_url, "UPDATE operations SET created_at = now() - interval '1 hour'")
    ledger.faults = ["reject"]
    async with (
        running_dispatcher(settings),
        running_consumer(settings, registry) as consumer,
    ):

        async def both_recorded() -> bool:
            return (
                counter_value(
                    consumer, "outbox_decision_to_outcome_seconds_count", tool="send_refund"
                )
                == 2.0
            )

        await eventually(both_recorded, within=30, what="two outcomes observed")

    total = counter_value(consumer, "outbox_decision_to_outcome_seconds_sum", tool="send_refund")
    assert total >= 2 * 3600
    assert (
        counter_value(
            consumer, "outbox_effect_attempts_total", tool="send_refund", outcome="rejected"
        )
        == 1.0
    )


async def test_both_daemons_export_process_platform_and_build_information(
    settings: Settings, registry: Registry
) -> None:
    async with (
        running_dispatcher(settings) as dispatcher,
        running_consumer(settings, registry) as consumer,
    ):
        scrapes = [
            await asyncio.to_thread(scrape, daemon.metrics_port)
            for daemon in (dispatcher, consumer)
        ]

    version = importlib.metadata.version("effect-outbox")
    for samples in scrapes:
        assert value(samples, "outbox_build_info", version=version) == 1.0
        resident = value(samples, "process_resident_memory_bytes")
        assert resident is not None
        assert resident > 0
        assert value(samples, "process_cpu_seconds_total") is not None
        assert label_sets(samples, "python_info", "implementation") == {("CPython",)}
