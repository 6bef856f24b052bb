"""Why an operation waits, on the console (#49 item 5): the overview shows the
consumers' side (queue depth, consumers connected, the oldest ready operation) and tells
prepared operations waiting for a person from those no consumer has claimed; an
operation's page says what it waits for and until when, and an escalated one why a
person has it, since when, and what to check at the provider."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from pydantic import SecretStr
from starlette.testclient import TestClient

from outbox import Operation, Registry, Settings
from outbox.broker import Topology, declare_topology
from outbox.callback_policy import CallbackPolicy
from outbox.console.app import Console

from support.broker_helpers import wait_for_messages
from support.callback_helpers import TICKETS
from support.console_cases import S
from support.console_helpers import client, console, console_settings, logged_in
from support.db_helpers import execute_admin
from support.ops_helpers import Ops
from support.ports import closed_port
from support.sample_tools import Ledger, refund_contract, ticket_contract


def text_of(html: str, element_id: str) -> str:
    """The text of the element with this id, tags dropped and spaces folded."""
    found = re.search(rf'<(\w+)[^>]*id="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    assert found, f"no element {element_id}"
    return " ".join(unescape(re.sub(r"<[^>]+>", "", found.group(2))).split())


def published(database_url: str, *operations: Operation) -> None:
    """Their outbox rows published, as the dispatcher leaves them."""
    for operation in operations:
        execute_admin(
            database_url,
            "UPDATE outbox SET published_at = now() WHERE operation_id = %s",
            (operation.id,),
        )


# --- the overview: the consumers' side ------------------------------------------------------


async def test_the_overview_shows_queue_depth_and_that_no_consumer_is_connected(
    app_console: Console, settings: Settings
) -> None:
    async def hold(message: AbstractIncomingMessage) -> None:
        """A consumer that takes a message and never settles it."""

    amqp_url = settings.amqp_url.get_secret_value()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await declare_topology(channel, Topology.from_settings(settings))
        exchange = await channel.get_exchange(settings.exchange)
        for n in range(3):
            await exchange.publish(aio_pika.Message(b"{}", message_id=f"m{n}"), "send_refund.v1")
        await wait_for_messages(amqp_url, settings.queue, count=3)

        with client(app_console) as browser:
            stopped = text_of(logged_in(browser).get("/").text, "consumers")
            listening = await connection.channel()
            await listening.set_qos(prefetch_count=1)
            queue = await listening.get_queue(settings.queue)
            await queue.consume(hold)
            running = text_of(browser.get("/").text, "consumers")

    assert f"{settings.queue}: 3 message(s) ready, 0 consumer(s) connected" in stopped
    assert "No consumer is connected: nothing is being executed" in stopped
    assert "1 consumer(s) connected" in running
    assert "No consumer is connected" not in running


def test_an_unreachable_broker_is_one_line_on_the_overview_not_an_error_page(
    settings: Settings, operator_url: str, registry: Registry, ops: Ops
) -> None:
    escalated = ops.at(S.ESCALATED)
    down = console_settings(settings, operator_url).model_copy(
        update={"amqp_url": SecretStr(f"amqp://guest:sekret@127.0.0.1:{closed_port()}/")}
    )
    with client(console(down, registry=registry)) as browser:
        page = logged_in(browser).get("/")

    assert page.status_code == 200
    assert text_of(page.text, "queue").startswith("broker unreachable: cannot connect to amqp://")
    assert "sekret" not in page.text
    assert escalated.display_id in page.text


def test_the_overview_tells_prepared_awaiting_approval_from_prepared_not_claimed(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    ready = ops.new(amount_cents=100, run_id="ready")
    older_ready = ops.new(amount_cents=200, run_id="ready")
    awaiting = ops.new(amount_cents=90_000, run_id="approval")
    unpublished = ops.new(amount_cents=300, run_id="unpublished")
    execute_admin(
        database_url,
        "UPDATE operations SET next_attempt_at = next_attempt_at - interval '10 minutes' "
        "WHERE id = %s",
        (older_ready.id,),
    )
    published(database_url, ready, older_ready, awaiting)

    html = logged_in(browser).get("/").text

    assert text_of(html, "prepared-waits") == (
        "Prepared: 1 waiting for a person's approval, 2 ready and not yet claimed, 0 "
        "scheduled for a later attempt, 0 waiting for their provider, 1 not yet published."
    )
    oldest = text_of(html, "oldest-ready")
    assert oldest.startswith(f"Oldest ready operation: op_{str(older_ready.id)[:8]}")
    assert re.search(r"due for 1\dm and not claimed by a consumer", oldest), oldest
    assert f'href="/operations/{older_ready.display_id}"' in html
    assert unpublished.display_id not in oldest


# --- one operation: what it waits for, until when ---------------------------------------


def test_a_prepared_operation_says_whether_it_waits_for_approval_or_a_consumer(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    ready = ops.new(amount_cents=100)
    awaiting = ops.new(amount_cents=90_000)
    backing_off = ops.new(amount_cents=150)
    execute_admin(
        database_url,
        "UPDATE operations SET next_attempt_at = now() + interval '1 hour' WHERE id = %s",
        (backing_off.id,),
    )
    published(database_url, ready, awaiting, backing_off)
    logged_in(browser)

    def waiting(operation: Operation) -> str:
        return text_of(browser.get(f"/operations/{operation.display_id}").text, "waiting")

    assert waiting(ready).startswith("Waiting for a consumer to claim it: it is due and published")
    assert waiting(awaiting) == (
        "Waiting for a person's approval (missing: no approval was granted for this "
        "operation); a consumer does not execute it without one."
    )
    later = waiting(backing_off)
    assert later.startswith("Waiting for the time of its next attempt (attempt 1), after a backoff")
    assert re.search(r"until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(in (59m|1h 0m)\)", later), later


def test_an_unknown_outcome_says_it_waits_for_its_next_lookup_and_until_when(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    unknown = ops.at(S.OUTCOME_UNKNOWN)
    execute_admin(
        database_url,
        "UPDATE operations SET next_attempt_at = now() + interval '5 minutes' WHERE id = %s",
        (unknown.id,),
    )

    waiting = text_of(logged_in(browser).get(f"/operations/{unknown.display_id}").text, "waiting")

    assert waiting.startswith(
        "Waiting for its next lookup at the provider (lookup 1 of 3; then a person), until "
    )
    assert re.search(r"\((in 4m|in 5m)\)\.$", waiting), waiting


@pytest.fixture
def callback_console(settings: Settings, operator_url: str) -> Console:
    """A console whose open_ticket waits ten minutes for the tickets provider's callback."""
    ledger = Ledger()
    registry = Registry()
    registry.register(refund_contract(ledger))
    registry.register(
        ticket_contract(ledger, callbacks=CallbackPolicy(TICKETS, wait=timedelta(minutes=10)))
    )
    return console(console_settings(settings, operator_url), registry=registry)


