"""Driving the console in a browser: the steps every browser test takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

from support.console_helpers import TOKEN

# A deadline, not a pause: generous because CI machines are shared and busy.
WAIT_SECONDS = 30
# A page being replaced (a form just submitted) drops the elements the condition read:
# look again rather than fail.
WHILE_THE_PAGE_CHANGES = (NoSuchElementException, StaleElementReferenceException)


@dataclass
class Browser:
    """The page and the console it talks to, with the steps every test takes."""

    driver: WebDriver
    base: str

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def login(self, token: str = TOKEN) -> None:
        self.open("/login")
        self.driver.find_element(By.ID, "token").send_keys(token)
        self.driver.find_element(By.ID, "login").click()
        self.wait_for(lambda d: d.find_elements(By.ID, "operator"), "the overview after login")

    def text(self, element_id: str) -> str:
        return str(self.driver.find_element(By.ID, element_id).text)

    def wait_for(self, condition: Callable[[WebDriver], object], what: str) -> None:
        WebDriverWait(self.driver, WAIT_SECONDS, ignored_exceptions=WHILE_THE_PAGE_CHANGES).until(
            condition, message=f"not seen: {what}"
        )

    def no_dialog(self) -> bool:
        try:
            self.driver.switch_to.alert  # noqa: B018 - raises when no dialog is open
        except NoAlertPresentException:
            return True
        return False
