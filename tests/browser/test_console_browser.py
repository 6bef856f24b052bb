"""Clicking through the operator console in chromium: an escalation found, read and
resolved; an approval granted that lets the consumer execute; a stale approval page
refused; agent text rendered as text. The database is checked after every click that
should change it, and after every one that should not."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from pathlib import Path

import psycopg
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from outbox import OperationState, Registry, Settings, record_decision
from outbox import store as outbox_store
from outbox.broker import OperationMessage

from support.console_browser import Browser
from support.console_helpers import CANARY, OPERATOR, dead_letter_one
from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import running_dispatcher
from support.ops_helpers import Ops
from support.sample_tools import Ledger
from support.waiting import eventually

pytestmark = pytest.mark.browser

S = OperationState
# Where the screenshots go: docs/ to refresh the ones the README shows.
SCREENSHOTS_ENV = "OUTBOX_CONSOLE_SCREENSHOTS"


def approvals_of(database_url: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        return [
            (str(row[0]), row[1], row[2])
            for row in connection.execute(
                "SELECT operation_id, decision, approved_by FROM approvals"
            )
        ]


def test_an_escalation_is_found_read_and_resolved(
    browser: Browser, database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry)
    escalated = ops.at(S.ESCALATED)
    ops.at(S.COMMITTED)
    browser.login()

    # Found from the overview: its tile, then its row.
    assert browser.driver.find_element(By.ID, "tile-escalations").text.startswith("1")
    link = f'#operations a[href="/operations/{escalated.display_id}"]'
    browser.driver.find_element(By.CSS_SELECTOR, link).click()
    browser.wait_for(lambda d: d.find_elements(By.ID, "timeline"), "the operation page")

    timeline = browser.text("timeline")
    assert "operation.outcome_unknown" in timeline
    assert "operation.escalated" in timeline
    assert "Refund part or all of a captured payment" in browser.text("contract")
    assert browser.text("evidence-chain") == f"intact, {len(ops.events(escalated.id))} events"

    browser.driver.find_element(By.ID, "resolution-committed").click()
    browser.driver.find_element(By.ID, "provider-ref").send_keys("re_found_in_dashboard")
    browser.driver.find_element(By.ID, "reason").send_keys("refund visible in the dashboard")
    browser.driver.find_element(By.ID, "resolve-submit").click()
    browser.wait_for(lambda d: d.find_element(By.ID, "state").text == "committed", "committed")

    settled = ops.get(escalated.id)
    assert settled.state is S.COMMITTED
    assert settled.provider_reference == "re_found_in_dashboard"
    resolved = ops.events(escalated.id)[-1]
    assert resolved.name == "operation.resolved"
    assert resolved.attributes["by"] == OPERATOR
    assert resolved.attributes["evidence"] == "refund visible in the dashboard"
    assert "operation.resolved" in browser.text("timeline")


def test_many_escalations_from_one_fault_are_previewed_then_resolved_at_once(
    browser: Browser, database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry)
    fault = [ops.escalated_for("lookups_unavailable", run_id="run_fault_4711") for _ in range(3)]
    other = ops.escalated_for("tampered", run_id="run_fault_4711")
    browser.login()

    browser.open("/escalations")
    browser.driver.find_element(By.ID, "batch-run").send_keys("run_fault_4711")
    browser.driver.find_element(By.ID, "batch-reason").send_keys("lookups_unavailable")
    browser.driver.find_element(By.ID, "batch-preview").click()
    browser.wait_for(lambda d: d.find_elements(By.ID, "batch-count"), "the preview")

    assert browser.text("batch-count").startswith("3 escalated operation(s) match; 3 would be")
    listed = browser.text("batch-operations")
    assert all(op.display_id[:11] in listed for op in fault)
    assert other.display_id[:11] not in listed
    assert [ops.get(op.id).state for op in [*fault, other]] == [S.ESCALATED] * 4

    browser.driver.find_element(By.ID, "batch-resolution-rejected").click()
    browser.driver.find_element(By.ID, "batch-evidence").send_keys("provider incident 4711")
    browser.driver.find_element(By.ID, "batch-submit").click()
    browser.wait_for(lambda d: d.find_elements(By.ID, "batch-result"), "the batch's result")

    assert browser.text("batch-result").startswith("3 of 3 resolved as rejected")
    batch_id = browser.text("batch-id")
    for op in fault:
        assert ops.get(op.id).state is S.REJECTED
        event = ops.events(op.id)[-1]
        assert event.attributes["by"] == OPERATOR
        assert event.attributes["batch_id"] == batch_id
    assert ops.get(other.id).state is S.ESCALATED


async def test_an_approval_granted_in_the_page_lets_the_consumer_execute(
    browser: Browser,
    settings: Settings,
    database_url: str,
    registry: Registry,
    ledger: Ledger,
) -> None:
    with psycopg.connect(database_url) as connection:
        waiting = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_big", "amount_cents": 90_000},
            run_id="run_approval",
        ).operation
    assert waiting.requires_approval

    async with running_dispatcher(settings), running_consumer(settings, registry):

        async def refused_for_now() -> bool:
            names = await asyncio.to_thread(Ops(database_url, registry).event_names, waiting.id)
            return "operation.approval_required" in names

        await eventually(refused_for_now, within=20, what="the consumer to wait for approval")
        assert ledger.calls == []

        def grant_in_the_page() -> None:
            browser.login()
            browser.open("/approvals")
            card = browser.driver.find_element(By.ID, f"approval-{waiting.display_id}")
            assert '"amount_cents": 90000' in card.find_element(By.CLASS_NAME, "intent").text
            # The keyed short fingerprint, the one form a person reads anywhere.
            assert Ops(database_url, registry).short(waiting.input_fingerprint) in card.text
            card.find_element(By.NAME, "grant").click()
            browser.wait_for(lambda d: d.find_elements(By.ID, "approvals"), "the grant")

        await asyncio.to_thread(grant_in_the_page)
        await eventually(
            in_state(database_url, waiting.id, S.COMMITTED),
            within=20,
            what="the consumer to execute the approved refund",
        )

    assert len(ledger.refunds) == 1
    assert approvals_of(database_url) == [(str(waiting.id), "granted", OPERATOR)]


def test_a_stale_approval_page_for_a_changed_intent_is_refused(
    browser: Browser, database_url: str, registry: Registry
) -> None:
    waiting = Ops(database_url, registry).new(amount_cents=90_000)
    browser.login()
    browser.open("/approvals")
    assert "90000" in browser.driver.find_element(By.ID, f"approval-{waiting.display_id}").text

    # While the page is open the intent changes underneath it. Nobody can do this through
    # the runtime (the intent is frozen by a trigger): a superuser with triggers off can.
    changed = hashlib.sha256(b"a different refund").hexdigest()
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET input = jsonb_set(input, '{amount_cents}', '900000'),"
            " input_fingerprint = %s WHERE id = %s",
            (changed, waiting.id),
        )

    card = browser.driver.find_element(By.ID, f"approval-{waiting.display_id}")
    card.find_element(By.NAME, "grant").click()
    browser.wait_for(lambda d: d.find_elements(By.ID, "problem"), "the refusal")

    assert "the intent changed since it was shown" in browser.text("problem")
    assert approvals_of(database_url) == []


def test_a_script_in_agent_or_provider_text_is_shown_as_text(
    browser: Browser, database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry, free_text=CANARY)
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
    browser.login()

    browser.open(f"/operations/{committed.display_id}")
    assert browser.no_dialog()
    assert browser.text("run-id") == CANARY
    assert browser.text("provider-reference") == CANARY
    assert CANARY in browser.text("intent")
    assert CANARY in browser.text("timeline")
    # Nothing was parsed as an element either: the only scripts are none at all.
    assert browser.driver.find_elements(By.TAG_NAME, "script") == []

    browser.open(f"/operations?run_id={CANARY}")
    assert browser.no_dialog()
    assert CANARY in browser.text("operations")
    assert browser.driver.find_elements(By.TAG_NAME, "script") == []


async def test_screenshots_of_the_main_pages(
    browser: Browser, settings: Settings, database_url: str, registry: Registry, tmp_path: Path
) -> None:
    """Regenerate the README's screenshots with
    ``OUTBOX_CONSOLE_SCREENSHOTS=docs pytest tests/browser -k screenshots``."""
    target = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    ops = Ops(database_url, registry)
    escalated = ops.at(S.ESCALATED, run_id="run_support_4711")
    ops.at(S.ESCALATED, run_id="run_support_4712", tool="open_ticket")
    ops.at(S.COMMITTED, run_id="run_support_4702")
    ops.at(S.REJECTED, run_id="run_support_4705")
    ops.at(S.OUTCOME_UNKNOWN, run_id="run_support_4713")
    ops.new(amount_cents=120_000, run_id="run_support_4714")
    ops.new(amount_cents=2_500, run_id="run_support_4715")
    envelope = OperationMessage(
        operation_id=escalated.id,
        outbox_id=1,
        tool="send_refund",
        tool_version=1,
        input_fingerprint=escalated.input_fingerprint,
    )
    await dead_letter_one(settings, envelope)

    def shoot() -> list[Path]:
        browser.login()
        shots = []
        for name, path in [
            ("overview", "/"),
            ("operations", "/operations"),
            ("operation", f"/operations/{escalated.display_id}"),
            ("escalations", "/escalations"),
            ("approvals", "/approvals"),
            ("dead-letters", "/dead-letters"),
        ]:
            browser.open(path)
            assert browser.driver.find_elements(By.ID, "operator"), name
            shot = target / f"console-{name}.png"
            # The whole page, not just the viewport.
            size = browser.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            png = browser.driver.execute_cdp_cmd(
                "Page.captureScreenshot",
                {"format": "png", "captureBeyondViewport": True, "clip": clip},
            )["data"]
            shot.write_bytes(base64.b64decode(png))
            shots.append(shot)
        return shots

    shots = await asyncio.to_thread(shoot)
    for shot in shots:
        assert shot.read_bytes().startswith(b"\x89PNG"), shot


def test_the_page_has_no_script_for_a_dialog_to_come_from(page: WebDriver) -> None:
    # The canary test above relies on no_dialog() seeing a dialog when one is open.
    page.get("data:text/html,<script>alert(1)</script>")
    checker = Browser(driver=page, base="")
    assert not checker.no_dialog()
    page.switch_to.alert.dismiss()
