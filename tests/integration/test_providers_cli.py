"""`outbox providers`, run in process against a real database: each provider's breaker
as a person on call reads it (state, outage, probes, Retry-After, what waits for it),
one provider's outages newest first, the JSON shapes, and the refusals. The breaker
rows and events are written straight into the test's database, as the consumer would
have left them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import uuid4

import pytest

from outbox import Operation, Registry
from outbox.cli import run_command
from outbox.operator.render_providers import NO_PROVIDER_ROWS

from support.console_helpers import operator_login
from support.ops_helpers import Ops
from support.provider_helpers import put_event, put_provider, wait_for_provider
from support.provider_tools import SHARED_PROVIDER

SAMPLE_TOOLS = "support.sample_tools"
SHARED_TOOLS = "support.provider_tools"
# Clears the screen, starts a line over, and overrides the text direction.
HOSTILE = "x\x1b[2J\r\u202eevil"


class Cli:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        code = run_command(list(argv))
        captured = self.capsys.readouterr()
        return code, captured.out, captured.err

    def ok(self, *argv: str) -> str:
        code, out, err = self(*argv)
        assert code == 0, err
        return out

    def json(self, *argv: str) -> Any:
        return json.loads(self.ok(*argv, "--json"))


@pytest.fixture
def cli(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Cli:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    # Whether the tools modules are loaded is each test's choice (--tools).
    monkeypatch.delenv("OUTBOX_TOOLS", raising=False)
    return Cli(capsys)


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def waiting(database_url: str, ops: Ops, tool: str, count: int) -> list[Operation]:
    held = [ops.new(tool=tool) for _ in range(count)]
    wait_for_provider(database_url, held, tool)
    return held


@pytest.fixture
def outage(database_url: str, ops: Ops) -> dict[str, list[Operation]]:
    """send_refund's provider down for 12 minutes after 3 failed probes, open_ticket's
    probe out, a third provider closed with two failures in its streak and a
    Retry-After ahead; operations of both tools waiting."""
    put_provider(
        database_url,
        "send_refund",
        probes=3,
        next_probe_in=timedelta(seconds=40),
        last_failure="connect_timeout",
    )
    put_provider(
        database_url,
        "open_ticket",
        state="half_open",
        down_for=timedelta(minutes=3),
        probes=1,
        probe_owner="host:1:probe",
        last_failure="http_503",
    )
    put_provider(
        database_url,
        "mailer",
        state="closed",
        failing=[uuid4(), uuid4()],
        not_before_in=timedelta(minutes=5),
        last_failure="http_429",
    )
    return {
        "send_refund": waiting(database_url, ops, "send_refund", 2),
        "open_ticket": waiting(database_url, ops, "open_ticket", 1),
    }


# --- the breakers ---------------------------------------------------------------------------


def test_with_no_row_it_says_no_provider_has_failed(cli: Cli) -> None:
    assert cli.ok("providers").strip() == NO_PROVIDER_ROWS
    assert cli.json("providers") == {
        "providers": [],
        "tools_loaded": False,
        "waiting_by_tool": {},
        "unattributed_waiting": None,
    }
    assert cli.ok("providers", "--tools", SAMPLE_TOOLS).strip() == NO_PROVIDER_ROWS


def test_one_line_per_breaker_with_what_waits_for_each_provider(
    cli: Cli, outage: dict[str, list[Operation]]
) -> None:
    out = cli.ok("providers", "--tools", SAMPLE_TOOLS)

    header, *rows = out.splitlines()
    assert cells(header) == [
        "PROVIDER", "STATE", "OUTAGE SINCE", "PROBES", "NEXT PROBE", "NOT BEFORE",
        "LAST FAILURE", "WAITING",
    ]  # fmt: skip
    table = {cells(row)[0]: cells(row) for row in rows}
    assert list(table) == ["mailer", "open_ticket", "send_refund"]  # by name
    refund = table["send_refund"]
    assert refund[1] == "open"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(12m\)", refund[2]), refund
    assert refund[3] == "3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", refund[4]), refund
    assert refund[5:] == ["-", "connect_timeout", "2"]
    ticket = table["open_ticket"]
    assert ticket[1:4] == ["half_open", ticket[2], "1"]
    assert ticket[2].endswith("(3m)")
    assert ticket[4].startswith("out until ")
    assert ticket[5:] == ["-", "http_503", "1"]
    mailer = table["mailer"]
    # Closed, a streak on its way to opening it, and the provider's Retry-After.
    assert mailer[1:5] == ["closed, 2 failing", "-", "0", "-"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", mailer[5]), mailer
    assert mailer[6:] == ["http_429", "0"]


def test_without_the_tools_modules_waiting_is_shown_by_tool(
    cli: Cli, outage: dict[str, list[Operation]]
) -> None:
    out = cli.ok("providers")

    *table, last = out.splitlines()
    assert "WAITING" not in table[0]
    assert len(table) == 4
    assert last == (
        "waiting for their provider, by tool: open_ticket 1, send_refund 2 "
        "(--tools MODULE counts them per provider)"
    )


def test_tools_that_share_a_provider_count_for_it(
    cli: Cli, database_url: str, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_provider(database_url, SHARED_PROVIDER, probes=2, next_probe_in=timedelta(seconds=8))
    waiting(database_url, ops, "send_refund", 2)
    waiting(database_url, ops, "open_ticket", 1)
    # The variable serves as the flag does.
    monkeypatch.setenv("OUTBOX_TOOLS", SHARED_TOOLS)

    _header, row = cli.ok("providers").splitlines()

    assert cells(row)[0] == SHARED_PROVIDER
    assert cells(row)[-1] == "3"
    [shown] = cli.json("providers")["providers"]
    assert shown["tools"] == ["open_ticket", "send_refund"]
    assert shown["waiting_operations"] == 3


def test_waiting_operations_no_listed_provider_accounts_for_are_named(
    cli: Cli, outage: dict[str, list[Operation]]
) -> None:
    # The shared module maps both tools to `payments`, which has no row here.
    out = cli.ok("providers", "--tools", SHARED_TOOLS)

    assert out.splitlines()[-1] == (
        "also waiting, of tools the tools modules do not map to a provider above: "
        "open_ticket 1, send_refund 2"
    )


def test_the_json_document_carries_the_row_as_stored(
    cli: Cli, outage: dict[str, list[Operation]]
) -> None:
    document = cli.json("providers", "--tools", SAMPLE_TOOLS)

    assert set(document) == {"providers", "tools_loaded", "waiting_by_tool", "unattributed_waiting"}
    assert document["tools_loaded"] is True
    assert document["waiting_by_tool"] == {"open_ticket": 1, "send_refund": 2}
    assert document["unattributed_waiting"] == {}
    refund = next(p for p in document["providers"] if p["provider"] == "send_refund")
    assert set(refund) == {
        "provider", "state", "available", "outage_started_at", "outage_seconds", "opened_at",
        "probes", "next_probe_at", "probe_owner", "probe_expires_at", "not_before",
        "last_failure", "failing_operations", "failing_since", "updated_at", "last_event_at",
        "tools", "waiting_operations",
    }  # fmt: skip
    assert (refund["state"], refund["available"], refund["probes"]) == ("open", False, 3)
    assert 12 * 60 <= refund["outage_seconds"] < 13 * 60
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", refund["outage_started_at"])
    assert refund["tools"] == ["send_refund"]
    assert refund["waiting_operations"] == 2
    assert refund["last_event_at"] is None
    mailer = next(p for p in document["providers"] if p["provider"] == "mailer")
    assert (mailer["state"], mailer["available"], mailer["outage_seconds"]) == (
        "closed",
        True,
        None,
    )
    assert len(mailer["failing_operations"]) == 2
    assert all(op.startswith("op_") for op in mailer["failing_operations"])
    assert mailer["not_before"] is not None
    ticket = next(p for p in document["providers"] if p["provider"] == "open_ticket")
    assert ticket["probe_owner"] == "host:1:probe"
    without_tools = cli.json("providers")
    assert without_tools["tools_loaded"] is False
    assert all(p["waiting_operations"] is None for p in without_tools["providers"])
    assert without_tools["unattributed_waiting"] is None


# --- one provider's outages -----------------------------------------------------------------


@pytest.fixture
def history(database_url: str) -> list[int]:
    """Two outages of send_refund, the second still going on; one of another provider."""
    put_provider(database_url, "send_refund", probes=3, next_probe_in=timedelta(seconds=40))
    first = put_event(
        database_url,
        "send_refund",
        "provider.unavailable",
        {"failing_operations": 5, "last_failure": "connect_failed"},
        ago=timedelta(hours=3),
    )
    closed = put_event(
        database_url,
        "send_refund",
        "provider.available",
        {"outage_seconds": 754.25, "probes": 6, "operations_waited": 9, "operations_released": 9},
        ago=timedelta(hours=2),
    )
    again = put_event(
        database_url,
        "send_refund",
        "provider.unavailable",
        {"failing_operations": 5, "last_failure": "connect_timeout"},
        ago=timedelta(minutes=12),
    )
    put_event(database_url, "mailer", "provider.unavailable", {}, ago=timedelta(hours=1))
    return [again, closed, first]


def test_events_lists_one_providers_outages_newest_first(cli: Cli, history: list[int]) -> None:
    out = cli.ok("providers", "--events", "send_refund")

    head, blank, title, header, *rows = out.splitlines()
    assert head.startswith("send_refund: open, down since ")
    assert "(12m), 3 probe(s), next probe " in head
    assert head.endswith("last failure connect_failed")
    assert blank == ""
    assert title == "outage events (3, newest first)"
    assert cells(header) == ["ID", "AT", "EVENT", "ATTRIBUTES"]
    assert [int(cells(row)[0]) for row in rows] == history
    assert [cells(row)[2] for row in rows] == [
        "provider.unavailable",
        "provider.available",
        "provider.unavailable",
    ]
    assert cells(rows[1])[3] == (
        "operations_released=9 operations_waited=9 outage_seconds=754.25 probes=6"
    )
    # The listing names the last event.
    [row] = cli.json("providers")["providers"]
    assert row["last_event_at"] is not None


def test_events_json_and_the_limit(cli: Cli, history: list[int]) -> None:
    document = cli.json("providers", "--events", "send_refund", "--limit", "2")

    assert set(document) == {"provider", "health", "events"}
    assert document["provider"] == "send_refund"
    assert document["health"]["state"] == "open"
    assert [event["id"] for event in document["events"]] == history[:2]
    assert document["events"][1] == {
        "id": history[1],
        "name": "provider.available",
        "at": document["events"][1]["at"],
        "attributes": {
            "outage_seconds": 754.25,
            "probes": 6,
            "operations_waited": 9,
            "operations_released": 9,
        },
    }
    text = cli.ok("providers", "--events", "send_refund", "--limit", "2")
    assert text.splitlines()[-1] == "(the newest 2; --limit N shows more)"


def test_events_of_a_provider_with_a_row_and_no_outage_yet(cli: Cli, database_url: str) -> None:
    put_provider(database_url, "mailer", state="closed", failing=[uuid4()])

    out = cli.ok("providers", "--events", "mailer")

    assert out.splitlines() == [
        "mailer: closed, 1 failing, last failure connect_failed",
        "",
        "outage events (0, newest first)",
    ]


def test_events_of_an_unknown_provider_exit_1_naming_the_known_ones(
    cli: Cli, history: list[int]
) -> None:
    code, out, err = cli("providers", "--events", "send_refnud")

    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        "outbox providers: 'send_refnud' has no breaker row and no outage event in this "
        "database: it has never failed, or it is not a provider's name (providers with a "
        "row: send_refund)"
    ]


def test_a_limit_without_events_is_a_usage_error(cli: Cli) -> None:
    code, out, err = cli("providers", "--limit", "5")

    assert code == 2
    assert out == ""
    assert "--limit goes with --events only" in err
    with pytest.raises(SystemExit) as exit_info:
        cli("providers", "--events", "x", "--limit", "0")
    assert exit_info.value.code == 2


def test_what_someone_else_chose_is_shown_escaped(cli: Cli, database_url: str) -> None:
    put_provider(database_url, "send_refund")
    put_event(
        database_url, "send_refund", "provider.unavailable", {"note": HOSTILE}, ago=timedelta(0)
    )

    shown = cli.ok("providers", "--events", "send_refund")
    code, _, err = cli("providers", "--events", HOSTILE)

    assert "\x1b" not in shown
    assert "\r" not in shown
    assert "\u202e" not in shown
    assert 'note="x\\u001b[2J\\r\\u202eevil"' in shown
    assert code == 1
    assert "\x1b" not in err
    assert "\u202e" not in err
    assert cli.json("providers", "--events", "send_refund")["events"][0]["attributes"] == {
        "note": HOSTILE
    }


# --- as the operator's login ----------------------------------------------------------------


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


def test_an_operator_login_reads_the_breakers_and_their_events(
    cli: Cli,
    database_url: str,
    outage: dict[str, list[Operation]],
    operator_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put_event(database_url, "send_refund", "provider.unavailable", {}, ago=timedelta(minutes=12))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", operator_url)

    listed = cli.json("providers", "--tools", SAMPLE_TOOLS)
    events = cli.json("providers", "--events", "send_refund")

    assert {p["provider"]: p["waiting_operations"] for p in listed["providers"]} == {
        "mailer": 0,
        "open_ticket": 1,
        "send_refund": 2,
    }
    assert [event["name"] for event in events["events"]] == ["provider.unavailable"]
