"""The overview's providers table, as an operator's login reads it: shown only while a
provider is down, held back by its Retry-After or has operations waiting, with what
`outbox providers` shows for the same rows."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from uuid import uuid4

import pytest
from starlette.testclient import TestClient

from outbox import Settings

from support.console_helpers import client, console, console_settings, logged_in
from support.ops_helpers import Ops
from support.provider_helpers import put_provider, wait_for_provider


def section(html: str) -> str | None:
    """The providers card of the overview, or None when the page has none."""
    if 'id="providers"' not in html:
        return None
    return html.split('id="providers"')[1].split("</section>")[0]


def headers(card: str) -> list[str]:
    return re.findall(r"<th(?:\s[^>]*)?>(.*?)</th>", card)


def rows(card: str) -> dict[str, list[str]]:
    """Provider -> the text of its cells."""
    body = card.split("<tbody>")[1].split("</tbody>")[0]
    found = {}
    for row in re.findall(r"<tr>(.*?)</tr>", body, re.S):
        texts = [
            re.sub(r"<[^>]+>", "", cell).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        ]
        found[texts[0]] = texts
    return found


def test_no_card_while_every_provider_is_closed_and_nothing_waits(
    browser: TestClient, database_url: str
) -> None:
    html = logged_in(browser).get("/").text
    assert section(html) is None

    # A closed breaker with a failure or two in its streak is not news yet.
    put_provider(database_url, "send_refund", state="closed", failing=[uuid4()])
    assert section(browser.get("/").text) is None


def test_an_open_provider_is_shown_with_its_outage_probes_and_waiting_operations(
    browser: TestClient, database_url: str, ops: Ops
) -> None:
    put_provider(database_url, "send_refund", probes=4, next_probe_in=timedelta(seconds=20))
    put_provider(
        database_url,
        "open_ticket",
        state="half_open",
        down_for=timedelta(minutes=2),
        probes=1,
        probe_owner="host:1:probe",
    )
    put_provider(database_url, "mailer", state="closed", last_failure="http_503")
    wait_for_provider(database_url, [ops.new(), ops.new()], "send_refund")

    card = section(logged_in(browser).get("/").text)

    assert card is not None
    assert headers(card) == [
        "Provider",
        "State",
        "Outage since",
        "Probes",
        "Waiting",
    ]
    shown = rows(card)
    assert list(shown) == ["open_ticket", "send_refund"]  # mailer is closed, nothing waits
    refund = shown["send_refund"]
    assert refund[1] == "open"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(12m\)", refund[2]), refund
    assert refund[3:] == ["4", "2"]
    assert shown["open_ticket"][1:2] == ["half_open"]
    assert shown["open_ticket"][3:] == ["1", "0"]
    assert 'class="state state-open"' in card
    assert "1 other provider(s) closed, nothing waiting." in card
    assert "<code>outbox providers</code>" in card


def test_a_retry_after_still_ahead_shows_a_closed_provider(
    browser: TestClient, database_url: str
) -> None:
    put_provider(database_url, "send_refund", state="closed", not_before_in=timedelta(minutes=5))

    card = section(logged_in(browser).get("/").text)

    assert card is not None
    cells = rows(card)["send_refund"]
    assert cells[1].startswith("closed not before ")
    assert cells[2:] == ["-", "0", "0"]


@pytest.fixture
def console_without_tools(settings: Settings, operator_url: str) -> Iterator[TestClient]:
    with client(console(console_settings(settings, operator_url))) as test_client:
        yield test_client


def test_without_tools_modules_waiting_operations_are_counted_by_tool(
    console_without_tools: TestClient, database_url: str, ops: Ops
) -> None:
    put_provider(database_url, "send_refund", probes=1)
    wait_for_provider(database_url, [ops.new(), ops.new()], "send_refund")
    wait_for_provider(database_url, [ops.new(tool="open_ticket")], "open_ticket")

    card = section(logged_in(console_without_tools).get("/").text)

    assert card is not None
    assert "Waiting" not in headers(card)
    assert rows(card)["send_refund"][1:2] == ["open"]
    waiting = card.split('id="providers-waiting">')[1].split("<span")[0]
    assert waiting.strip() == "Waiting for their provider, by tool: open_ticket 1, send_refund 2"
