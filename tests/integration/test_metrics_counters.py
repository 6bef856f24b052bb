"""What Prometheus sees of events: the counters and histograms on each daemon's
/metrics. A labelled counter that appears only with its first event is born at 1, and
rate() and increase() read that first event as 0; so every closed label set is exported
at 0 from the start. The closed sets are the code's own (tests/unit/test_metric_labels.py
checks that they hold every value the code reports)."""

from __future__ import annotations

import asyncio

from consumer.policy import AttemptOutcome
from consumer.telemetry import (
    DEAD_LETTER_REASONS,
    DELIVERY_RESULTS,
    ESCALATION_REASONS,
    RECONCILIATION_RESULTS,
)
from dispatcher.publisher import PUBLISH_FAILURE_REASONS
from outbox import Registry, Settings
from outbox.daemon import PEERS
from outbox.decisions import TAMPER_CHECKS

from support.consume_helpers import running_consumer
from support.dispatch_helpers import running_dispatcher
from support.scraping import Samples, label_sets, scrape, value


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
    assert label_sets(c, "outbox_effect_duration_seconds_count", "tool") == {
        (tool,) for tool in tools
    }
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
