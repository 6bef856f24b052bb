"""The console's dead letters: listed with why they died, requeued by an operator."""

from __future__ import annotations

import logging
import uuid

import pytest
from starlette.testclient import TestClient

from outbox import Settings
from outbox import store as outbox_store
from outbox.broker import ChunkEntry, OperationChunk, OperationMessage
from outbox.console.app import Console
from outbox.states import EventName

from support.broker_helpers import read_raw
from support.console_cases import S
from support.console_helpers import (
    OPERATOR,
    client,
    csrf,
    csrf_of,
    dead_letter_one,
    envelope_of,
    logged_in,
)
from support.ops_helpers import Ops

# --- dead letters -----------------------------------------------------------------------------


async def test_a_dead_letter_is_listed_and_requeued_by_an_operator(
    app_console: Console, settings: Settings, ops: Ops, caplog: pytest.LogCaptureFixture
) -> None:
    op = ops.at(S.ESCALATED)
    envelope = OperationMessage(
        operation_id=op.id,
        outbox_id=7,
        tool="send_refund",
        tool_version=1,
        input_fingerprint=op.input_fingerprint,
    )
    await dead_letter_one(settings, envelope, message_id="outbox-7")

    with client(app_console) as test_client, caplog.at_level(logging.INFO):
        page = logged_in(test_client).get("/dead-letters").text
        assert "outbox-7" in page
        assert op.display_id in page
        token = csrf_of(page)
        missing = test_client.post(
            "/dead-letters/requeue", data={"csrf_token": token, "message_id": "outbox-999"}
        )
        requeued = test_client.post(
            "/dead-letters/requeue", data={"csrf_token": token, "message_id": "outbox-7"}
        )
        after = test_client.get("/dead-letters").text

    assert missing.status_code == 404
    assert requeued.status_code == 303
    assert "the dead-letter queue is empty" in after
    [back] = await read_raw(settings.amqp_url.get_secret_value(), settings.queue, expect=1)
    assert back.message_id == "outbox-7"
    lines = [r for r in caplog.records if getattr(r, "action", None) == "console.dlq_requeue"]
    assert [getattr(r, "operator", None) for r in lines] == [OPERATOR, OPERATOR]
    assert [getattr(r, "requeued", None) for r in lines] == [0, 1]


async def test_a_dead_chunk_lists_each_of_its_operations_and_is_requeued_whole(
    app_console: Console, settings: Settings, ops: Ops
) -> None:
    first, second = ops.new(), ops.new()
    chunk = OperationChunk(
        v=2,
        operations=tuple(
            ChunkEntry(**envelope_of(op).model_dump(exclude={"v"})) for op in (first, second)
        ),
    )
    await dead_letter_one(settings, chunk, message_id="outbox-7-n2")

    with client(app_console) as test_client:
        page = logged_in(test_client).get("/dead-letters").text
        token = csrf_of(page)
        requeued = test_client.post(
            "/dead-letters/requeue", data={"csrf_token": token, "message_id": "outbox-7-n2"}
        )

    assert "a chunk of 2: send_refund" in page
    assert first.display_id in page
    assert second.display_id in page
    assert 'name="message_id" value="outbox-7-n2"' in page
    assert requeued.status_code == 303
    [back] = await read_raw(settings.amqp_url.get_secret_value(), settings.queue, expect=1)
    assert back.message_id == "outbox-7-n2"
    assert back.body == chunk.model_dump_json().encode()


async def test_dead_letters_say_why_they_died_and_what_became_of_their_operation(
    app_console: Console, settings: Settings, ops: Ops
) -> None:
    undeliverable = ops.escalated_at_claim("undeliverable")
    no_tool = ops.new()
    ops.run(outbox_store.append_event(no_tool, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}))
    missing = OperationMessage(
        operation_id=uuid.uuid4(),
        outbox_id=9,
        tool="send_refund",
        tool_version=1,
        input_fingerprint="ab" * 32,
    )
    await dead_letter_one(settings, envelope_of(undeliverable), message_id="outbox-1")
    await dead_letter_one(settings, envelope_of(no_tool), message_id="outbox-2")
    await dead_letter_one(settings, missing, message_id="outbox-3")

    with client(app_console) as test_client:
        page = logged_in(test_client).get("/dead-letters").text

    rows = {
        message_id: page.split(f'<td class="mono">{message_id}</td>')[1].split("</tr>")[0]
        for message_id in ("outbox-1", "outbox-2", "outbox-3")
    }
    assert "its operation is escalated (undeliverable, " in rows["outbox-1"]
    assert "a requeued copy would only be acknowledged" in rows["outbox-1"]
    assert "refused by a consumer, 1 time(s)" in rows["outbox-1"]
    assert '<td class="why">unknown_tool' in rows["outbox-2"]
    assert "escalated" not in rows["outbox-2"]
    assert '<td class="why">unknown_operation: no operation has this id' in rows["outbox-3"]
    assert "\u00d7" not in page  # the multiplication sign of "rejected x1"


def test_a_requeue_must_choose_what(browser: TestClient) -> None:
    token = csrf(logged_in(browser))

    for form in ({}, {"all": "yes", "message_id": "outbox-1"}):
        answer = browser.post("/dead-letters/requeue", data={"csrf_token": token, **form})
        assert answer.status_code == 400
