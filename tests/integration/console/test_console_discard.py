"""The console's dead-letter discard: a preview, then a confirmed discard that is
recorded before the message leaves the queue, as the operator login."""

from __future__ import annotations

import hashlib
import logging

import psycopg
import pytest

from outbox import Settings
from outbox.console.app import Console

from support.broker_helpers import message_count, read_raw
from support.console_cases import S
from support.console_helpers import (
    OPERATOR,
    client,
    csrf_of,
    dead_letter_one,
    envelope_of,
    logged_in,
)
from support.ops_helpers import Ops

CANARY = "CANARY-5d1e-do-not-show"
POISON = f'{{"secret": "{CANARY}"}}'.encode()


def discards(database_url: str) -> list[tuple[object, ...]]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT message_id, body_sha256, reason, discarded_by FROM discarded_dead_letters"
        ).fetchall()


async def test_malformed_dead_letters_are_previewed_then_discarded_on_the_record(
    app_console: Console,
    settings: Settings,
    database_url: str,
    ops: Ops,
    caplog: pytest.LogCaptureFixture,
) -> None:
    escalated = ops.at(S.ESCALATED)
    await dead_letter_one(settings, POISON, message_id="poison-1")
    await dead_letter_one(settings, envelope_of(escalated), message_id="outbox-7")
    url = settings.amqp_url.get_secret_value()

    with client(app_console) as test_client, caplog.at_level(logging.INFO):
        page = logged_in(test_client).get("/dead-letters").text
        preview = test_client.get("/dead-letters/discard?malformed=yes")
        one = test_client.get("/dead-letters/discard?message_id=outbox-7")
        token = csrf_of(preview.text)
        digest = hashlib.sha256(POISON).hexdigest()
        form = {"csrf_token": token, "malformed": "yes", "bodies": digest}
        refused = [
            test_client.post("/dead-letters/discard", data={**form, "reason": " "}),
            test_client.post("/dead-letters/discard", data={**form, "bodies": "", "reason": "x"}),
            test_client.post("/dead-letters/discard", data={"csrf_token": token, "reason": "x"}),
        ]
        assert await message_count(url, settings.dead_letter_queue) == 2
        done = test_client.post("/dead-letters/discard", data={**form, "reason": "junk body"})
        after = test_client.get("/dead-letters").text

    # The list says when each died, and offers the discard.
    assert '<td class="num died"' in page
    assert 'href="/dead-letters/discard?malformed=yes"' in page
    assert 'href="/dead-letters/discard?message_id=outbox-7"' in page
    # The preview shows what would go and leaves it there.
    assert preview.status_code == 200
    assert digest in preview.text
    assert "no operation: the body is not an operation envelope" in preview.text
    assert "outbox-7" not in preview.text
    assert CANARY not in preview.text
    assert "its operation stays escalated" in one.text
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert "the reason is empty" in refused[0].text
    # Confirmed: recorded with the session's operator, then removed.
    assert done.status_code == 303
    assert discards(database_url) == [("poison-1", digest, "junk body", OPERATOR)]
    assert "poison-1" not in after
    [kept] = await read_raw(url, settings.dead_letter_queue, expect=1)
    assert kept.message_id == "outbox-7"
    lines = [r for r in caplog.records if getattr(r, "action", None) == "console.dlq_discard"]
    assert [getattr(r, "discarded", None) for r in lines] == [1]
    assert all(CANARY not in r.getMessage() and "junk body" not in str(r.__dict__) for r in lines)


async def test_a_discard_takes_only_what_its_preview_showed(
    app_console: Console, settings: Settings, database_url: str
) -> None:
    await dead_letter_one(settings, POISON, message_id="poison-1")

    with client(app_console) as test_client:
        token = csrf_of(logged_in(test_client).get("/dead-letters/discard?malformed=yes").text)
        # Another malformed body dies after the preview was shown.
        await dead_letter_one(settings, b"later junk", message_id="poison-2")
        done = test_client.post(
            "/dead-letters/discard",
            data={
                "csrf_token": token,
                "malformed": "yes",
                "bodies": hashlib.sha256(POISON).hexdigest(),
                "reason": "junk",
            },
        )

    assert done.status_code == 303
    assert [row[0] for row in discards(database_url)] == ["poison-1"]
    [kept] = await read_raw(
        settings.amqp_url.get_secret_value(), settings.dead_letter_queue, expect=1
    )
    assert kept.message_id == "poison-2"
