"""The chaos run's numbers: how the run's daemons are configured, how the stream and the
schedule are paced, how long each fault lasts, and what the sandbox's tools do as the
run sets them. The schedule, the run, the faults and the report all read them here."""

from __future__ import annotations

from datetime import timedelta

from outbox.loading import load_registry

TOOLS_MODULE = "outbox.sandbox.tools"
REFUND_DEADLINE_SECONDS = 5.0
# The daemons' database bounds derive from it (outbox/connections.py): half of it is how
# long one of their transactions may take before its connection is cut.
LEASE_MARGIN_SECONDS = 3.0
# A dead-lettered message's operation is queued again this much later; a failed publish
# waits at most this long before the next try. Both far shorter than the defaults, so
# that every decision can settle within the liveness bound after the faults end.
REQUEUE_STALE_AFTER_SECONDS = 10.0
PUBLISH_RETRY_MAX_SECONDS = 2.0
# What a run may take besides its stream and its liveness bound: starting four daemons,
# rabbitmqctl calls, the checker, stopping and removing everything (generous: a busy
# machine runs each of them several times slower).
RUN_OVERHEAD_SECONDS = 120.0
# A consumer paused this long has outlived the lease of anything it held (deadline +
# margin), so another process must take over and the paused one wake up as a zombie.
STOP_SECONDS = REFUND_DEADLINE_SECONDS + LEASE_MARGIN_SECONDS + 1.5
# Decisions arrive over this many seconds per operation, at least MIN_STREAM_SECONDS,
# so the faults land while work is in every state rather than after it all settled.
STREAM_SECONDS_PER_OPERATION = 0.1
MIN_STREAM_SECONDS = 15.0
# One fault every this many seconds of stream, beyond the one of each kind.
FAULT_SPACING_SECONDS = 3.0
# A fault that found nothing to act on (the daemon was between connections, the broker
# already down, no refund in the provider's hands) is tried again this much later, this
# many times, but not past this long after the last decision: with no new work, a
# fault that needs some would wait in vain (a seed once spent 210 s of growing retries
# on a kill-in-effect that could no longer find a refund to hold).
FAULT_RETRY_SECONDS = 1.0
FAULT_RETRIES = 20
FAULT_RETRY_AFTER_STREAM_SECONDS = 10.0
# A fault waiting its turn (the CPU hogs and the broker's CLI calls take turns) waits at
# most this long past that, then is tried as any other.
TURN_SECONDS = 180.0
LOOP_SECONDS = 0.05
MAX_AMOUNT_CENTS = 49_999  # under the sandbox tool's approval threshold (50,000)

# How long each fault that lasts a while lasts.
BROKER_DOWN_SECONDS = 3.0
LINK_FAULT_SECONDS = 5.0
# Longer than the daemons' heartbeat timeout below, so the silent broker is noticed.
LINK_BLACKHOLE_SECONDS = 8.0
LINK_DELAY_PER_CHUNK_SECONDS = 0.05
AMQP_HEARTBEAT_SECONDS = 2
PROVIDER_FAULT_SECONDS = 5.0
PROVIDER_CONFLICT_PROBABILITY = 0.5
# A provider outage (#44): 503 to every call and lookup for one of these, drawn from the
# seed for each run (--provider-outage-seconds fixes it): over before a lease would be,
# long enough for every consumer to meet it, and longer than the refund tool's tolerance.
PROVIDER_OUTAGE_SECONDS = (5.0, 60.0, 300.0)
# The refund tool's outage_tolerance in the run's daemons (OUTBOX_SANDBOX_OUTAGE_TOLERANCE):
# between the minute and the five minutes, so that the one outage must be waited out and
# the other ends with a person (the contract's 15 minutes would make every outage a wait).
OUTAGE_TOLERANCE_SECONDS = 120.0
# A rate limit: 429 to every 2nd call and lookup, each asking for this many seconds.
RATE_LIMIT_EVERY = 2
RATE_LIMIT_RETRY_AFTER_SECONDS = 2
# Keys older than this are forgotten while the fault lasts: longer than any lease here,
# so only a runtime that re-sends long after an effect (a blind retry) pays for it, with
# a second refund at the ledger.
PRUNE_KEYS_OLDER_THAN_SECONDS = 3 * STOP_SECONDS
# Killing a consumer between the provider's commit and the outcome record: the provider
# holds committed refunds' responses this long, and the harness waits this long for one.
HOLD_RESPONSE_MS = 4_000
HOLD_WAIT_SECONDS = 3.0