def test_an_unknown_outcome_without_a_lookup_says_it_waits_for_a_callback_until_when(
    callback_console: Console, ops: Ops, database_url: str
) -> None:
    unknown = ops.at(S.OUTCOME_UNKNOWN, tool="open_ticket")
    execute_admin(
        database_url,
        "UPDATE operations SET next_attempt_at = now() + interval '10 minutes' WHERE id = %s",
        (unknown.id,),
    )

    with client(callback_console) as browser:
        html = logged_in(browser).get(f"/operations/{unknown.display_id}").text

    waiting = text_of(html, "waiting")
    assert waiting.startswith(
        "Waiting for a verified callback from tickets; when none has come, a person, until "
    )
    assert re.search(r"\((in 9m|in 10m)\)\.$", waiting), waiting


def test_an_escalated_operation_says_why_since_when_and_what_to_check_at_the_provider(
    browser: TestClient, ops: Ops
) -> None:
    escalated = ops.escalated_at_claim("undeliverable")

    html = logged_in(browser).get(f"/operations/{escalated.display_id}").text

    header = text_of(html, "escalation")
    assert re.fullmatch(
        r"With a person since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+s ago\): undeliverable", header
    ), header
    check = text_of(html, "provider-check")
    assert "Ask send_refund for the effect it made with this operation's id as its " in check
    assert "it keeps keys 24h, so past that search for the intent above instead" in check
    assert "Found: resolve it committed" in check
    assert 'id="waiting"' not in html
