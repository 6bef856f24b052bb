"""Every Prometheus metric effect-outbox exports, in one place, behind one prefix.

Labels are tool, provider, state, outcome, result, reason, check, peer, queue, column,
verdict, limit and version: bounded sets (a provider is named by a contract). Never
ids, never inputs. Each daemon builds its metrics on its own ``CollectorRegistry`` so
tests can run several in one process; each registry also
carries the process and platform collectors (CPU, memory, file descriptors, the Python
version) and ``outbox_build_info``.

A labelled counter exports nothing until its first event, and Prometheus then sees a
series born at 1: ``rate()`` and ``increase()`` read that first event as 0, so the first
dead letter or tampered row would never reach an alert. Each daemon therefore calls
:func:`prime` at start for every closed set of label values it can report.
"""

from __future__ import annotations

import importlib.metadata
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

PREFIX = "outbox"

# Commit-to-confirm is milliseconds when healthy; the tail matters up to the poll interval
# and beyond (a broker outage).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 200, 500, 1000, 2000, 5000)
# From a decision to its outcome: milliseconds when all is well (the README's p50 18 ms),
# minutes behind a backlog or a retry's backoff, up to an hour when lookups settle it.
# Between one and fifteen minutes each bound is at most 1.25 times the one before:
# histogram_quantile interpolates inside a bucket, and with 300 s and 900 s alone its
# p90 and p99 read 40-60% over the rows' (tests/unit/test_decision_buckets.py keeps
# them within 10%).
DECISION_MINUTES_BUCKETS = (
    80.0,
    100.0,
    125.0,
    150.0,
    180.0,
    220.0,
    270.0,
    330.0,
    400.0,
    480.0,
    600.0,
    750.0,
    900.0,
)
DECISION_BUCKETS = (*LATENCY_BUCKETS[2:], *DECISION_MINUTES_BUCKETS, 1800.0, 3600.0)

# The queues whose depth the dispatcher exports, by role: label values, never names.
QUEUES = ("operations", "dead_letter")


class MetricNames:
    DISPATCHER_BACKLOG = f"{PREFIX}_dispatcher_backlog_rows"
    DISPATCHER_OLDEST_PENDING_AGE = f"{PREFIX}_dispatcher_oldest_pending_age_seconds"
    DISPATCHER_PUBLISHED = f"{PREFIX}_dispatcher_published"
    DISPATCHER_PUBLISH_FAILURES = f"{PREFIX}_dispatcher_publish_failures"
    DISPATCHER_BATCH_SIZE = f"{PREFIX}_dispatcher_batch_size"
    DISPATCHER_EMPTY_CLAIMS = f"{PREFIX}_dispatcher_empty_claims"
    DISPATCHER_COMMIT_TO_CONFIRM = f"{PREFIX}_dispatcher_commit_to_confirm_seconds"
    DISPATCHER_RETENTION_DELETED = f"{PREFIX}_dispatcher_retention_deleted_rows"
    DISPATCHER_RECONNECTS = f"{PREFIX}_dispatcher_reconnects"
    CONSUMER_DELIVERIES = f"{PREFIX}_consumer_deliveries"
    CONSUMER_DEAD_LETTERED = f"{PREFIX}_consumer_dead_lettered"
    EFFECT_ATTEMPTS = f"{PREFIX}_effect_attempts"
    EFFECT_DURATION = f"{PREFIX}_effect_duration_seconds"
    RECONCILIATIONS = f"{PREFIX}_reconciliations"
    ESCALATIONS = f"{PREFIX}_escalations"
    CONSUMER_RECONNECTS = f"{PREFIX}_consumer_reconnects"
    TAMPERED = f"{PREFIX}_consumer_tampered"
    UNREADABLE = f"{PREFIX}_consumer_unreadable"
    DECISION_TO_OUTCOME = f"{PREFIX}_decision_to_outcome_seconds"
    OLDEST_READY_OPERATION_AGE = f"{PREFIX}_oldest_ready_operation_age_seconds"
    OPERATIONS_AWAITING_APPROVAL = f"{PREFIX}_operations_awaiting_approval"
    OPERATIONS = f"{PREFIX}_operations"
    QUEUE_MESSAGES = f"{PREFIX}_queue_messages"
    BROKER_CONNECTED = f"{PREFIX}_broker_connected"
    DATABASE_FAILOVERS = f"{PREFIX}_database_failovers"
    BUILD_INFO = f"{PREFIX}_build_info"
    CALLBACKS_RECEIVED = f"{PREFIX}_callbacks_received"
    CALLBACKS_DUPLICATES = f"{PREFIX}_callbacks_duplicates"
    CALLBACKS_REFUSED = f"{PREFIX}_callbacks_refused"
    CALLBACKS_UNMATCHED = f"{PREFIX}_callbacks_unmatched"
    CALLBACKS_IGNORED = f"{PREFIX}_callbacks_ignored"
    CALLBACKS_APPLIED = f"{PREFIX}_callbacks_applied"
    CALLBACKS_CONTRADICTED = f"{PREFIX}_callbacks_contradicted"
    DATABASE_SLOW_TRANSACTIONS = f"{PREFIX}_database_slow_transactions"
    DATABASE_LOCK_WAITS = f"{PREFIX}_database_lock_waits"
    CONSUMER_LIMIT = f"{PREFIX}_consumer_limit"
    CONSUMER_DELIVERIES_HELD = f"{PREFIX}_consumer_deliveries_held"
    DISPATCHER_LIMIT = f"{PREFIX}_dispatcher_limit"
    PROVIDER_AVAILABLE = f"{PREFIX}_provider_available"
    PROVIDER_WAITING_OPERATIONS = f"{PREFIX}_provider_waiting_operations"
    PROVIDER_OUTAGES = f"{PREFIX}_provider_outages"


