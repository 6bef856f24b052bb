"""The operator commands as a person on call runs them: `outbox` subprocesses against a
running system (dispatcher, consumer, payment sandbox)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from outbox import OperationState, Settings
from outbox.sandbox.provider import Faults

from support.system import SETTLED, System, running_system
from support.waiting import eventually_sync

S = OperationState
OUTBOX = Path(sys.executable).parent / "outbox"


def outbox(system: System, *argv: str) -> str:
    result = subprocess.run(
        [str(OUTBOX), *argv],
        env=system.environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def timeline(show_output: str) -> list[str]:
    # Header, timeline, callbacks: blocks apart by a blank line.
    events = show_output.split("\n\n")[1].splitlines()[1:]
    return [line.split()[1] for line in events]


def test_an_escalation_is_found_examined_and_resolved_from_the_command_line(
    settings: Settings,
) -> None:
    # The refund lands, its answer is lost, and its lookups stay unavailable past the
    # contract's (shortened) outage tolerance: a person is asked.
    faults = Faults(drop_response_every=1, lookups_unavailable=True)
    with running_system(settings, faults=faults, outage_tolerance=6.0) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide(reason="do-not-print-this-reason")
        assert system.wait_for(op.id, *SETTLED, within=45).state is S.ESCALATED

        listing = outbox(system, "ops", "list", "--state", "escalated")
        assert op.display_id in listing
        assert "escalated" in listing

        shown = outbox(system, "ops", "show", op.display_id)
        names = timeline(shown)
        assert names[:3] == [
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
        ]
        # Lookups that could not ask cost nothing: no deferral is counted.
        assert set(names[3:-1]) <= {"operation.waiting"}
        assert names[-1] == "operation.escalated"
        assert "reason=provider_unavailable" in shown

        # On a loaded host the consumer can give up on the call before the provider has
        # written the refund it goes on to write: the escalation is right either way,
        # and the person's check below needs the refund to have landed.
        eventually_sync(
            lambda: system.refunds_for(op.id) == 1, within=30, what="the refund to land"
        )
        refund_id = system.provider.ledger()["refunds"][0]["id"]
        resolved = outbox(
            system,
            "ops",
            "resolve",
            op.display_id,
            "--committed",
            "--provider-ref",
            refund_id,
            "--evidence",
            "checked the provider dashboard",
            "--by",
            "oncall@example.com",
        )
        assert f"escalated -> committed, provider reference {refund_id}" in resolved
        final = system.operation(op.id)
        assert (final.state, final.provider_reference) == (S.COMMITTED, refund_id)
        assert system.events(op.id)[-1] == "operation.resolved"
        assert system.refunds_for(op.id) == 1

        stats: dict[str, Any] = json.loads(outbox(system, "stats", "--json"))
        assert stats["by_state"]["committed"] == 1
        assert stats["by_state"]["escalated"] == 0
        assert stats["escalations_waiting"] == 0
        assert stats["by_tool"]["send_refund"]["committed"] == 1

        # The input is shown where a person judges it (ops show), nowhere else.
        intent = next(line for line in shown.splitlines() if line.startswith("input "))
        assert "do-not-print-this-reason" in intent
        assert "do-not-print-this-reason" not in listing + resolved


def test_show_tells_how_a_lost_response_was_reconciled(settings: Settings) -> None:
    with running_system(settings, faults=Faults(drop_response_every=1)) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide()
        assert system.wait_for(op.id, *SETTLED).state is S.COMMITTED

        shown = outbox(system, "ops", "show", op.display_id)
        print(shown)  # the README's sample; visible with pytest -s

    assert timeline(shown) == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.reconciled",
    ]
    reconciled = shown.split("\n\n")[1].splitlines()[-1]
    assert "result=committed" in reconciled
    assert shown.split("\n\n")[2] == "callbacks (0)\n"  # no receiver ran in this test
    assert f"provider_reference={system.operation(op.id).provider_reference}" in reconciled


def test_an_approval_is_listed_denied_and_granted_from_the_command_line(
    settings: Settings,
) -> None:
    with running_system(settings) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide(amount_cents=75_000, reason="canary-approval-6b2e")
        eventually_sync(
            lambda: "operation.approval_required" in system.events(op.id),
            within=20,
            what="the refund to wait for approval",
        )

        pending = json.loads(outbox(system, "approvals", "pending", "--json"))
        assert [entry["id"] for entry in pending] == [op.display_id]

        denied = outbox(system, "approvals", "deny", op.display_id, "--by", "lead@example.com")
        assert system.operation(op.id).state is OperationState.PREPARED
        assert system.refunds_for(op.id) == 0

        granted = outbox(
            system,
            "approvals",
            "grant",
            op.display_id,
            "--by",
            "oncall@example.com",
            "--ttl",
            "15m",
        )
        final = system.wait_for(op.id, *SETTLED)
        assert final.state is OperationState.COMMITTED
        assert system.refunds_for(op.id) == 1
        assert json.loads(outbox(system, "approvals", "pending", "--json")) == []
        for output in (denied, granted):
            assert "canary-approval-6b2e" not in output


def test_contract_cards_print_from_the_command_line(settings: Settings) -> None:
    with running_system(settings) as system:
        cards = outbox(system, "contracts", "--tools", "outbox.sandbox.tools")
        listed = json.loads(
            outbox(system, "contracts", "--tools", "outbox.sandbox.tools", "--json")
        )

    assert "send_refund v1" in cards
    assert "deduplicated_write" in cards
    assert "send_email v1" in cards
    assert "non_repeatable_write" in cards
    assert {entry["name"] for entry in listed} == {"send_refund", "get_refund", "send_email"}
