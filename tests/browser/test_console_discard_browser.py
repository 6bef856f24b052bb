"""Discarding poison from the console's dead-letter page in chromium: the page says when
each message died, the preview shows what would go, and the confirmed discard is
recorded with the operator's name before the message leaves the queue."""

from __future__ import annotations

import asyncio
import hashlib

import psycopg
import pytest
from selenium.webdriver.common.by import By

from outbox import Settings

from support.broker_helpers import message_count
from support.console_browser import Browser
from support.console_helpers import OPERATOR, dead_letter_one

pytestmark = pytest.mark.browser

POISON = b'{"not": "an envelope", "secret": "CANARY-b7e1"}'


def discards(database_url: str) -> list[tuple[object, ...]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        return connection.execute(
            "SELECT message_id, body_sha256, reason, discarded_by FROM discarded_dead_letters"
        ).fetchall()


async def test_a_malformed_dead_letter_is_discarded_from_the_page_on_the_record(
    browser: Browser, settings: Settings, database_url: str
) -> None:
    await dead_letter_one(settings, POISON, message_id="poison-1")
    digest = hashlib.sha256(POISON).hexdigest()

    def preview() -> None:
        browser.login()
        browser.open("/dead-letters")
        [row] = browser.driver.find_elements(By.CSS_SELECTOR, "#dead-letters tbody tr")
        assert "ago" in row.find_element(By.CLASS_NAME, "died").text
        browser.driver.find_element(By.ID, "discard-malformed").click()
        browser.wait_for(lambda d: d.find_elements(By.ID, "discard-preview"), "the preview")
        assert digest in browser.text("discard-preview")
        assert "CANARY" not in browser.driver.page_source

    await asyncio.to_thread(preview)
    # Shown, not yet discarded.
    assert discards(database_url) == []
    amqp_url = settings.amqp_url.get_secret_value()
    assert await message_count(amqp_url, settings.dead_letter_queue) == 1

    def confirm() -> None:
        browser.driver.find_element(By.ID, "discard-reason").send_keys("a test's junk body")
        browser.driver.find_element(By.ID, "discard-confirm").click()
        browser.wait_for(
            lambda d: "the dead-letter queue is empty" in d.page_source, "the emptied list"
        )

    await asyncio.to_thread(confirm)
    assert discards(database_url) == [("poison-1", digest, "a test's junk body", OPERATOR)]
    assert await message_count(amqp_url, settings.dead_letter_queue) == 0
