"""`outbox ops resolve` over a filter, run in process against a real database: the dry
run changes nothing, the confirmed run resolves exactly what it selected (each through
the single resolve's rules, each event with the batch's id), the batch is bounded, and
whatever a single resolve would refuse is refused in a batch too."""

from __future__ import annotations

import io
import json
from typing import Any
from uuid import UUID

import pytest

from outbox import Operation, OperationState, Registry
from outbox.cli import run_command
from outbox.operator import batch

from support.ops_helpers import Ops

S = OperationState
RUN = "run_provider_fault"
REJECT = ["--rejected", "--evidence", "provider fault 4711: nothing reached it", "--by", "ana"]


@pytest.fixture
def ops(database_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Ops:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_TOOLS", "support.sample_tools")
    return Ops(database_url, registry)


def outbox(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run_command(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def escalated(
    ops: Ops, reason: str = "lookups_unavailable", run_id: str = RUN, tool: str = "send_refund"
) -> Operation:
    return ops.escalated_for(reason, run_id=run_id, tool=tool)


def states(ops: Ops, *operations: Operation) -> list[OperationState]:
    return [ops.get(o.id).state for o in operations]


def resolved_attributes(ops: Ops, operation_id: UUID) -> dict[str, Any]:
    event = ops.events(operation_id)[-1]
    assert event.name == "operation.resolved"
    return dict(event.attributes)


def test_a_dry_run_lists_what_the_filter_selects_and_changes_nothing(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = escalated(ops), escalated(ops)
    other_reason = escalated(ops, reason="tampered")
    other_run = escalated(ops, run_id="run_elsewhere")

    code, out, _ = outbox(
        capsys, "ops", "resolve", "--run", RUN, "--reason", "lookups_unavailable", *REJECT
    )

    assert code == 0
    assert out.startswith("dry run: 2 escalated operation(s) match")
    assert "Nothing was changed" in out
    assert first.display_id in out
    assert second.display_id in out
    assert other_reason.display_id not in out
    assert other_run.display_id not in out
    assert "--yes" in out
    assert states(ops, first, second, other_reason, other_run) == [S.ESCALATED] * 4
    code, out, _ = outbox(capsys, "ops", "resolve", "--run", RUN, "--json", *REJECT)
    listing = json.loads(out)
    assert listing["dry_run"] is True
    assert listing["matched"] == 3
    assert [o["id"] for o in listing["operations"]] == [
        first.display_id,
        second.display_id,
        other_reason.display_id,
    ]


def test_yes_resolves_each_selected_operation_with_the_batch_id_on_its_event(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    selected = [escalated(ops) for _ in range(3)]
    untouched = [escalated(ops, reason="tampered"), ops.at(S.OUTCOME_UNKNOWN, run_id=RUN)]

    code, out, err = outbox(
        capsys,
        "ops",
        "resolve",
        "--run",
        RUN,
        "--reason",
        "lookups_unavailable",
        "--tool",
        "send_refund",
        "--yes",
        "--json",
        *REJECT,
    )

    assert code == 0, err
    report = json.loads(out)
    assert report["resolved"] == [o.display_id for o in selected]
    assert (report["matched"], report["selected"], report["refused"]) == (3, 3, [])
    assert states(ops, *selected) == [S.REJECTED] * 3
    assert states(ops, *untouched) == [S.ESCALATED, S.OUTCOME_UNKNOWN]
    batch_id = str(UUID(report["batch_id"]))
    for operation in selected:
        assert resolved_attributes(ops, operation.id) == {
            "from": "escalated",
            "to": "rejected",
            "decision": "rejected",
            "by": "ana",
            "evidence": "provider fault 4711: nothing reached it",
            "batch_id": batch_id,
        }


def test_the_batch_is_bounded_and_a_second_run_takes_the_rest(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    oldest, middle, newest = escalated(ops), escalated(ops), escalated(ops)

    code, out, err = outbox(
        capsys, "ops", "resolve", "--run", RUN, "--limit", "2", "--yes", *REJECT
    )

    assert code == 0, err
    assert "2 of 2 selected resolved as rejected" in out
    assert "1 more matched beyond --limit 2: run the command again" in out
    assert states(ops, oldest, middle, newest) == [S.REJECTED, S.REJECTED, S.ESCALATED]
    code, out, err = outbox(capsys, "ops", "resolve", "--run", RUN, "--yes", *REJECT)
    assert code == 0, err
    assert "1 of 1 selected resolved" in out
    assert states(ops, newest) == [S.REJECTED]
    # Two batches, two ids.
    ids = {resolved_attributes(ops, o.id)["batch_id"] for o in (oldest, middle, newest)}
    assert len(ids) == 2


def test_an_escalation_after_the_dry_run_is_not_in_the_pinned_run(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = escalated(ops)
    _, out, _ = outbox(capsys, "ops", "resolve", "--run", RUN, "--json", *REJECT)
    selected_at = json.loads(out)["selected_at"]
    _, text, _ = outbox(capsys, "ops", "resolve", "--run", RUN, *REJECT)
    assert "--until" in text  # the dry run names the window that keeps later ones out
    late = escalated(ops)  # escalations go on arriving after the fault

    code, out, err = outbox(
        capsys, "ops", "resolve", "--run", RUN, "--until", selected_at, "--yes", *REJECT
    )

    assert code == 0, err
    assert states(ops, listed, late) == [S.REJECTED, S.ESCALATED]


def test_a_refusal_is_reported_per_operation_and_the_batch_goes_on(
    ops: Ops, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, moved, last = escalated(ops), escalated(ops), escalated(ops)
    select = batch.select

    def someone_else_resolves_one_meanwhile(*args: Any, **kwargs: Any) -> Any:
        selection = select(*args, **kwargs)
        ops.rejected_in_store(ops.get(moved.id), evidence="by hand", by="bo")
        return selection

    monkeypatch.setattr(batch, "select", someone_else_resolves_one_meanwhile)
    code, out, _ = outbox(capsys, "ops", "resolve", "--run", RUN, "--yes", *REJECT)

    assert code == 1
    assert "2 of 3 selected resolved" in out
    assert f"refused 1 (nothing changed for them):\n  {moved.display_id}: " in out
    assert "only an escalated operation can be resolved" in out
    assert states(ops, first, last) == [S.REJECTED, S.REJECTED]
    assert resolved_attributes(ops, moved.id)["by"] == "bo"  # not resolved twice


def test_what_a_single_resolve_refuses_a_batch_refuses_operation_by_operation(
    ops: Ops, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the tools modules nobody can tell whether a refund's dedupe window still
    # holds, so a single resolve refuses its retry; a ticket's is answered from its row.
    monkeypatch.delenv("OUTBOX_TOOLS")
    refund, ticket = escalated(ops), escalated(ops, tool="open_ticket")
    retry = ["--not-committed", "--evidence", "the provider never saw it", "--by", "ana"]
    code, _, err = outbox(capsys, "ops", "resolve", refund.display_id, *retry)
    assert code == 1
    assert "no tools are loaded here" in err

    code, out, _ = outbox(capsys, "ops", "resolve", "--run", RUN, "--yes", *retry)

    assert code == 1
    assert f"{refund.display_id}: " in out
    assert "no tools are loaded here" in out
    assert states(ops, refund, ticket) == [S.ESCALATED, S.PREPARED]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--run", RUN, "--committed", "--provider-ref", "re_1"], "--provider-ref goes with"),
        (["--run", RUN, "--committed"], "committed needs each operation's own provider"),
        (["--run", RUN, "--force", "--rejected"], "--force goes with one OP_ID"),
        (["--rejected"], "name the operation (OP_ID), or select escalations"),
        (["--run", RUN, "--rejected", "--evidence", " "], "the evidence is empty"),
        (["--run", RUN, "--rejected", "--evidence", "a\x1b[2Jb"], "control characters"),
        (["--reason", "a\nb", "--rejected"], "reason: 1 to 200 characters"),
    ],
)
def test_a_bad_batch_is_refused_as_a_usage_error_with_nothing_changed(
    ops: Ops, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    waiting = escalated(ops)
    flags = [*argv]
    if "--evidence" not in flags:
        flags += ["--evidence", "fault 4711"]

    for confirmed in (["--yes"], []):  # the dry run refuses it too
        code, _, err = outbox(capsys, "ops", "resolve", *flags, "--by", "ana", *confirmed)

        assert code == 2
        assert says in err
    assert states(ops, waiting) == [S.ESCALATED]


def test_an_operation_id_and_a_filter_are_not_both_taken(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = escalated(ops)
    code, _, err = outbox(capsys, "ops", "resolve", waiting.display_id, "--run", RUN, *REJECT)
    assert code == 2
    assert "--run select many operations" in err
    with pytest.raises(SystemExit) as exit_info:
        outbox(capsys, "ops", "resolve", "--run", RUN, "--limit", "1001", *REJECT)
    assert exit_info.value.code == 2
    assert states(ops, waiting) == [S.ESCALATED]


class Terminal(io.StringIO):
    """A person at a terminal typing ``answer``."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "code", "state"), [("2", 0, S.REJECTED), ("y", 1, S.ESCALATED)])
def test_on_a_terminal_the_count_must_be_typed_back(
    ops: Ops,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    answer: str,
    code: int,
    state: OperationState,
) -> None:
    selected = [escalated(ops), escalated(ops)]
    monkeypatch.setattr("sys.stdin", Terminal(answer + "\n"))

    exited, out, err = outbox(capsys, "ops", "resolve", "--run", RUN, *REJECT)

    assert exited == code
    assert "Resolve these 2 operations as rejected? Type 2:" in out
    assert states(ops, *selected) == [state] * 2
    if code:
        assert "not confirmed: nothing was changed" in err
