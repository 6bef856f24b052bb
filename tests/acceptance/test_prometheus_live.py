"""The monitoring surface against a real Prometheus (Debian's), end to end: the daemons
as subprocesses, Prometheus scraping them every second and evaluating
deploy/prometheus/alerts.yml every second, about fifty decisions with one dead letter
and one tampered row, then a consumer stopped.

Asserted through Prometheus's HTTP API: every expression of the Grafana dashboard
returns data, the first dead letter and the first tampered row are counted (and their
alerts fire), no labelled counter series is born after the start, and stopping the
consumer makes its alert go pending. The table of expressions is printed (pytest -s).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, ConfigDict

from outbox import (
    EffectResult,
    ExecutionContext,
    OnUnknown,
    Registry,
    Settings,
    SideEffect,
    ToolContract,
    record_decision,
)
from outbox.sandbox.processes import python_module
from outbox.sandbox.provider import Faults

from support.prometheus import Prometheus, running_prometheus
from support.system import Daemon, System, running_system
from support.waiting import eventually_sync

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "effect-outbox.json"
# What Grafana would put in: a rate interval a few scrapes long, the test's time range.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m", "$tool": ".*"}
AWAITING_APPROVAL = 4


class SmsInput(BaseModel):
    model_config = ConfigDict(strict=True)

    to: str
    body: str


async def send_sms(tool_input: SmsInput, ctx: ExecutionContext) -> EffectResult:
    raise AssertionError("no consumer of this test runs send_sms")


def with_a_tool_no_consumer_runs(registry: Registry) -> Registry:
    """The agent's registry: the consumer's tools and one it lacks (a dead letter)."""
    registry.register(
        ToolContract(
            name="send_sms",
            version=1,
            input_model=SmsInput,
            side_effect=SideEffect.NON_REPEATABLE_WRITE,
            execute=send_sms,
            on_unknown=OnUnknown.ESCALATE,
        )
    )
    return registry


def metrics_port(daemon: Daemon, marker: str = "http.listening") -> int:
    line = daemon.wait_for_line(marker, within=60)
    match = re.search(r"\bport=(\d+)", line)
    assert match, line
    return int(match[1])


CALLBACK_SECRETS = (
    "sandbox-payments:whsec_live_test_payments_secret_01,"
    "sandbox-email:whsec_" + base64.b64encode(b"live-test-email-secret-32-bytes!").decode()
)


def start_callbacks(system: System) -> Daemon:
    """`outbox callbacks serve` for the sandbox's providers, on a free port."""
    daemon = Daemon(
        "callbacks",
        {**system.environment, "OUTBOX_CALLBACK_SECRETS": CALLBACK_SECRETS},
        command=python_module("outbox", "callbacks", "serve", "--port", "0"),
    )
    system.daemons.append(daemon)
    return daemon


def record_the_decisions(system: System) -> int:
    """About fifty decisions as an agent makes them; returns how many."""
    registry = with_a_tool_no_consumer_runs(system.registry)
    count = 0
    with psycopg.connect(system.database_url) as connection:

        def decide(tool: str, tool_input: dict[str, Any]) -> Any:
            nonlocal count
            count += 1
            return record_decision(
                connection, registry, tool, tool_input, run_id="prom", decision_key=str(count)
            ).operation

        for n in range(36):
            decide("send_refund", {"payment_id": f"pay_{n}", "amount_cents": 500 + n})
        for n in range(4):
            decide("send_email", {"to": "a@example.com", "subject": f"s{n}", "body": "b"})
        for n in range(4):
            decide("get_refund", {"refund_id": f"re_missing{n}"})
        for n in range(AWAITING_APPROVAL):
            decide("send_refund", {"payment_id": f"pay_big{n}", "amount_cents": 75_000})
        decide("send_sms", {"to": "+100", "body": "hi"})
        connection.commit()
        # A row written around the library: a 75,000-cent refund claiming it needs no
        # approval (the guard trigger refuses the change; a superuser switches it off).
        forged = decide("send_refund", {"payment_id": "pay_forged", "amount_cents": 75_000})
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET requires_approval = false WHERE id = %s", (forged.id,)
        )
        connection.commit()
    return count


def states(system: System) -> dict[str, int]:
    with psycopg.connect(system.database_url) as connection:
        rows = connection.execute("SELECT state, count(*) FROM operations GROUP BY state")
        return {str(state): int(count) for state, count in rows}


def settled(system: System) -> bool:
    """Everything but the approvals and the dead letter has reached an ending."""
    now = states(system)
    return (
        now.get("in_flight", 0) == 0
        and now.get("outcome_unknown", 0) == 0
        and now.get("prepared", 0) == AWAITING_APPROVAL + 1
    )


