"""How ``outbox providers`` and the console's providers card read: each provider's
breaker, its outage and what waits for it, in a table for a terminal and as JSON. Names
and failure codes went through the breaker's CHECKs; text shown to a person still goes
through :func:`~outbox.text.printable` (outbox/operator/render.py says why)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.breaker import BreakerState
from outbox.models import display_operation_id
from outbox.operator.render import age_text, event_attributes_text, instant, stamp, table
from outbox.operator.views import ProvidersView, ProviderView
from outbox.store import Row
from outbox.text import printable

NO_PROVIDER_ROWS = (
    "no provider has failed since the schema was applied: every breaker is closed "
    "and no call has been held back"
)


def provider_state_text(view: ProviderView) -> str:
    """The breaker's state; a closed one with a streak of failures says how many
    operations' calls failed in it (the streak that opens it at the consumer's
    OUTBOX_PROVIDER_FAILURES_TO_OPEN)."""
    health = view.health
    if health.state is BreakerState.CLOSED and health.failing_operations:
        return f"closed, {len(health.failing_operations)} failing"
    return str(health.state)


def outage_text(view: ProviderView) -> str:
    """Since when the provider is down, and for how long by the database's clock."""
    started = view.health.outage_started_at
    if started is None:
        return "-"
    return f"{stamp(started)} ({age_text((view.now - started).total_seconds())})"


def next_probe_text(view: ProviderView) -> str:
    health = view.health
    if health.state is BreakerState.HALF_OPEN:
        return f"out until {stamp(health.probe_expires_at)}"
    if health.state is BreakerState.OPEN:
        return stamp(health.next_probe_at)
    return "-"


def not_before_text(view: ProviderView) -> str:
    """The provider's Retry-After while it holds; a moment past holds nothing."""
    return stamp(view.health.not_before) if view.retry_after_pending else "-"


def waiting_by_tool_text(waiting: dict[str, int]) -> str:
    return ", ".join(f"{tool} {count}" for tool, count in waiting.items())


def providers_text(view: ProvidersView) -> str:
    """``outbox providers``: one line per breaker row; the operations waiting for each
    provider when the tools modules are loaded, else waiting operations by tool."""
    lines = []
    if not view.providers:
        lines.append(NO_PROVIDER_ROWS)
    else:
        headers = [
            "PROVIDER",
            "STATE",
            "OUTAGE SINCE",
            "PROBES",
            "NEXT PROBE",
            "NOT BEFORE",
            "LAST FAILURE",
        ]
        rows = [
            [
                p.health.provider,
                provider_state_text(p),
                outage_text(p),
                str(p.health.probes),
                next_probe_text(p),
                not_before_text(p),
                p.health.last_failure or "-",
            ]
            for p in view.providers
        ]
        if view.tools_loaded:
            headers.append("WAITING")
            for row, provider in zip(rows, view.providers, strict=True):
                row.append(str(provider.waiting))
        lines.append(table(headers, rows))
    if view.tools_loaded:
        if view.unattributed:
            lines.append(
                "also waiting, of tools the tools modules do not map to a provider above: "
                + printable(waiting_by_tool_text(view.unattributed))
            )
    elif view.waiting_by_tool:
        lines.append(
            "waiting for their provider, by tool: "
            + printable(waiting_by_tool_text(view.waiting_by_tool))
            + " (--tools MODULE counts them per provider)"
        )
    elif view.providers:
        lines.append("no operation waits for a provider")
    return "\n".join(lines)


def provider_json(view: ProviderView) -> dict[str, Any]:
    """One provider in ``outbox providers --json``: the breaker row as stored (times at
    full precision), how long the outage has lasted, and what waits for it."""
    health = view.health
    started = health.outage_started_at
    return {
        "provider": health.provider,
        "state": str(health.state),
        "available": health.available,
        "outage_started_at": instant(started),
        "outage_seconds": None
        if started is None
        else round((view.now - started).total_seconds(), 3),
        "opened_at": instant(health.opened_at),
        "probes": health.probes,
        "next_probe_at": instant(health.next_probe_at),
        "probe_owner": health.probe_owner,
        "probe_expires_at": instant(health.probe_expires_at),
        "not_before": instant(health.not_before),
        "last_failure": health.last_failure,
        "failing_operations": [display_operation_id(o) for o in health.failing_operations],
        "failing_since": instant(health.failing_since),
        "updated_at": instant(health.updated_at),
        "last_event_at": instant(view.last_event_at),
        "tools": None if view.tools is None else list(view.tools),
        "waiting_operations": view.waiting,
    }


def providers_json(view: ProvidersView) -> dict[str, Any]:
    return {
        "providers": [provider_json(p) for p in view.providers],
        "tools_loaded": view.tools_loaded,
        "waiting_by_tool": view.waiting_by_tool,
        "unattributed_waiting": view.unattributed if view.tools_loaded else None,
    }


def provider_head_text(view: ProviderView) -> str:
    """One provider's breaker in a line, above its events."""
    health = view.health
    parts = [f"{health.provider}: {provider_state_text(view)}"]
    if health.outage_started_at is not None:
        parts.append(f"down since {outage_text(view)}")
        parts.append(f"{health.probes} probe(s)")
    if health.state is not BreakerState.CLOSED:
        parts.append(f"next probe {next_probe_text(view)}")
    if view.retry_after_pending:
        parts.append(f"not before {not_before_text(view)}")
    if health.last_failure:
        parts.append(f"last failure {health.last_failure}")
    if view.waiting is not None:
        parts.append(f"{view.waiting} operation(s) waiting")
    return printable(", ".join(parts))


def provider_events_text(
    provider: str, view: ProviderView | None, events: Sequence[Row], limit: int
) -> str:
    """``outbox providers --events P``: the breaker in a line, then its outages newest
    first (``provider.unavailable`` when it opened, ``provider.available`` when it
    closed, with how long, how many probes and operations waited)."""
    head = provider_head_text(view) if view else f"{printable(provider)}: no breaker row"
    lines = [head, "", f"outage events ({len(events)}, newest first)"]
    rows = [
        [
            str(event["id"]),
            stamp(event["created_at"]),
            event["name"],
            event_attributes_text(event["name"], event["attributes"]),
        ]
        for event in events
    ]
    if rows:
        lines += [
            "  " + line for line in table(["ID", "AT", "EVENT", "ATTRIBUTES"], rows).splitlines()
        ]
    if len(events) >= limit:
        lines.append(f"(the newest {limit}; --limit N shows more)")
    return "\n".join(lines)


def provider_events_json(
    provider: str, view: ProviderView | None, events: Sequence[Row]
) -> dict[str, Any]:
    return {
        "provider": provider,
        "health": provider_json(view) if view else None,
        "events": [
            {
                "id": event["id"],
                "name": event["name"],
                "at": instant(event["created_at"]),
                "attributes": event["attributes"],
            }
            for event in events
        ],
    }
