"""What the console's pages show: escaped text, keyset pages and filters, the overview, an
operation with its chain, the escalations.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from starlette.testclient import TestClient

from outbox import Registry
from outbox import store as outbox_store
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.cli import run_command
from outbox.console.app import Console
from outbox.errors import ReadOnlyDatabase
from outbox.models import CallbackOutcome, Operation
from outbox.store import OperationFilter, Store

from support.console_cases import S
from support.console_helpers import CANARY, client, logged_in
from support.db_helpers import index_plan
from support.ops_helpers import Ops

# --- escaping -------------------------------------------------------------------------------


def test_agent_and_provider_text_is_shown_escaped(
    browser: TestClient, database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry, free_text=CANARY)
    waiting = ops.new(amount_cents=90_000, run_id=CANARY)
    escalated = ops.at(S.ESCALATED, run_id=CANARY)
    committed = ops.run(
        outbox_store.resolve_operation(
            escalated.id,
            source=S.ESCALATED,
            target=S.COMMITTED,
            decision="committed",
            resolved_by="setup",
            evidence=CANARY,
            provider_reference=CANARY,
        )
    )
    logged_in(browser)

    for path in [
        "/",
        "/operations",
        f"/operations?run_id={CANARY}",
        "/approvals",
        f"/operations/{waiting.display_id}",
        f"/operations/{committed.display_id}",
    ]:
        html = browser.get(path).text
        assert "<script>" not in html, path
        assert "&lt;script&gt;" in html or path == "/", path


# --- listings -------------------------------------------------------------------------------


def test_pages_follow_a_keyset_without_gaps_or_repeats(
    database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry)
    made = {ops.new(amount_cents=100 + n, run_id="paged").id for n in range(7)}
    ops.new(run_id="elsewhere")
    seen: list[Any] = []
    after = None
    with psycopg.connect(database_url) as connection:
        while True:
            page = Store(connection).run(
                outbox_store.operations_page(OperationFilter(run_id="paged"), after=after, limit=3)
            )
            seen += [row.id for row in page.rows]
            if page.next is None:
                break
            after = page.next

    assert len(seen) == 7
    assert set(seen) == made


def test_the_operations_page_filters_and_links_to_the_next_page(
    browser: TestClient, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    for n in range(3):
        ops.new(amount_cents=100 + n, run_id="listed")
    ops.new(tool="open_ticket", run_id="listed")
    logged_in(browser)

    first = browser.get("/operations?run_id=listed&tool=send_refund&state=prepared")
    assert first.status_code == 200
    assert first.text.count('href="/operations/op_') == 2
    assert "open_ticket" not in first.text.split('id="operations"')[1]
    link = first.text.split('id="next-page" href="')[1].split('"')[0].replace("&amp;", "&")
    second = browser.get(link)
    assert second.text.count('href="/operations/op_') == 1
    assert 'id="next-page"' not in second.text


@pytest.mark.parametrize(
    "query",
    ["state=exploded", "since=yesterday", "after_ts=2026-01-01T00:00:00", "after_id=x&after_ts=1"],
)
def test_a_bad_filter_is_refused_not_ignored(browser: TestClient, query: str) -> None:
    answer = logged_in(browser).get(f"/operations?{query}")

    assert answer.status_code == 400


def test_the_overview_counts_what_waits_for_a_person(browser: TestClient, ops: Ops) -> None:
    escalated = ops.at(S.ESCALATED)
    ops.new(amount_cents=90_000)

    html = logged_in(browser).get("/").text

    assert 'http-equiv="refresh"' in html
    tile = html.split('id="tile-escalations"')[1].split("</a>")[0]
    assert '<span class="big">1</span>' in tile
    tile = html.split('id="tile-approvals"')[1].split("</a>")[0]
    assert '<span class="big">1</span>' in tile
    assert escalated.display_id in html


def test_the_overview_says_which_counts_are_estimates(
    browser: TestClient, ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the threshold (forced to 0) committed and rejected are estimated from a
    # sample and read "about N"; the open states stay counts. Below it, nothing does.
    for state in (S.COMMITTED, S.COMMITTED, S.REJECTED, S.ESCALATED):
        ops.at(state)
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute("ANALYZE operations")
    logged_in(browser)

    def cells() -> tuple[dict[str, str], str]:
        html = browser.get("/").text
        table = html.split('id="by-state"')[1].split("</section>")[0]
        row = table.split("<tr><td>send_refund</td>")[1].split("</tr>")[0]
        shown = re.findall(r'state=([a-z_]+)&amp;tool=send_refund">([^<]*)</a>', row)
        return dict(shown), table

    exact, exact_table = cells()
    monkeypatch.setattr("outbox.console.pages.EXACT_SETTLED_COUNT_BELOW", 0)
    estimated, estimated_table = cells()

    assert exact == {
        "prepared": "0", "in_flight": "0", "committed": "2",
        "rejected": "1", "outcome_unknown": "0", "escalated": "1",
    }  # fmt: skip
    assert "about" not in exact_table
    assert estimated == {
        **exact, "committed": "about 2", "rejected": "about 1",
    }  # fmt: skip
    assert 'id="by-state-estimated"' in estimated_table
    assert "committed and rejected are estimated" in estimated_table


def test_the_operation_page_shows_timeline_card_and_approvals(
    browser: TestClient, ops: Ops
) -> None:
    op = ops.at(S.ESCALATED)

    html = logged_in(browser).get(f"/operations/{op.display_id}").text

    for name in ops.event_names(op.id):
        assert name in html
    assert "send_refund v1" in html
    assert "Refund part or all of a captured payment" in html  # the contract card
    assert 'id="resolve"' in html


# One form for a time a person reads, to the second; JSON keeps the microseconds.
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def test_the_console_and_ops_show_print_each_time_alike(
    browser: TestClient,
    ops: Ops,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # They mixed "+00:00" with microseconds and "Z" with milliseconds, and the
    # console's timeline wrapped them.
    op = ops.at(S.ESCALATED)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)

    html = logged_in(browser).get(f"/operations/{op.display_id}").text
    timeline = html.split('id="timeline"', 1)[1].split("</table>", 1)[0]
    on_the_page = re.findall(r'<td class="mono stamp">([^<]*)</td>', timeline)
    assert run_command(["ops", "show", op.display_id]) == 0
    shown = capsys.readouterr().out
    in_the_terminal = re.findall(rf"^  ({STAMP})  ", shown, flags=re.MULTILINE)
    assert run_command(["ops", "show", op.display_id, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)

    events = ops.run(outbox_store.events(op.id))
    assert len(on_the_page) == len(events) > 1
    assert on_the_page == in_the_terminal
    assert all(re.fullmatch(STAMP, each) for each in on_the_page)
    # Cut to the second, never rounded up past the moment itself.
    assert on_the_page == [f"{e.created_at.astimezone(UTC):%Y-%m-%dT%H:%M:%S}Z" for e in events]
    created = f"{op.created_at.astimezone(UTC):%Y-%m-%dT%H:%M:%S}Z"
    assert f'<dt>Created</dt><dd class="mono nowrap">{created}</dd>' in html
    assert re.search(rf"^created +{created}$", shown, flags=re.MULTILINE)
    assert [event["at"] for event in document["events"]] == [
        e.created_at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        for e in events
    ]


def test_the_operation_page_shows_its_provider_callbacks_escaped(
    browser: TestClient, ops: Ops
) -> None:
    op = ops.at(S.ESCALATED)
    report = CallbackReport(
        event_id="evt_console",
        status=CallbackStatus.COMMITTED,
        operation_id=op.id,
        provider_reference=f"re_{CANARY}",
    )
    receipt = ops.run(outbox_store.record_callback("payments", report, "f" * 64))

    console = logged_in(browser)
    html = console.get(f"/operations/{op.display_id}").text

    timeline = html.split('id="timeline"')[1].split("</table>")[0]
    assert "operation.callback_received" not in timeline  # chained when applied
    table = html.split('id="callbacks"')[1].split("</table>")[0]
    assert f"<td>{receipt.callback_id}</td>" in table
    assert "evt_console" in table
    assert "not applied yet" in table
    assert CANARY not in html  # a provider's text is escaped, never markup

    # Applied (evidence, for an escalated operation), it is in the timeline too.
    [callback] = ops.run(outbox_store.callbacks_of([op.id]))[op.id]
    ops.run(outbox_store.mark_callback(callback, CallbackOutcome.EVIDENCE))
    html = console.get(f"/operations/{op.display_id}").text
    timeline = html.split('id="timeline"')[1].split("</table>")[0]
    assert "operation.callback_received" in timeline
    assert CANARY not in html
    assert "re_&lt;script&gt;" in table


# --- the evidence chain ---------------------------------------------------------------------


@pytest.fixture
def chain_console(app_console: Console) -> Iterator[TestClient]:
    with client(app_console) as test_client:
        yield logged_in(test_client)


def chain_text(test_client: TestClient, op: Operation) -> str:
    html = test_client.get(f"/operations/{op.display_id}").text
    return html.split('id="evidence-chain">')[1].split("</dd>")[0]


def test_the_operation_page_shows_an_intact_chain(chain_console: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)

    assert f"intact, {len(ops.events(op.id))} events" in chain_text(chain_console, op)


def test_the_operation_page_names_the_altered_event(
    chain_console: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    altered = ops.events(op.id)[1]
    with psycopg.connect(database_url) as connection:
        # Past the append-only trigger, as only a superuser can go.
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operation_events SET attributes = '{\"attempt\": 9}' WHERE id = %s",
            (altered.id,),
        )

    shown = chain_text(chain_console, op)

    assert "broken" in shown
    assert f"event {altered.id} (hash_mismatch)" in shown


def test_a_page_reads_in_a_read_only_transaction(
    app_console: Console, ops: Ops, database_url: str
) -> None:
    from outbox.console import pages

    op = ops.at(S.ESCALATED)
    write = outbox_store.resolve_operation(
        op.id,
        source=S.ESCALATED,
        target=S.REJECTED,
        decision="rejected",
        resolved_by="a page",
        evidence="pages never write",
    )

    with pytest.raises(ReadOnlyDatabase, match="ReadOnlySqlTransaction"):
        pages._db(app_console.settings, lambda runner: runner.run(write))
    assert ops.get(op.id).state is S.ESCALATED


@pytest.mark.parametrize(
    "query", ["run_id=run%00", "tool=send%1b[2J", f"run_id={'r' * 201}", "tool=send%C2%85refund"]
)
def test_a_filter_with_control_characters_or_too_long_is_a_400(
    browser: TestClient, query: str
) -> None:
    answer = logged_in(browser).get(f"/operations?{query}")

    assert answer.status_code == 400
    assert "control characters" in answer.text


def test_filter_values_are_escaped_in_inputs_and_the_next_page_link(
    browser: TestClient, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 1)
    hostile = "\"'><script>alert(1)</script>&x=1"
    for _ in range(2):
        ops.new(run_id=hostile)
    logged_in(browser)

    html = browser.get("/operations", params={"run_id": hostile}).text

    assert "<script>" not in html
    assert 'value="&#34;&#39;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&amp;x=1"' in html
    link = html.split('id="next-page" href="')[1].split('"')[0].replace("&amp;", "&")
    assert parse_qs(urlsplit(link).query)["run_id"] == [hostile]
    second = browser.get(link)
    assert second.status_code == 200
    assert second.text.count('href="/operations/op_') == 1


def test_pages_with_tied_change_times_have_no_gaps_or_repeats(
    browser: TestClient, ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    made = [ops.new(amount_cents=100 + n, run_id="tied").id for n in range(5)]
    with psycopg.connect(database_url) as connection:
        # One instant for all: past the trigger that stamps updated_at, as a superuser.
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = '2026-01-01T00:00:00Z' WHERE run_id = 'tied'"
        )
    logged_in(browser)

    seen: list[str] = []
    path: str | None = "/operations?run_id=tied"
    while path is not None:
        html = browser.get(path).text
        seen += re.findall(r'href="/operations/(op_[^"]+)"', html)
        found = re.search(r'id="next-page" href="([^"]+)"', html)
        path = found.group(1).replace("&amp;", "&") if found else None

    assert seen == [f"op_{i}" for i in sorted(made, reverse=True)]


def test_the_keyset_is_read_from_an_index(database_url: str) -> None:
    plan = index_plan(
        database_url,
        "SELECT id FROM operations"
        " WHERE (updated_at, id)"
        " < ('2026-01-01T00:00:00Z', '00000000-0000-0000-0000-000000000000')"
        " ORDER BY updated_at DESC, id DESC LIMIT 51",
    )

    assert "Scan Backward using operations_updated" in plan, plan


def test_the_escalations_page_says_why_each_waits_and_for_how_long(
    browser: TestClient, ops: Ops
) -> None:
    tampered = ops.escalated_at_claim("tampered", check="fingerprint_mismatch")
    logged_in(browser)

    html = browser.get("/escalations").text

    row = html.split(f'href="/operations/{tampered.display_id}"')[1].split("</tr>")[0]
    assert '<td class="reason">tampered</td>' in row
    assert re.search(r'<td class="num" title="[^"]+">\d+s</td>', row), row