def prime(metric: Counter | Histogram, *values: Iterable[str]) -> None:
    """Export every combination of ``values`` (one iterable per label, in label order)
    at 0 now, before its first event."""
    for combination in itertools.product(*values):
        metric.labels(*combination)


def version() -> str:
    try:
        return importlib.metadata.version("effect-outbox")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def _about_the_process(registry: CollectorRegistry) -> None:
    """What every serving process exports about itself: process and platform, and the
    version."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge(
        MetricNames.BUILD_INFO,
        "The running effect-outbox version (always 1)",
        ["version"],
        registry=registry,
    ).labels(version()).set(1)


def _slow_transactions(registry: CollectorRegistry) -> Counter:
    """What both daemons export about transactions past their soft deadline."""
    return Counter(
        MetricNames.DATABASE_SLOW_TRANSACTIONS,
        "Transactions past their soft deadline (OUTBOX_DB_TRANSACTION_TIMEOUT), by verdict: "
        "working (the server was working on it: it ran on), silent (no answer: cut), "
        "overran (still running at the hard deadline: cut)",
        ["verdict"],
        registry=registry,
    )


def _lock_waits(registry: CollectorRegistry) -> Counter:
    # Unlabelled, so exported at 0 from the start: the first wait is an increase.
    return Counter(
        MetricNames.DATABASE_LOCK_WAITS,
        "Transactions of this daemon found waiting for a lock another session holds, "
        "1 s in (the log names that session: action=*.lock_wait)",
        registry=registry,
    )


def _database_failovers(registry: CollectorRegistry) -> Counter:
    # Unlabelled, so exported at 0 from the start: the first failover is an increase.
    return Counter(
        MetricNames.DATABASE_FAILOVERS,
        "Times this daemon's new database connections reached another server than the "
        "last ones (a failover: libpq's multi-host URL or a moved address)",
        registry=registry,
    )


def _about_the_daemon(registry: CollectorRegistry) -> Gauge:
    """What both daemons export about themselves: :func:`_about_the_process`, and
    (returned) whether they hold a broker session."""
    _about_the_process(registry)
    return Gauge(
        MetricNames.BROKER_CONNECTED,
        "1 while this daemon holds a RabbitMQ session, 0 while it has none",
        registry=registry,
    )


@dataclass(frozen=True)
class DispatcherMetrics:
    registry: CollectorRegistry
    broker_connected: Gauge
    backlog: Gauge
    oldest_pending_age: Gauge
    published: Counter
    publish_failures: Counter
    batch_size: Histogram
    empty_claims: Counter
    commit_to_confirm: Histogram
    retention_deleted: Counter
    reconnects: Counter
    database_failovers: Counter
    operations: Gauge
    queue_messages: Gauge
    slow_transactions: Counter
    lock_waits: Counter
    limit: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> DispatcherMetrics:
        registry = registry or CollectorRegistry()
        names = MetricNames
        return cls(
            registry=registry,
            broker_connected=_about_the_daemon(registry),
            slow_transactions=_slow_transactions(registry),
            lock_waits=_lock_waits(registry),
            limit=Gauge(
                names.DISPATCHER_LIMIT,
                "The dispatcher's current backpressure limit: batch (rows claimed per "
                "batch), narrowed when batches overrun or the broker is slow, widened again "
                "when they keep up",
                ["limit"],
                registry=registry,
            ),
            backlog=Gauge(
                names.DISPATCHER_BACKLOG,
                "Outbox rows not yet published (read from Postgres every few seconds)",
                registry=registry,
            ),
            oldest_pending_age=Gauge(
                names.DISPATCHER_OLDEST_PENDING_AGE,
                "Age of the oldest unpublished outbox row, 0 when none",
                registry=registry,
            ),
            published=Counter(
                names.DISPATCHER_PUBLISHED,
                "Outbox rows published and confirmed by the broker",
                ["tool"],
                registry=registry,
            ),
            publish_failures=Counter(
                names.DISPATCHER_PUBLISH_FAILURES,
                "Publishes that failed; the row stays pending and is retried after a backoff",
                ["reason"],
                registry=registry,
            ),
            batch_size=Histogram(
                names.DISPATCHER_BATCH_SIZE,
                "Rows claimed per batch",
                buckets=BATCH_BUCKETS,
                registry=registry,
            ),
            empty_claims=Counter(
                names.DISPATCHER_EMPTY_CLAIMS,
                "Claims that found no pending row: a wake-up that cost a transaction and "
                "published nothing",
                registry=registry,
            ),
            commit_to_confirm=Histogram(
                names.DISPATCHER_COMMIT_TO_CONFIRM,
                "From the outbox row's commit to the broker's confirm, failed publishes and "
                "their backoff included",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            retention_deleted=Counter(
                names.DISPATCHER_RETENTION_DELETED,
                "Published outbox rows deleted after the retention period",
                registry=registry,
            ),
            reconnects=Counter(
                names.DISPATCHER_RECONNECTS,
                "Sessions restarted after losing Postgres or RabbitMQ",
                ["peer"],
                registry=registry,
            ),
            database_failovers=_database_failovers(registry),
            # Only the dispatcher exports it: one exporter per database, so a sum over
            # scrape targets does not count every operation once per consumer replica.
            operations=Gauge(
                names.OPERATIONS,
                "Operations by state (refreshed with the backlog, every few seconds)",
                ["state"],
                registry=registry,
            ),
            # The dispatcher's too, so a depth is seen while every consumer is down;
            # NaN until read, and while the broker session is away.
            queue_messages=Gauge(
                names.QUEUE_MESSAGES,
                "Messages ready in a queue: operations (the work queue) or dead_letter",
                ["queue"],
                registry=registry,
            ),
        )


@dataclass(frozen=True)
class ConsumerMetrics:
    registry: CollectorRegistry
    broker_connected: Gauge
    deliveries: Counter
    dead_lettered: Counter
    effect_attempts: Counter
    effect_duration: Histogram
    reconciliations: Counter
    escalations: Counter
    reconnects: Counter
    database_failovers: Counter
    tampered: Counter
    unreadable: Counter
    decision_to_outcome: Histogram
    oldest_ready_age: Gauge
    awaiting_approval: Gauge
    callbacks_applied: Counter
    callbacks_contradicted: Counter
    slow_transactions: Counter
    lock_waits: Counter
    limit: Gauge
    deliveries_held: Counter
    provider_available: Gauge
    provider_waiting: Gauge
    provider_outages: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ConsumerMetrics:
        registry = registry or CollectorRegistry()
        names = MetricNames
        return cls(
            registry=registry,
            broker_connected=_about_the_daemon(registry),
            slow_transactions=_slow_transactions(registry),
            lock_waits=_lock_waits(registry),
            limit=Gauge(
                names.CONSUMER_LIMIT,
                "The consumer's current backpressure limits: prefetch (deliveries in hand "
                "and a claim's burst) and reconcile_batch, narrowed on deadline hits and slow "
                "commits, widened again when the database keeps up",
                ["limit"],
                registry=registry,
            ),
            deliveries_held=Counter(
                names.CONSUMER_DELIVERIES_HELD,
                "Tries of a delivery kept unacknowledged in hand because the database was "
                "away or too slow (retried with backoff, never sent back to the queue)",
                registry=registry,
            ),
            deliveries=Counter(
                names.CONSUMER_DELIVERIES,
                "Messages handled, by result: processed, duplicate, invalid, awaiting_approval, "
                "tampered, escalated, retry_later (the database was away or too slow: the "
                "message comes back)",
                ["result"],
                registry=registry,
            ),
            dead_lettered=Counter(
                names.CONSUMER_DEAD_LETTERED,
                "Messages rejected to the dead-letter queue without any effect",
                ["reason"],
                registry=registry,
            ),
            effect_attempts=Counter(
                names.EFFECT_ATTEMPTS,
                "Calls of a tool's execute, by outcome",
                ["tool", "outcome"],
                registry=registry,
            ),
            effect_duration=Histogram(
                names.EFFECT_DURATION,
                "Time a tool's execute took",
                ["tool"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            reconciliations=Counter(
                names.RECONCILIATIONS,
                "Unknown outcomes looked up, by result",
                ["tool", "result"],
                registry=registry,
            ),
            escalations=Counter(
                names.ESCALATIONS,
                "Operations handed to a person, by reason",
                ["tool", "reason"],
                registry=registry,
            ),
            reconnects=Counter(
                names.CONSUMER_RECONNECTS,
                "Broker sessions lost after they were established (failed connects are not "
                "counted: see outbox_broker_connected)",
                registry=registry,
            ),
            database_failovers=_database_failovers(registry),
            tampered=Counter(
                names.TAMPERED,
                "Operations whose stored row disagrees with what the consumer derives from "
                "its input and contract: never executed, escalated; by the check that failed",
                ["tool", "check"],
                registry=registry,
            ),
            unreadable=Counter(
                names.UNREADABLE,
                "Stored values no reader may parse (too large, too deep, malformed): the "
                "operation is never executed, it is escalated; by tool and column",
                ["tool", "column"],
                registry=registry,
            ),
            decision_to_outcome=Histogram(
                names.DECISION_TO_OUTCOME,
                "From the decision's commit to the outcome the consumer recorded (committed "
                "or rejected), by the database's clock",
                ["tool"],
                buckets=DECISION_BUCKETS,
                registry=registry,
            ),
            # Every consumer replica reads the same tables: aggregate with max().
            oldest_ready_age=Gauge(
                names.OLDEST_READY_OPERATION_AGE,
                "How long the oldest operation ready to execute (prepared, due, its message "
                "published, not waiting for an approval) has waited; 0 when none",
                registry=registry,
            ),
            awaiting_approval=Gauge(
                names.OPERATIONS_AWAITING_APPROVAL,
                "Prepared operations the consumer parked for a person's approval: its wait "
                "(or a denial, within the grace before they end rejected) is their latest "
                "event. Not outbox approvals pending, which lists what a person may decide",
                registry=registry,
            ),
            callbacks_applied=Counter(
                names.CALLBACKS_APPLIED,
                "Provider callbacks the reconciler applied, by what they came to: settled, "
                "retry, confirmed, evidence, contradicted",
                ["tool", "outcome"],
                registry=registry,
            ),
            callbacks_contradicted=Counter(
                names.CALLBACKS_CONTRADICTED,
                "Provider callbacks that disagree with how their operation ended (a success "
                "for a rejected or prepared operation, another reference, a failure after "
                "success): an effect nobody accounts for",
                ["tool"],
                registry=registry,
            ),
            # Every consumer reads the same breaker row: aggregate with min() and max().
            provider_available=Gauge(
                names.PROVIDER_AVAILABLE,
                "1 while the provider's breaker is closed (its calls go through), 0 while it "
                "is open or half-open: its operations wait and spend no budget",
                ["provider"],
                registry=registry,
            ),
            provider_waiting=Gauge(
                names.PROVIDER_WAITING_OPERATIONS,
                "Operations waiting for their provider (prepared or unknown, held back by "
                "its breaker, its Retry-After or calls that got no answer)",
                ["provider"],
                registry=registry,
            ),
            provider_outages=Counter(
                names.PROVIDER_OUTAGES,
                "Times this consumer's failure opened a provider's breaker",
                ["provider"],
                registry=registry,
            ),
        )


@dataclass(frozen=True)
class CallbackMetrics:
    """What `outbox callbacks serve` exports (labels: provider, status, reason, payload;
    provider names come from the contracts, never from a request)."""

    registry: CollectorRegistry
    received: Counter
    duplicates: Counter
    refused: Counter
    unmatched: Counter
    ignored: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> CallbackMetrics:
        registry = registry or CollectorRegistry()
        _about_the_process(registry)
        names = MetricNames
        return cls(
            registry=registry,
            received=Counter(
                names.CALLBACKS_RECEIVED,
                "Verified provider callbacks recorded in the inbox for the first time (the "
                "unmatched ones included), by what they report",
                ["provider", "status"],
                registry=registry,
            ),
            duplicates=Counter(
                names.CALLBACKS_DUPLICATES,
                "Verified callbacks whose event id the inbox already held: answered 2xx, "
                "nothing changed; payload says whether the body was the same",
                ["provider", "payload"],
                registry=registry,
            ),
            refused=Counter(
                names.CALLBACKS_REFUSED,
                "Callbacks refused before anything was recorded, by reason: signature "
                "(forged, another secret, malformed header), timestamp (outside the replay "
                "window), too_large, malformed",
                ["provider", "reason"],
                registry=registry,
            ),
            unmatched=Counter(
                names.CALLBACKS_UNMATCHED,
                "Verified callbacks that name no operation of this database: kept, listed "
                "by `outbox callbacks list --unmatched`",
                ["provider"],
                registry=registry,
            ),
            ignored=Counter(
                names.CALLBACKS_IGNORED,
                "Verified callbacks about no effect (events the provider's reader does not "
                "map): answered 2xx, not recorded",
                ["provider"],
                registry=registry,
            ),
        )
