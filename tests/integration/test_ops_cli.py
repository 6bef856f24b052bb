"""`outbox ops`, `outbox approvals` and `outbox stats`, run in process against a real
database: what they show, what they change, what they refuse, and that no command
ever prints an operation's input."""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest

from outbox import LeaseLost, Operation, OperationState, Registry
from outbox import store as outbox_store
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.cli import run_command
from outbox.models import ApprovalStatus, OperationEvent

from support.console_cases import counts
from support.db_helpers import execute_admin
from support.logs import rendered
from support.ops_helpers import LEASE, Ops

S = OperationState
# Planted in every input's free-text field: it must never reach any command's output.
CANARY = f"canary-{uuid4().hex}"


class Cli:
    """Runs `outbox ...` in process and keeps everything it printed or logged."""

    def __init__(self, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture):
        self.capsys = capsys
        self.caplog = caplog
        self.everything: list[str] = []

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        code = run_command(list(argv))
        captured = self.capsys.readouterr()
        self.everything += [captured.out, captured.err]
        return code, captured.out, captured.err

    def ok(self, *argv: str) -> str:
        code, out, err = self(*argv)
        assert code == 0, err
        return out

    def seen(self) -> str:
        return "\n".join([*self.everything, rendered(self.caplog)])


@pytest.fixture
def ops(database_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Ops:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    # The contracts a retry (--not-committed) asks about its dedupe window.
    monkeypatch.setenv("OUTBOX_TOOLS", "support.sample_tools")
    return Ops(database_url, registry, free_text=CANARY)


@pytest.fixture
def cli(ops: Ops, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Cli:
    caplog.set_level(logging.DEBUG)
    return Cli(capsys, caplog)


@pytest.fixture
def every_state(ops: Ops) -> dict[OperationState, Operation]:
    return {state: ops.at(state) for state in S}


def listed(cli: Cli, *argv: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = json.loads(cli.ok("ops", "list", "--json", *argv))
    return result


# --- ops list ---------------------------------------------------------------------------


def test_list_shows_every_operation_newest_change_first(
    cli: Cli, every_state: dict[OperationState, Operation]
) -> None:
    out = cli.ok("ops", "list")

    lines = out.splitlines()
    assert lines[0].split() == [
        "ID",
        "TOOL",
        "STATE",
        "ATTEMPTS",
        "RECONCILES",
        "LAST",
        "ERROR",
        "UPDATED",
    ]
    assert len(lines) == 1 + len(S)
    for state, operation in every_state.items():
        row = next(line for line in lines if operation.display_id in line)
        assert row.split()[1:4] == ["send_refund", "v1", str(state)]
    escalated_row = next(line for line in lines if every_state[S.ESCALATED].display_id in line)
    assert "lookups_unavailable" in escalated_row
    rows = listed(cli)
    stamps = [row["updated_at"] for row in rows]
    assert stamps == sorted(stamps, reverse=True)
    assert rows[0]["id"] == every_state[S.ESCALATED].display_id  # created last


def test_list_json_carries_metadata_and_never_the_input(
    cli: Cli, ops: Ops, every_state: dict[OperationState, Operation]
) -> None:
    rows = listed(cli)

    escalated = next(r for r in rows if r["state"] == "escalated")
    assert escalated == {
        "id": every_state[S.ESCALATED].display_id,
        "run_id": "run",
        "tool": "send_refund",
        "tool_version": 1,
        "side_effect": "deduplicated_write",
        "state": "escalated",
        "attempts": 1,
        "reconcile_attempts": 0,
        "last_error_class": "lookups_unavailable",
        "provider_reference": None,
        "requires_approval": False,
        "fingerprint": ops.short(every_state[S.ESCALATED].input_fingerprint),
        "created_at": escalated["created_at"],
        "updated_at": escalated["updated_at"],
        "escalation": {
            "reason": "lookups_unavailable",
            "since": escalated["escalation"]["since"],
            "waiting_seconds": escalated["escalation"]["waiting_seconds"],
        },
    }
    assert all(r["escalation"] is None for r in rows if r["state"] != "escalated")
    assert all("input" not in row for row in rows)
    assert CANARY not in cli.seen()


def test_list_filters_by_state_tool_since_and_limit(
    cli: Cli, ops: Ops, every_state: dict[OperationState, Operation]
) -> None:
    ticket = ops.at(S.ESCALATED, tool="open_ticket")

    by_state = listed(cli, "--state", "escalated", "--state", "committed")
    assert {(r["id"], r["state"]) for r in by_state} == {
        (every_state[S.ESCALATED].display_id, "escalated"),
        (every_state[S.COMMITTED].display_id, "committed"),
        (ticket.display_id, "escalated"),
    }
    by_tool = listed(cli, "--tool", "open_ticket")
    assert [r["id"] for r in by_tool] == [ticket.display_id]
    both = listed(cli, "--tool", "send_refund", "--state", "escalated")
    assert [r["id"] for r in both] == [every_state[S.ESCALATED].display_id]
    assert len(listed(cli, "--since", "1h")) == len(S) + 1
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert listed(cli, "--since", future) == []
    past = (datetime.now(UTC) - timedelta(hours=1)).replace(tzinfo=None).isoformat()
    assert len(listed(cli, "--since", past)) == len(S) + 1  # naive means UTC
    assert len(listed(cli, "--limit", "2")) == 2
    assert cli.ok("ops", "list", "--tool", "no_such_tool").strip() == "no operations match"


def test_a_list_of_escalations_says_why_each_waits_and_for_how_long(cli: Cli, ops: Ops) -> None:
    tampered = ops.escalated_at_claim("tampered", check="fingerprint_mismatch")
    ops.at(S.COMMITTED)

    out = cli.ok("ops", "list", "--state", "escalated")

    header, row = out.splitlines()
    assert header.endswith("ESCALATED BECAUSE  WAITING")
    assert row.startswith(tampered.display_id)
    assert re.search(r"\btampered\s+\d+s$", row), row
    (listed_row,) = listed(cli, "--state", "escalated")
    assert listed_row["escalation"]["reason"] == "tampered"
    assert 0 <= listed_row["escalation"]["waiting_seconds"] < 60
    # Other lists keep their columns.
    assert "ESCALATED BECAUSE" not in cli.ok("ops", "list")


def test_the_escalation_shown_is_the_latest_and_reads_no_timeline(
    cli: Cli, ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An escalated operation whose timeline runs on past its escalation (an agent's
    # reports, callbacks): the listing reads its newest escalation alone, never the whole
    # timeline, which made one page of 100,000 events take seconds and hundreds of MB.
    escalated = ops.escalated_at_claim("tampered", check="fingerprint_mismatch")
    execute_admin(
        database_url,
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "SELECT %s, 'agent.completed', jsonb_build_object('agent.n', n) "
        "FROM generate_series(1, 500) AS n",
        (escalated.id,),
    )

    def no_timelines(operation_id: object) -> object:
        raise AssertionError("the escalations listing read a whole timeline")

    monkeypatch.setattr(outbox_store, "events", no_timelines)
    (listed_row,) = listed(cli, "--state", "escalated")

    assert listed_row["escalation"]["reason"] == "tampered"


def test_list_refuses_a_malformed_since(cli: Cli) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli("ops", "list", "--since", "yesterday")
    assert exit_info.value.code == 2
    assert "not an ISO 8601 time or a duration" in cli.capsys.readouterr().err


# --- ops show ---------------------------------------------------------------------------


def test_show_prints_the_header_and_the_timeline(
    cli: Cli, ops: Ops, every_state: dict[OperationState, Operation]
) -> None:
    operation = every_state[S.ESCALATED]

    out = cli.ok("ops", "show", operation.display_id)

    header = dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in out.split("\n\n")[0].splitlines()
    )
    assert header["operation"] == operation.display_id
    assert header["run"] == "run"
    assert header["tool"] == "send_refund v1"
    assert header["side effect"] == "deduplicated_write"
    assert header["state"] == "escalated"
    assert header["fingerprint"] == ops.short(operation.input_fingerprint)
    assert header["attempts"] == "1"
    assert header["reconciles"] == "0"
    assert header["provider ref"] == "-"
    assert header["last error"] == "lookups_unavailable"
    assert header["approval"] == "not required"
    timeline = out.split("\n\n")[1].splitlines()
    assert timeline[0] == "timeline (4 events)"
    names = [line.split()[1] for line in timeline[1:]]
    assert names == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.escalated",
    ]
    assert "attempt=1" in timeline[2]
    assert "from=outcome_unknown to=escalated" in timeline[4]
    assert "reason=lookups_unavailable" in timeline[4]
    assert json.loads(header["input"]) == operation.input
    assert CANARY not in rendered(cli.caplog)


def test_show_accepts_a_bare_uuid_and_shows_the_provider_reference(
    cli: Cli, every_state: dict[OperationState, Operation]
) -> None:
    out = cli.ok("ops", "show", str(every_state[S.COMMITTED].id))

    assert "provider ref  re_found" in out
    assert "provider_reference=re_found" in out


def test_show_names_the_approval_status_of_an_operation_that_needs_one(cli: Cli, ops: Ops) -> None:
    operation = ops.new(amount_cents=60_000)

    out = cli.ok("ops", "show", operation.display_id)

    assert "approval      missing: no approval was granted for this operation" in out


def test_show_of_an_unknown_id_exits_1_with_a_message(cli: Cli) -> None:
    code, out, err = cli("ops", "show", "op_" + str(UUID(int=7)))

    assert code == 1
    assert out == ""
    assert "outbox ops: error:" in err
    assert "no operation with id" in err


@pytest.mark.parametrize("command", [["show"], ["cancel", "--reason", "r", "--by", "ada"]])
def test_a_malformed_id_is_a_usage_error_exit_2_in_one_line(
    cli: Cli, database_url: str, command: list[str]
) -> None:
    before = counts(database_url)

    code, out, err = cli("ops", command[0], "not-an-id", *command[1:])

    assert code == 2
    assert out == ""
    assert err.splitlines() == [
        "outbox ops: error: 'not-an-id' is not an operation id: expected op_<uuid>, a bare "
        "uuid, or the start of one (at least 8 hex digits, as the console shows it)"
    ]
    assert counts(database_url) == before


def test_show_and_the_commands_that_act_take_the_short_id_the_console_prints(
    cli: Cli, ops: Ops, database_url: str
) -> None:
    operation = ops.at(S.ESCALATED)
    short = operation.display_id[:11]  # what the console's lists print: op_74ca7733

    assert operation.display_id in cli.ok("ops", "show", short)
    assert operation.display_id in cli.ok("ops", "show", short.removeprefix("op_").upper())
    cli.ok("ops", "resolve", short, "--rejected", "--evidence", "dup", "--by", "ana")
    assert ops.get(operation.id).state is S.REJECTED


def test_a_short_id_two_operations_share_is_refused_by_name(
    cli: Cli, ops: Ops, database_url: str
) -> None:
    first = ops.new()
    twin = UUID(first.id.hex[:8] + "0" * 23 + "1")
    execute_admin(
        database_url,
        "INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, input, "
        "input_fingerprint, requires_approval, state) SELECT %s, run_id, tool_name, "
        "tool_version, side_effect, input, input_fingerprint, requires_approval, state "
        "FROM operations WHERE id = %s",
        (twin, first.id),
    )

    code, out, err = cli("ops", "show", first.display_id[:11])

    assert (code, out) == (1, "")
    assert "is ambiguous" in err
    assert first.display_id in err or f"op_{twin}" in err
    code, _, err = cli("ops", "show", "op_1234")
    assert code == 2  # too short to name one: a usage error
    assert "at least 8 hex digits" in err


def test_show_json_carries_what_the_text_shows(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.ESCALATED)

    shown = json.loads(cli.ok("ops", "show", operation.display_id, "--json"))

    assert shown["id"] == operation.display_id
    assert shown["state"] == "escalated"
    assert shown["input"] == ops.get(operation.id).input
    assert shown["fingerprint"] == ops.short(operation.input_fingerprint)
    assert shown["approval"] is None
    assert [e["name"] for e in shown["events"]] == ops.event_names(operation.id)
    assert shown["events"][-1]["attributes"]["to"] == "escalated"
    assert shown["callbacks"] == []


# --- ops resolve ------------------------------------------------------------------------


def resolved_event(ops: Ops, operation_id: UUID) -> OperationEvent:
    event = ops.events(operation_id)[-1]
    assert event.name == "operation.resolved"
    return event


def test_resolve_committed_from_escalated_records_who_and_why(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.ESCALATED)
    evidence = f"checked the provider dashboard {uuid4().hex}"

    out = cli.ok(
        "ops",
        "resolve",
        operation.display_id,
        "--committed",
        "--provider-ref",
        "re_123",
        "--evidence",
        evidence,
        "--by",
        "oncall@example.com",
    )

    stored = ops.get(operation.id)
    assert (stored.state, stored.provider_reference) == (S.COMMITTED, "re_123")
    assert resolved_event(ops, operation.id).attributes == {
        "from": "escalated",
        "to": "committed",
        "decision": "committed",
        "by": "oncall@example.com",
        "provider_reference": "re_123",
        "evidence": evidence,
    }
    assert f"{operation.display_id}: escalated -> committed, provider reference re_123" in out
    assert "resolved by oncall@example.com" in out
    # Stored for the next person, never logged nor echoed.
    assert evidence not in cli.seen()
    assert "operation.resolved" in cli.seen()  # the log line, on stderr
    assert evidence in cli.ok("ops", "show", operation.display_id)


def test_resolve_not_committed_queues_one_more_attempt_now(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.ESCALATED)
    rows_before = ops.run(outbox_store.outbox_rows(operation.id))

    out = cli.ok(
        "ops", "resolve", str(operation.id), "--not-committed",
        "--evidence", "not in the provider's export", "--by", "ana",
    )  # fmt: skip

    stored = ops.get(operation.id)
    assert stored.state is S.PREPARED
    rows = ops.run(outbox_store.outbox_rows(operation.id))
    assert len(rows) == len(rows_before) + 1
    fresh = rows[-1]
    assert fresh.published_at is None
    assert fresh.available_at <= datetime.now(UTC)
    assert resolved_event(ops, operation.id).attributes["decision"] == "not_committed"
    assert "-> prepared: one more attempt is queued now" in out
    # ...and a worker can claim it at once.
    assert ops.run(outbox_store.claim(operation.id, owner="w2", lease=LEASE)) is not None


def test_a_retry_of_a_deduplicated_write_asks_its_contract(
    cli: Cli, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    refund = ops.at(S.ESCALATED)  # a deduplicated write
    ticket = ops.at(S.ESCALATED, tool="open_ticket")  # a non-repeatable one: no window
    monkeypatch.delenv("OUTBOX_TOOLS")
    retry = ["--not-committed", "--evidence", "not at the provider", "--by", "ana"]

    code, _, err = cli("ops", "resolve", refund.display_id, *retry)
    assert code == 1
    assert "is a deduplicated write and no tools are loaded here" in err
    assert "nothing was changed" in err
    assert ops.get(refund.id).state is S.ESCALATED

    cli.ok("ops", "resolve", ticket.display_id, *retry)
    cli.ok("ops", "resolve", refund.display_id, *retry, "--tools", "support.sample_tools")
    assert ops.get(refund.id).state is S.PREPARED


def test_resolve_rejected_from_escalated_ends_the_operation(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.ESCALATED)

    out = cli.ok(
        "ops", "resolve", operation.display_id, "--rejected",
        "--evidence", "customer withdrew the request", "--by", "ana",
    )  # fmt: skip

    assert ops.get(operation.id).state is S.REJECTED
    event = resolved_event(ops, operation.id)
    assert (event.attributes["decision"], event.attributes["by"]) == ("rejected", "ana")
    assert "escalated -> rejected" in out


def test_resolve_refuses_evidence_over_500_characters_rather_than_cut_it(
    cli: Cli, ops: Ops
) -> None:
    operation = ops.at(S.ESCALATED)
    events_before = ops.events(operation.id)

    code, _, err = cli(
        "ops", "resolve", operation.display_id, "--rejected",
        "--evidence", "x" * 2000, "--by", "ana",
    )  # fmt: skip

    assert code == 2
    assert "the evidence is 2000 characters; at most 500 are kept" in err
    assert ops.get(operation.id) == operation
    assert ops.events(operation.id) == events_before


def test_a_grant_longer_than_the_approvals_table_keeps_is_refused(
    cli: Cli, ops: Ops, database_url: str
) -> None:
    waiting = ops.new(amount_cents=60_000)

    code, _, err = cli("approvals", "grant", waiting.display_id, "--by", "ana", "--ttl", "8d")

    assert code == 2
    assert err.splitlines()[-1] == (
        "outbox approvals: refused: a grant lasts more than no time and at most 7d: "
        "grant again when it runs out; nothing was changed"
    )
    assert ops.approvers(waiting.id) == []


def test_the_store_refuses_evidence_it_would_have_to_cut(ops: Ops) -> None:
    """Behind the operator layer too: a caller that skips it gets an error, not a cut."""
    operation = ops.at(S.ESCALATED)

    with pytest.raises(ValueError, match="at most 500 are kept"):
        ops.rejected_in_store(operation, evidence="x" * 501, by="ana")

    assert ops.get(operation.id).state is S.ESCALATED
    assert "operation.resolved" not in ops.event_names(operation.id)


@pytest.mark.parametrize(
    "state", [S.PREPARED, S.IN_FLIGHT, S.COMMITTED, S.REJECTED, S.OUTCOME_UNKNOWN]
)
def test_resolve_is_refused_outside_escalated(cli: Cli, ops: Ops, state: OperationState) -> None:
    operation = ops.at(state)
    events_before = ops.events(operation.id)

    code, out, err = cli(
        "ops", "resolve", operation.display_id, "--committed", "--provider-ref", "re_1",
        "--evidence", "looked", "--by", "ana",
    )  # fmt: skip

    assert code == 1
    assert out == ""
    assert f"{operation.display_id} is {state}" in err
    assert "nothing was changed" in err
    if state is S.OUTCOME_UNKNOWN:
        assert "--force" in err
    else:
        assert "only an escalated operation can be resolved" in err
    assert ops.get(operation.id) == operation
    assert ops.events(operation.id) == events_before


def test_force_resolves_an_unknown_outcome_and_fences_off_the_reconciler(
    cli: Cli, ops: Ops
) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)
    leased = ops.run(
        outbox_store.lease_for_reconciliation(operation, owner="reconciler", lease=LEASE)
    )

    cli.ok(
        "ops", "resolve", operation.display_id, "--committed", "--provider-ref", "re_9",
        "--evidence", "ledger shows it", "--by", "ana", "--force",
    )  # fmt: skip

    stored = ops.get(operation.id)
    assert (stored.state, stored.provider_reference) == (S.COMMITTED, "re_9")
    assert stored.lease_owner is None
    # The reconciler that held the lookup cannot overwrite the person's decision.
    with pytest.raises(LeaseLost, match="not outcome_unknown"):
        ops.run(
            outbox_store.defer_reconciliation(
                operation.id, lease_token=leased.lease_token, reason="x", delay=LEASE
            )
        )


def test_force_cannot_take_an_edge_the_state_machine_lacks(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)

    code, _, err = cli(
        "ops", "resolve", operation.display_id, "--rejected",
        "--evidence", "looked", "--by", "ana", "--force",
    )  # fmt: skip

    assert code == 1
    assert "outcome_unknown -> rejected is not a legal transition" in err
    assert ops.get(operation.id).state is S.OUTCOME_UNKNOWN


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--committed"], "committed needs the provider's reference of the effect"),
        (["--rejected", "--provider-ref", "re_1"], "a provider reference goes with committed only"),
    ],
)
def test_resolve_refuses_an_incomplete_decision_as_a_usage_error(
    cli: Cli, ops: Ops, extra: list[str], message: str
) -> None:
    operation = ops.at(S.ESCALATED)

    code, _, err = cli(
        "ops", "resolve", operation.display_id, *extra, "--evidence", "e", "--by", "ana"
    )

    assert code == 2
    assert message in err
    assert ops.get(operation.id).state is S.ESCALATED


# --- approvals ----------------------------------------------------------------------------


def test_pending_lists_only_operations_waiting_for_a_valid_approval(cli: Cli, ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)
    ops.new(amount_cents=100)  # needs no approval
    ops.at(S.COMMITTED)

    out = cli.ok("approvals", "pending")

    lines = out.splitlines()
    assert lines[0].split() == [
        "ID", "TOOL", "FINGERPRINT", "SUMMARY", "APPROVAL", "CREATED", "INPUT",
    ]  # fmt: skip
    assert len(lines) == 2
    assert waiting.display_id in lines[1]
    assert ops.short(waiting.input_fingerprint) in lines[1]
    assert "deduplicated_write in run run" in lines[1]
    assert "missing: no approval was granted" in lines[1]
    rows = json.loads(cli.ok("approvals", "pending", "--json"))
    assert [(r["id"], r["approval_status"]) for r in rows] == [(waiting.display_id, "missing")]
    assert CANARY not in rendered(cli.caplog)


def test_pending_shows_the_intent_a_grant_would_approve(cli: Cli, ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)
    intent = {"amount_cents": 60_000, "currency": "EUR", "payment_id": "pay_1", "reason": CANARY}

    row = cli.ok("approvals", "pending").splitlines()[1]
    listed = json.loads(cli.ok("approvals", "pending", "--json"))
    shown = cli.ok("ops", "show", waiting.display_id)

    assert json.loads(re.split(r"\s{2,}", row)[-1]) == intent
    assert listed[0]["input"] == intent
    input_line = next(line for line in shown.splitlines() if line.startswith("input "))
    assert json.loads(input_line.removeprefix("input ")) == intent
    assert CANARY not in rendered(cli.caplog)


def test_grant_binds_the_fingerprint_and_clears_the_pending_list(cli: Cli, ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)
    rows_before = ops.run(outbox_store.outbox_rows(waiting.id))

    out = cli.ok(
        "approvals", "grant", waiting.display_id, "--by", "lead@example.com", "--ttl", "2h"
    )

    check = ops.run(outbox_store.check_approval(waiting.id))
    assert check.status is ApprovalStatus.VALID
    assert check.approval.intent_hash == waiting.input_fingerprint
    assert ops.approvers(waiting.id) == ["lead@example.com"]
    expires = check.approval.expires_at
    assert timedelta(minutes=119) < expires - datetime.now(UTC) <= timedelta(hours=2)
    assert f"approval {check.approval.id} granted by lead@example.com" in out
    assert f"intent {ops.short(waiting.input_fingerprint)}" in out
    assert expires.astimezone(UTC).isoformat(timespec="milliseconds")[:19] in out
    assert "queued again" in out
    assert len(ops.run(outbox_store.outbox_rows(waiting.id))) == len(rows_before) + 1
    assert cli.ok("approvals", "pending").strip() == "no operations are waiting for an approval"


def test_deny_records_a_denial_and_leaves_the_state_alone(cli: Cli, ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)

    out = cli.ok("approvals", "deny", waiting.display_id, "--by", "lead@example.com")

    check = ops.run(outbox_store.check_approval(waiting.id))
    assert check.status is ApprovalStatus.DENIED
    assert ops.get(waiting.id).state is S.PREPARED
    assert "denied by lead@example.com" in out
    assert "the consumer refuses to execute it" in out
    assert "stays prepared" in out
    assert "ends it rejected (approval_denied) after OUTBOX_APPROVAL_DENIAL_GRACE" in out
    rows = json.loads(cli.ok("approvals", "pending", "--json"))
    assert [(r["id"], r["approval_status"]) for r in rows] == [(waiting.display_id, "denied")]
    # A later grant supersedes the denial.
    cli.ok("approvals", "grant", waiting.display_id, "--by", "lead@example.com")
    assert ops.run(outbox_store.check_approval(waiting.id)).is_valid


@pytest.mark.parametrize("action", ["grant", "deny"])
def test_a_decision_binds_only_the_intent_the_approver_was_shown(
    cli: Cli, ops: Ops, database_url: str, action: str
) -> None:
    waiting = ops.new(amount_cents=60_000)
    other = ops.new(amount_cents=70_000)
    shown = ops.short(waiting.input_fingerprint)
    assert f" {shown} " in cli.ok("approvals", "pending")  # what the approver judged

    code, _, err = cli(
        "approvals", action, waiting.display_id, "--by", "ana",
        "--intent", ops.short(other.input_fingerprint),
    )  # fmt: skip
    assert code == 1
    assert "the intent changed since it was shown" in err
    assert f"now {shown}" in err
    assert ops.approvers(waiting.id) == []

    cli.ok("approvals", action, waiting.display_id, "--by", "ana", "--intent", shown)
    (approval,) = ops.run(outbox_store.operation_approvals(waiting.id))
    assert approval.intent_hash == waiting.input_fingerprint


def test_approval_decisions_answer_in_json(cli: Cli, ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)

    granted = json.loads(cli.ok("approvals", "grant", waiting.display_id, "--by", "ana", "--json"))
    denied = json.loads(cli.ok("approvals", "deny", waiting.display_id, "--by", "ana", "--json"))

    (denial, grant) = ops.run(outbox_store.operation_approvals(waiting.id))
    assert granted == {
        "approval_id": str(grant.id),
        "operation_id": waiting.display_id,
        "decision": "granted",
        "by": "ana",
        "intent": ops.short(waiting.input_fingerprint),
        "expires_at": granted["expires_at"],
        "state": "prepared",
        "requires_approval": True,
    }
    assert (denied["approval_id"], denied["decision"]) == (str(denial.id), "denied")


@pytest.mark.parametrize("action", ["grant", "deny"])
def test_approvals_refuse_settled_and_unknown_operations(cli: Cli, ops: Ops, action: str) -> None:
    settled = ops.at(S.COMMITTED)

    code, _, err = cli("approvals", action, settled.display_id, "--by", "ana")
    assert code == 1
    assert "is committed: there is nothing left to decide" in err

    code, _, err = cli("approvals", action, str(UUID(int=9)), "--by", "ana")
    assert code == 1
    assert "no operation with id" in err


# --- stats ----------------------------------------------------------------------------------


def test_stats_counts_states_tools_backlog_and_waiting_work(
    cli: Cli, ops: Ops, every_state: dict[OperationState, Operation]
) -> None:
    ops.at(S.ESCALATED, tool="open_ticket")
    ops.new(amount_cents=60_000)  # waits for an approval

    numbers = json.loads(cli.ok("stats", "--json"))

    assert numbers["by_state"] == {
        "prepared": 2,
        "in_flight": 1,
        "committed": 1,
        "rejected": 1,
        "outcome_unknown": 1,
        "escalated": 2,
    }
    assert numbers["by_tool"]["open_ticket"] == {
        "prepared": 0,
        "in_flight": 0,
        "committed": 0,
        "rejected": 0,
        "outcome_unknown": 0,
        "escalated": 1,
    }
    assert sum(numbers["by_tool"]["send_refund"].values()) == 7
    # Nothing publishes in this test: every decision's first row is still waiting.
    assert numbers["outbox_backlog"] == len(S) + 2
    assert numbers["oldest_pending_age_seconds"] > 0
    assert numbers["escalations_waiting"] == 2
    assert numbers["approvals_waiting"] == 1
    assert numbers["estimated"] == []  # a small table: every figure counted

    text = cli.ok("stats")
    assert "outbox backlog       8 unpublished row(s)" in text
    assert "escalations waiting  2" in text
    assert "approvals waiting    1" in text
    all_row = next(line for line in text.splitlines() if line.startswith("all "))
    assert all_row.split() == ["all", "2", "1", "1", "1", "1", "2", "8"]


def test_stats_of_an_empty_database(cli: Cli) -> None:
    numbers = json.loads(cli.ok("stats", "--json"))

    assert numbers["by_state"] == dict.fromkeys((str(s) for s in S), 0)
    assert numbers["by_tool"] == {}
    assert (numbers["outbox_backlog"], numbers["oldest_pending_age_seconds"]) == (0, 0)


# --- what someone else chose cannot drive the operator's terminal --------------------------

# Clears the screen, homes the cursor, starts a line over, a one-byte CSI (C1), NEL, a
# right-to-left override and a line separator: each rewrites what the operator sees.
HOSTILE = "x\x1b[2J\x1b[H\rforged\x9b31m\x85\u202eevil\u2028y"


def terminal_controls(text: str) -> list[str]:
    bidi = {"\u061c", "\u200e", "\u200f", *map(chr, range(0x202A, 0x202F))}
    bidi |= set(map(chr, range(0x2066, 0x206A))) | {"\u2028", "\u2029"}
    return [c for c in text if (unicodedata.category(c) == "Cc" and c != "\n") or c in bidi]


def test_text_output_escapes_every_field_someone_else_chose(
    cli: Cli, database_url: str, registry: Registry
) -> None:
    hostile = Ops(database_url, registry, free_text=HOSTILE)
    waiting = hostile.new(amount_cents=60_000, run_id=HOSTILE)
    cli.ok("approvals", "deny", waiting.display_id, "--by", f"ana{HOSTILE}")
    escalated = hostile.at(S.ESCALATED, run_id=HOSTILE)
    # `ops resolve` refuses evidence with control characters (outbox.operator.input);
    # written through the store, as an older version or another writer could have, it
    # must still print safely.
    hostile.rejected_in_store(escalated, evidence=HOSTILE, by=f"bo{HOSTILE}")

    pending = cli.ok("approvals", "pending")
    shown = cli.ok("ops", "show", waiting.display_id)
    resolved = cli.ok("ops", "show", escalated.display_id)
    outputs = [pending, shown, resolved, cli.ok("ops", "list"), cli.ok("stats")]

    for output in outputs:
        assert terminal_controls(output) == []
    escaped = "x\\u001b[2J\\u001b[H\\rforged\\u009b31m\\u0085\\u202eevil\\u2028y"
    assert f"run           {escaped}" in shown
    assert f"denied by ana{escaped}" in shown
    assert f"in run {escaped}" in pending
    assert f"denied by ana{escaped}" in pending
    assert f'by="bo{escaped}"' in resolved
    assert f'evidence="{escaped}"' in resolved
    # Escaped the way JSON escapes, so the intent still reads back exactly.
    input_line = next(line for line in shown.splitlines() if line.startswith("input "))
    assert json.loads(input_line.removeprefix("input "))["reason"] == HOSTILE
    # --json is left to JSON's escaping: the value comes back whole.
    listed = json.loads(cli.ok("approvals", "pending", "--json"))
    assert listed[0]["run_id"] == HOSTILE


def test_an_error_message_is_one_line_without_terminal_controls(cli: Cli) -> None:
    code, out, err = cli("ops", "show", f"op_{HOSTILE}")

    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1
    assert terminal_controls(err) == []


# --- the canary rule ----------------------------------------------------------------------


def test_only_show_and_pending_print_an_operation_input(
    cli: Cli, ops: Ops, every_state: dict[OperationState, Operation]
) -> None:
    waiting = ops.new(amount_cents=60_000)
    ticket = ops.at(S.ESCALATED, tool="open_ticket")
    ids = [*(o.display_id for o in every_state.values()), waiting.display_id, ticket.display_id]

    shown = [cli.ok("ops", "show", display_id) for display_id in ids]
    pending = [cli.ok("approvals", "pending"), cli.ok("approvals", "pending", "--json")]
    assert all(CANARY in output for output in [*shown, *pending])
    cli.everything.clear()

    cli.ok("ops", "list")
    cli.ok("ops", "list", "--json")
    cli.ok("approvals", "grant", waiting.display_id, "--by", "ana")
    cli.ok("approvals", "deny", waiting.display_id, "--by", "ana")
    cli.ok("ops", "resolve", ticket.display_id, "--not-committed", "--evidence", "e", "--by", "ana")
    cli(
        "ops", "resolve", every_state[S.PREPARED].display_id, "--rejected",
        "--evidence", "e", "--by", "ana",
    )  # fmt: skip
    cli.ok("stats")
    cli.ok("stats", "--json")

    assert CANARY not in cli.seen()
    assert "pay_1" not in cli.seen()  # nor any other input value


def test_cancel_ends_a_prepared_operation_rejected_with_who_and_why(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.PREPARED)

    out = cli.ok(
        "ops", "cancel", operation.display_id, "--reason", "duplicate ticket", "--by", "ana",
    )  # fmt: skip

    assert ops.get(operation.id).state is S.REJECTED
    event = resolved_event(ops, operation.id)
    assert (event.attributes["decision"], event.attributes["by"]) == ("cancel", "ana")
    assert event.attributes["evidence"] == "duplicate ticket"
    assert "prepared -> rejected" in out
    # Who decided and why are in the event, not in any log line (stderr).
    assert "operation.resolved" in cli.everything[-1]
    assert "by=" not in cli.everything[-1]
    assert "duplicate ticket" not in cli.everything[-1]


@pytest.mark.parametrize(
    "state", [S.IN_FLIGHT, S.COMMITTED, S.REJECTED, S.OUTCOME_UNKNOWN, S.ESCALATED]
)
def test_cancel_is_refused_outside_prepared(cli: Cli, ops: Ops, state: OperationState) -> None:
    operation = ops.at(state)
    events_before = ops.events(operation.id)

    code, out, err = cli("ops", "cancel", operation.display_id, "--reason", "no", "--by", "ana")

    assert code == 1
    assert out == ""
    assert f"{operation.display_id} is {state}" in err
    assert "nothing was changed" in err
    assert ops.get(operation.id) == operation
    assert ops.events(operation.id) == events_before


@pytest.mark.parametrize("flag", ["--reason", "--by"])
def test_cancel_needs_a_reason_and_a_person(cli: Cli, ops: Ops, flag: str) -> None:
    operation = ops.at(S.PREPARED)
    values = {"--reason": "duplicate", "--by": "ana", flag: "  "}

    arguments = [part for pair in values.items() for part in pair]

    code, _, err = cli("ops", "cancel", operation.display_id, *arguments)

    assert code == 2
    assert ("the evidence is empty" if flag == "--reason" else "--by must name") in err
    assert ops.get(operation.id).state is S.PREPARED


@pytest.mark.parametrize("decision", ["grant", "deny"])
def test_who_decided_an_approval_is_kept_out_of_every_log_line(
    cli: Cli, ops: Ops, decision: str
) -> None:
    person = f"approver-{uuid4().hex[:8]}@example.com"
    waiting = ops.new(amount_cents=60_000)

    code, _, logged = cli("approvals", decision, waiting.display_id, "--by", person)

    # The command's own log lines go to stderr (the operator's output to stdout).
    assert code == 0
    assert "operation.approval_" in logged
    assert person not in logged
    assert person not in rendered(cli.caplog)
    assert ops.approvers(waiting.id) == [person]  # kept where it belongs


def test_resolution_evidence_and_resolver_are_kept_out_of_every_log_line(
    cli: Cli, ops: Ops
) -> None:
    operation = ops.at(S.ESCALATED)
    person, evidence = f"resolver-{uuid4().hex[:8]}", f"evidence-{uuid4().hex}"

    code, _, logged = cli(
        "ops", "resolve", operation.display_id, "--rejected", "--evidence", evidence,
        "--by", person,
    )  # fmt: skip

    assert code == 0
    assert "operation.resolved" in logged
    for secret in (person, evidence):
        assert secret not in logged
        assert secret not in rendered(cli.caplog)
    assert resolved_event(ops, operation.id).attributes["by"] == person


# --- provider callbacks: ops show, callbacks list ------------------------------------


def callback(
    ops: Ops,
    operation_id: UUID | None,
    event_id: str,
    status: str,
    reference: str | None = None,
) -> outbox_store.CallbackReceipt:
    report = CallbackReport(
        event_id=event_id,
        status=CallbackStatus(status),
        operation_id=operation_id,
        provider_reference=reference,
    )
    receipt: outbox_store.CallbackReceipt = ops.run(
        outbox_store.record_callback("payments", report, "d" * 64)
    )
    return receipt


def test_show_lists_the_callbacks_a_provider_sent_about_the_operation(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.COMMITTED)
    first = callback(ops, operation.id, "evt_1", "pending")
    second = callback(ops, operation.id, "evt_2", "committed", "re_found")

    out = cli.ok("ops", "show", operation.display_id)

    blocks = out.split("\n\n")
    # Not applied yet, so not yet in the timeline: the callbacks section lists them.
    assert "operation.callback_received" not in blocks[1]
    section = blocks[2].splitlines()
    assert section[0] == "callbacks (2)"
    assert re.split(r"\s{2,}", section[1].strip()) == [
        "ID",
        "PROVIDER",
        "EVENT",
        "STATUS",
        "REFERENCE",
        "OUTCOME",
        "RECEIVED",
    ]
    rows = [re.split(r"\s{2,}", line.strip()) for line in section[2:]]
    assert [row[:6] for row in rows] == [
        [str(first.callback_id), "payments", "evt_1", "pending", "-", "not applied yet"],
        [str(second.callback_id), "payments", "evt_2", "committed", "re_found", "not applied yet"],
    ]


def test_show_says_when_no_callback_came(cli: Cli, ops: Ops) -> None:
    out = cli.ok("ops", "show", ops.at(S.PREPARED).display_id)
    assert out.split("\n\n")[2] == "callbacks (0)\n"


def test_callbacks_list_shows_the_inbox_newest_first_and_filters_it(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.COMMITTED)
    stranger = uuid4()
    matched = callback(ops, operation.id, "evt_a", "committed", "re_found")
    unmatched = callback(ops, stranger, "evt_b", "rejected", "re_elsewhere")

    everything = cli.ok("callbacks", "list").splitlines()
    only_unmatched = cli.ok("callbacks", "list", "--unmatched").splitlines()
    pending = json.loads(cli.ok("callbacks", "list", "--pending", "--json"))

    assert [line.split()[0] for line in everything[1:]] == [
        str(unmatched.callback_id),
        str(matched.callback_id),
    ]
    assert everything[0].split() == [
        "ID", "PROVIDER", "EVENT", "STATUS", "OPERATION", "REFERENCE", "OUTCOME", "RECEIVED",
    ]  # fmt: skip
    assert len(only_unmatched) == 2
    row = re.split(r"\s{2,}", only_unmatched[1].strip())
    # The operation it named, which this database does not have.
    assert row[:7] == [
        str(unmatched.callback_id),
        "payments",
        "evt_b",
        "rejected",
        f"op_{stranger} (unknown)",
        "re_elsewhere",
        "unmatched",
    ]
    assert [entry["event_id"] for entry in pending] == ["evt_a"]
    assert pending[0]["operation_id"] == operation.display_id
    assert pending[0]["outcome"] is None
    assert set(pending[0]) == {
        "id",
        "provider",
        "event_id",
        "status",
        "operation_id",
        "named_operation_id",
        "provider_reference",
        "payload_digest",
        "received_at",
        "outcome",
        "applied_at",
    }


def test_a_callback_has_one_json_shape_in_ops_show_and_callbacks_list(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.COMMITTED)
    callback(ops, operation.id, "evt_same_1", "pending")
    callback(ops, operation.id, "evt_same_2", "committed", "re_same")

    shown = json.loads(cli.ok("ops", "show", operation.display_id, "--json"))["callbacks"]
    listed = json.loads(cli.ok("callbacks", "list", "--json"))
    mine = [entry for entry in listed if entry["operation_id"] == operation.display_id]

    # ops show lists them in the order they came, the inbox newest first.
    assert shown == list(reversed(mine))
    assert [entry["event_id"] for entry in shown] == ["evt_same_1", "evt_same_2"]
    assert shown[1]["provider_reference"] == "re_same"
    assert shown[1]["named_operation_id"] == operation.display_id
    assert shown[1]["payload_digest"] == "d" * 64
    assert shown[1]["applied_at"] is None


def test_a_reference_a_provider_chose_in_a_callback_is_shown_escaped(cli: Cli, ops: Ops) -> None:
    operation = ops.at(S.COMMITTED)
    callback(ops, operation.id, "evt_bidi", "committed", "re_\u202eevil")

    for output in (
        cli.ok("callbacks", "list"),
        cli.ok("ops", "show", operation.display_id),
    ):
        assert terminal_controls(output) == []
        assert "re_\\u202eevil" in output