# The daemons' application and connection names (dispatcher/daemon.py and
# consumer/worker.py); spelled out because the base package never imports the daemons.
APPLICATION_NAMES = {"dispatcher": "outbox-dispatcher", "consumer": "outbox-consumer"}
DAEMONS = ("dispatcher", "dispatcher", "consumer", "consumer")
# Which of each kind reaches the broker and the database through the proxies.
PROXIED_INDEX = 1
LINKS = ("broker", "database")

# Every this-many-th decision is an email (no lookup: its callback settles an unknown
# outcome, or a person); the others refunds.
EMAIL_EVERY = 5
# How long an email's unknown outcome waits for its delivery callback before a person
# gets it: longer than the webhook faults below hold one, well inside the liveness bound.
CALLBACK_WAIT_SECONDS = 15.0
WEBHOOK_DROP_EVERY = 2
WEBHOOK_FORGE_EVERY = 2
WEBHOOK_STALE_EVERY = 3
WEBHOOK_DUPLICATE_EVERY = 2
WEBHOOK_REORDER = 3
WEBHOOK_DELAY_MS = 2_000

# Overload (#22): how long the CPU hogs and the slow database last; the hogs per core
# (slot 0 and 1); the slow database's wait per chunk; the burst.
OVERLOAD_SECONDS = 10.0
CPU_HOGS_PER_CORE = (2, 4)
SLOW_DATABASE_SECONDS = (0.05, 0.5)
BURST_FACTOR = 3.0
# The share of the decisions the steady stream leaves to the bursts (split evenly among
# the schedule's bursts): a burst then always has decisions to record, even one that
# comes after the steady stream has ended.
BURST_SHARE = 0.2
# With overload on, no fault comes in the stream's first seconds: the quiet rate that
# recovery is judged against is measured then.
QUIET_SECONDS = 8.0
# How often the run counts what is recorded and settled (the goodput series).
SAMPLE_SECONDS = 0.5
# How long the run waits for its daemons to say they are healthy before the stream.
READY_SECONDS = 120.0


def liveness_bound() -> float:
    """Seconds after the faults end within which every decision must have settled:
    twice the refund tool's lease plus its whole reconcile budget (every lookup at its
    deadline, every backoff at its longest)."""
    from outbox.sandbox.tools import build_registry

    # The daemons run the tool with REFUND_DEADLINE_SECONDS (their environment says so).
    policy = build_registry().get("send_refund", 1).retry
    deadline = REFUND_DEADLINE_SECONDS
    lookups = sum(
        min(
            policy.initial_backoff.total_seconds() * policy.multiplier ** (n - 1),
            policy.max_backoff.total_seconds(),
        )
        * (1 + policy.jitter)
        + deadline
        for n in range(1, policy.reconcile_max_attempts + 1)
    )
    return 2 * (deadline + LEASE_MARGIN_SECONDS + lookups)


def outage_tolerances() -> dict[str, timedelta]:
    """How long each sandbox tool waits for its provider in the run's daemons: their
    contracts' own, but the refund tool's as the run sets it."""
    tolerances = {
        contract.name: contract.outage_tolerance for contract in load_registry([TOOLS_MODULE])
    }
    tolerances["send_refund"] = timedelta(seconds=OUTAGE_TOLERANCE_SECONDS)
    return tolerances


def tools_without_lookup() -> frozenset[str]:
    """The sandbox's writes that no lookup can find (their effects are emails)."""
    registry = load_registry([TOOLS_MODULE])
    return frozenset(
        name for name in ("send_refund", "send_email") if registry.get(name, 1).reconcile is None
    )
