"""One rule per input, whatever the front end: each case goes through `outbox ops` or
`outbox approvals` (in process, against the real database) and through a console post
(over HTTP, as an operator login), and both must accept it or both refuse it with the
same sentence, writing nothing. MCP takes no person's input (it neither resolves nor
decides approvals), so it has no column here.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from outbox.cli import run_command
from outbox.models import Operation

from support.console_cases import S, counts
from support.console_helpers import csrf, logged_in
from support.ops_helpers import Ops

REF_201 = "r" * 201
BAD_NAME = "'op_zz' is not an operation id: expected op_<uuid>, a bare uuid, or the start of one"


@dataclass(frozen=True)
class Case:
    """``cli`` gives the argv after the operation's name, ``form`` the console's fields;
    ``name`` turns the operation into the id a person types. ``refused`` is the sentence
    both must show, None when both must accept; ``kept`` checks what an acceptance
    wrote."""

    kind: str  # "resolve" or "approval"
    cli: list[str]
    form: dict[str, str]
    refused: str | None = None
    kept: Callable[[Ops, Operation], None] = field(default=lambda ops, op: None)
    name: Callable[[Operation], str] = field(default=lambda op: op.display_id)
    not_found: bool = False


def evidence_kept(text: str) -> Callable[[Ops, Operation], None]:
    def check(ops: Ops, op: Operation) -> None:
        assert ops.events(op.id)[-1].attributes["evidence"] == text

    return check


def reference_kept(text: str) -> Callable[[Ops, Operation], None]:
    def check(ops: Ops, op: Operation) -> None:
        after = ops.get(op.id)
        assert (after.state, after.provider_reference) == (S.COMMITTED, text)

    return check


def lifetime_kept(lifetime: timedelta) -> Callable[[Ops, Operation], None]:
    def check(ops: Ops, op: Operation) -> None:
        with psycopg.connect(ops.database_url, autocommit=True) as connection:
            row = connection.execute(
                "SELECT decision, expires_at - created_at FROM approvals WHERE operation_id = %s",
                (op.id,),
            ).fetchone()
        assert row is not None
        assert row[0] == "granted"
        # expires_at and created_at are two clock readings of one insert: they differ
        # from the lifetime by far less than the minutes between the choices.
        assert abs(row[1] - lifetime) < timedelta(minutes=1)

    return check


def rejected(evidence: str, **more: Any) -> Case:
    return Case(
        "resolve",
        ["--rejected", "--evidence", evidence],
        {"resolution": "rejected", "reason": evidence},
        **more,
    )


def committed(reference: str, **more: Any) -> Case:
    return Case(
        "resolve",
        ["--committed", "--provider-ref", reference, "--evidence", "seen in the dashboard"],
        {"resolution": "committed", "provider_reference": reference, "reason": "seen"},
        **more,
    )


REFERENCE = "a provider reference is 1 to 200 printable characters, on one line"
CASES = {
    "evidence of 0 characters": rejected(
        "", refused="the evidence is empty: say what the decision rests on"
    ),
    "evidence of 500 characters": rejected("e" * 500, kept=evidence_kept("e" * 500)),
    "evidence of 501 characters": rejected(
        "e" * 501,
        refused="the evidence is 501 characters; at most 500 are kept, so shorten it rather "
        "than lose its end",
    ),
    "evidence with a control character": rejected(
        "seen \x1b[31m in red",
        refused="the evidence holds control characters: write it as plain text (lines and "
        "tabs are fine)",
    ),
    "evidence on two lines": rejected(
        "line one\n\tline two", kept=evidence_kept("line one\n\tline two")
    ),
    "a reference of 200 characters": committed("r" * 200, kept=reference_kept("r" * 200)),
    "a reference of 201 characters": committed(REF_201, refused=REFERENCE),
    "a reference of 500 characters": committed("r" * 500, refused=REFERENCE),
    "a reference of 501 characters": committed("r" * 501, refused=REFERENCE),
    "a reference with a newline": committed("re_1\nre_2", refused=REFERENCE),
    "committed without a reference": Case(
        "resolve",
        ["--committed", "--evidence", "seen"],
        {"resolution": "committed", "reason": "seen"},
        refused="committed needs the provider's reference of the effect",
    ),
    "a reference with another resolution": Case(
        "resolve",
        ["--rejected", "--provider-ref", "re_1", "--evidence", "seen"],
        {"resolution": "rejected", "provider_reference": "re_1", "reason": "seen"},
        refused="a provider reference goes with committed only",
    ),
    "a short id": rejected(
        "named by its short id",
        name=lambda op: f"op_{op.id.hex[:8]}",
        kept=evidence_kept("named by its short id"),
    ),
    "a malformed id": rejected("seen", name=lambda op: "op_zz", refused=BAD_NAME, not_found=True),
    "a grant with a lifetime": Case(
        "approval",
        ["grant", "--ttl", "1h"],
        {"decision": "grant", "ttl": "1h"},
        kept=lifetime_kept(timedelta(hours=1)),
    ),
    "a grant without a lifetime": Case(
        "approval", ["grant"], {"decision": "grant"}, kept=lifetime_kept(timedelta(minutes=15))
    ),
    "a denial with a lifetime": Case(
        "approval",
        ["deny", "--ttl", "1h"],
        {"decision": "deny", "ttl": "1h"},
        refused="a denial takes no lifetime: it stands until a later grant supersedes it",
    ),
}


class Cli:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, case: Case, op: Operation) -> tuple[int, str]:
        if case.kind == "resolve":
            argv = ["ops", "resolve", case.name(op), *case.cli, "--by", "ana"]
        else:
            action, *rest = case.cli
            argv = ["approvals", action, case.name(op), *rest, "--by", "ana"]
            argv += ["--intent", op.input_fingerprint]
        code = run_command(argv)
        return code, self.capsys.readouterr().err


def console_post(browser: TestClient, case: Case, op: Operation) -> tuple[int, str]:
    path = "resolve" if case.kind == "resolve" else "approval"
    data = {"csrf_token": csrf(browser), **case.form}
    if case.kind == "approval":
        data["fingerprint"] = op.input_fingerprint
    answer = browser.post(f"/operations/{case.name(op)}/{path}", data=data)
    return answer.status_code, html.unescape(answer.text)


def subject(ops: Ops, case: Case) -> Operation:
    return ops.at(S.ESCALATED) if case.kind == "resolve" else ops.new(amount_cents=90_000)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_every_front_end_accepts_or_refuses_alike(
    case: Case,
    browser: TestClient,
    ops: Ops,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    caplog.set_level(logging.DEBUG)
    cli = Cli(capsys)
    logged_in(browser)
    by_cli, by_console = subject(ops, case), subject(ops, case)
    before = counts(database_url)

    code, err = cli(case, by_cli)
    status, page = console_post(browser, case, by_console)

    if case.refused is None:
        assert (code, status) == (0, 303), (err, page)
        case.kept(ops, by_cli)
        case.kept(ops, by_console)
        return
    said = f"{case.refused}; nothing was changed" if not case.not_found else case.refused
    if case.not_found:
        # Malformed: a usage error for the command (2), no such page for the console.
        assert (code, status) == (2, 404)
    else:
        assert (code, status) == (2, 400)
    assert said in err.strip().splitlines()[-1]
    assert said in page
    assert counts(database_url) == before
    # A refusal quotes none of what was typed: the long values would show here.
    assert REF_201 not in err + page + caplog.text


@pytest.mark.parametrize("short", [True, False], ids=["a short id", "a malformed id"])
def test_the_operation_page_reads_the_names_ops_show_reads(
    short: bool,
    browser: TestClient,
    ops: Ops,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    logged_in(browser)
    operation = ops.at(S.ESCALATED)
    name = f"op_{operation.id.hex[:8]}" if short else "op_zz"

    code = run_command(["ops", "show", name])
    shown = capsys.readouterr()
    page = browser.get(f"/operations/{name}")

    if short:
        assert (code, page.status_code) == (0, 200)
        assert operation.display_id in shown.out
        assert operation.display_id in page.text
        return
    assert (code, page.status_code) == (2, 404)
    assert BAD_NAME in shown.err.splitlines()[-1]
    assert BAD_NAME in html.unescape(page.text)
