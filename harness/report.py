"""What a chaos run prints: the counts of the faults it injected, the checker's verdict
line by line, a sweep's one-line summary per run."""

from __future__ import annotations

from dataclasses import dataclass

from harness.checker import Verdict
from harness.parameters import OUTAGE_TOLERANCE_SECONDS


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Tally:
    dispatcher_kills: int = 0
    consumer_kills: int = 0  # every SIGKILL of a consumer, the in-effect ones included
    consumer_kills_in_effect: int = 0
    consumer_stops: int = 0
    broker_restarts: int = 0
    broker_connection_closes: int = 0
    db_connection_kills: int = 0
    link_delays: int = 0
    link_blackholes: int = 0
    link_cuts: int = 0
    provider_conflict_windows: int = 0
    lookup_outages: int = 0
    key_prunings: int = 0
    provider_outages: int = 0
    rate_limit_windows: int = 0
    cpu_starvations: int = 0
    slow_databases: int = 0
    decision_bursts: int = 0
    webhook_drop_windows: int = 0
    webhook_forge_windows: int = 0
    webhook_duplicate_windows: int = 0
    webhook_delay_windows: int = 0
    unplanned_exits: int = 0
    faults_that_found_nothing: int = 0


def report(
    verdict: Verdict, tally: Tally, drain_s: float | None, timings: dict[str, float]
) -> None:
    say(
        f"decisions={verdict.decisions} effects={verdict.effects} rejected={verdict.rejected} "
        f"escalated={verdict.escalated} lost={verdict.lost} "
        f"duplicate_effects={verdict.duplicate_effects}"
    )
    say(
        f"duplicate_deliveries_suppressed={verdict.duplicate_deliveries_suppressed} "
        f"outcome_unknown_opened={verdict.outcome_unknown_opened} "
        f"reconciled={verdict.reconciled} blind_retries={verdict.blind_retries}"
    )
    say(
        f"dispatcher_kills={tally.dispatcher_kills} consumer_kills={tally.consumer_kills} "
        f"broker_restarts={tally.broker_restarts} "
        f"db_connection_kills={tally.db_connection_kills} "
        f"drain_s={'timeout' if drain_s is None else f'{drain_s:.1f}'} "
        f"settle_s={_seconds(verdict.settle_s)}"
    )
    say(
        f"consumer_kills_in_effect={tally.consumer_kills_in_effect} "
        f"consumer_stops={tally.consumer_stops} "
        f"broker_connection_closes={tally.broker_connection_closes} "
        f"link_delays={tally.link_delays} link_blackholes={tally.link_blackholes} "
        f"link_cuts={tally.link_cuts} "
        f"provider_conflict_windows={tally.provider_conflict_windows} "
        f"lookup_outages={tally.lookup_outages} key_prunings={tally.key_prunings} "
        f"provider_outages={tally.provider_outages} "
        f"rate_limit_windows={tally.rate_limit_windows} "
        f"longest_outage_s={verdict.provider_outage_s:.1f} "
        f"outage_tolerance_s={OUTAGE_TOLERANCE_SECONDS:g}"
    )
    say(
        f"illegal_sequences={verdict.illegal_sequences} "
        f"in_flight_past_lease={verdict.in_flight_past_lease} "
        f"committed_without_one_refund={verdict.committed_without_one_refund} "
        f"refunds_without_an_effect_state={verdict.refunds_without_an_effect_state} "
        f"unplanned_exits={tally.unplanned_exits} "
        f"faults_that_found_nothing={tally.faults_that_found_nothing}"
    )
    say(
        f"cpu_starvations={tally.cpu_starvations} slow_databases={tally.slow_databases} "
        f"decision_bursts={tally.decision_bursts} "
        f"webhook_drop_windows={tally.webhook_drop_windows} "
        f"webhook_forge_windows={tally.webhook_forge_windows} "
        f"webhook_duplicate_windows={tally.webhook_duplicate_windows} "
        f"webhook_delay_windows={tally.webhook_delay_windows}"
    )
    say(
        f"contradictions={verdict.contradictions} "
        f"settled_by_callback={verdict.settled_by_callback} "
        f"retried_by_callback={verdict.retried_by_callback} "
        f"callbacks_unapplied={verdict.callbacks_unapplied} "
        f"callbacks_unmatched={verdict.callbacks_unmatched} "
        f"committed_without_one_email={verdict.committed_without_one_email} "
        f"emails_without_an_effect_state={verdict.emails_without_an_effect_state}"
    )
    quiet = "-" if verdict.quiet_rate is None else f"{verdict.quiet_rate:.1f}"
    say(
        f"undeliverable={verdict.undeliverable} "
        f"escalations_excused={verdict.escalations_excused} "
        f"escalated_share={verdict.escalated_share:.1%} "
        f"quiet_rate={quiet} recovery_s={_recovery(verdict)}"
    )
    say("timings: " + " ".join(f"{phase}_s={seconds:.1f}" for phase, seconds in timings.items()))
    say(f"escalated by reason: {', '.join(_reasons(verdict).split(',')) or 'none'}")
    for example in verdict.examples[:10]:
        say(f"  {example}")
    say("guarantee held." if verdict.held else "GUARANTEE BROKEN.")


def summary(verdict: Verdict, timings: dict[str, float]) -> str:
    """One run in one line: a sweep prints one per seed."""
    return (
        f"decisions={verdict.decisions} effects={verdict.effects} rejected={verdict.rejected} "
        f"escalated={verdict.escalated} lost={verdict.lost} "
        f"duplicate_effects={verdict.duplicate_effects} blind_retries={verdict.blind_retries} "
        f"illegal_sequences={verdict.illegal_sequences} contradictions={verdict.contradictions} "
        f"escalated_share={verdict.escalated_share:.1%} "
        f"recovery_s={_recovery(verdict)} settle_s={_seconds(verdict.settle_s)} "
        f"longest_outage_s={verdict.provider_outage_s:.0f} "
        f"total_s={timings['total']:.0f} "
        f"escalated_by_reason={_reasons(verdict) or '-'} "
        + ("guarantee held." if verdict.held else "GUARANTEE BROKEN.")
    )


def _reasons(verdict: Verdict) -> str:
    return ",".join(f"{r}={n}" for r, n in sorted(verdict.escalation_reasons.items()))


def _recovery(verdict: Verdict) -> str:
    if not verdict.recovery_judged:
        return "-"
    return "never" if verdict.recovery_s is None else f"{verdict.recovery_s:.1f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