def scalar(prometheus: Prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else float("nan")


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expression with Grafana's variables filled in) for every panel query."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = " ".join(target["expr"].split())
            for variable, value in SUBSTITUTIONS.items():
                expr = expr.replace(variable, value)
            found.append((f"{panel['title']} / {target['refId']}", expr))
    return found


def sample(result: list[dict[str, Any]]) -> str:
    """The first series of a result as ``{labels} value``, for the printed table."""
    if not result:
        return "-"
    labels = ",".join(f"{k}={v}" for k, v in result[0]["metric"].items() if k != "__name__")
    return f"{{{labels}}} {float(result[0]['value'][1]):.4g}"


def counter_series(prometheus: Prometheus) -> set[tuple[tuple[str, str], ...]]:
    """Every labelled counter series of ours, without the target's labels. The tool of a
    publish is an open set the dispatcher cannot know in advance: left out."""
    found = set()
    for series in prometheus.query('{__name__=~"outbox_.+_total"}'):
        labels = {
            key: value for key, value in series["metric"].items() if key not in ("job", "instance")
        }
        if labels["__name__"] != "outbox_dispatcher_published_total":
            found.add(tuple(sorted(labels.items())))
    return found


def active(prometheus: Prometheus, alert: str) -> set[str]:
    """The states (pending, firing) ``alert`` is in."""
    return {a["state"] for a in prometheus.alerts() if a["labels"]["alertname"] == alert}


def test_prometheus_sees_every_panel_the_first_dead_letter_and_a_stopped_consumer(
    settings: Settings, tmp_path: Path
) -> None:
    with running_system(settings, faults=Faults(drop_response_every=7)) as system:
        dispatcher, consumer = system.start("dispatcher"), system.start("consumer")
        callbacks = start_callbacks(system)
        targets = {
            "outbox-dispatcher": [f"127.0.0.1:{metrics_port(dispatcher)}"],
            "outbox-consumer": [f"127.0.0.1:{metrics_port(consumer)}"],
            "outbox-callbacks": [f"127.0.0.1:{metrics_port(callbacks, 'callbacks.listening')}"],
        }
        with running_prometheus(tmp_path, targets, [ALERTS]) as prometheus:
            eventually_sync(
                lambda: scalar(prometheus, 'count(up{job=~"outbox-.*"} == 1)') == 3,
                within=30,
                what="both daemons and the callbacks receiver scraped",
            )
            before = counter_series(prometheus)

            decisions = record_the_decisions(system)
            eventually_sync(lambda: settled(system), within=60, what="the decisions settled")
            # Scraped after the events: the consumer's counters, the dispatcher's gauges.
            eventually_sync(
                lambda: (
                    scalar(prometheus, "sum(outbox_consumer_dead_lettered_total)") == 1
                    and scalar(prometheus, "sum(outbox_consumer_tampered_total)") == 1
                    and scalar(prometheus, "max(outbox_operations_awaiting_approval)")
                    == AWAITING_APPROVAL
                    and scalar(prometheus, 'max(outbox_operations{state="prepared"})')
                    == AWAITING_APPROVAL + 1
                ),
                within=30,
                what="Prometheus to have scraped the events",
            )

            table = [
                (where, expr, prometheus.query(expr)) for where, expr in dashboard_expressions()
            ]
            tools = prometheus.api(
                "label/tool/values", **{"match[]": "outbox_dispatcher_published_total"}
            )
            print(f"\n{decisions} decisions; {states(system)}")
            print("| panel / query | expression | series | a value |\n|---|---|---|---|")
            for where, expr, result in table:
                print(f"| {where} | `{expr}` | {len(result)} | {sample(result)} |")
            print(
                f"| variable $tool | label_values(outbox_dispatcher_published_total, tool) "
                f"| {len(tools)}: {', '.join(sorted(tools))} |"
            )

            first_dead_letter = scalar(
                prometheus,
                'sum(increase(outbox_consumer_dead_lettered_total{reason="unknown_tool"}[5m]))',
            )
            first_tampered = scalar(prometheus, "sum(increase(outbox_consumer_tampered_total[5m]))")
            eventually_sync(
                lambda: (
                    "firing" in active(prometheus, "OutboxMessagesDeadLettered")
                    and "firing" in active(prometheus, "OutboxTamperedRows")
                ),
                within=15,
                what="the dead-letter and tampering alerts firing",
            )
            after = counter_series(prometheus)

            consumer.stop()
            eventually_sync(
                lambda: (
                    bool(active(prometheus, "OutboxNoConsumer"))
                    and bool(active(prometheus, "OutboxDaemonDown"))
                ),
                within=30,
                what="the stopped consumer's alerts pending",
            )
            stopped = {name: active(prometheus, name) for name in ("OutboxNoConsumer",)}

    assert [where for where, _, result in table if not result] == [], "queries without data"
    assert "send_refund" in tools
    # Pre-initialised at 0, the first event is an increase (extrapolated a little).
    assert first_dead_letter >= 1
    assert first_tampered >= 1
    assert after - before == set(), "counter series born after the start read their 1 as 0"
    assert stopped["OutboxNoConsumer"] <= {"pending", "firing"}
