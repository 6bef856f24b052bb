"""The console in a real browser: Debian's chromium, driven through its chromedriver by
Selenium (neither downloads a browser of its own; .ci/run installs both).

One browser for the whole session (starting chromium costs about a second); each test
gets its own console server on a free port, its own database and a login that is only
an operator, and starts with no cookies.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from outbox import Registry, Settings
from outbox.console.app import create_app
from outbox.console.server import ConsoleServer

from support.console_browser import Browser
from support.console_helpers import console, console_settings, operator_login

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="session")
def chromium() -> Iterator[WebDriver]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            pytest.fail(
                f"{path} is missing: apt-get install chromium chromium-driver (.ci/run does)",
                pytrace=False,
            )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        # CI runs as root, where chromium refuses its sandbox.
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(chromium: WebDriver) -> WebDriver:
    # Cookies are per host, not per port: one test's session must not reach the next.
    chromium.execute_cdp_cmd("Network.clearBrowserCookies", {})
    return chromium


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


@pytest.fixture
def console_url(settings: Settings, operator_url: str, registry: Registry) -> Iterator[str]:
    app = create_app(console(console_settings(settings, operator_url), registry=registry))
    with ConsoleServer(app, host="127.0.0.1", port=0) as server:
        yield server.url


@pytest.fixture
def browser(page: WebDriver, console_url: str) -> Browser:
    return Browser(driver=page, base=console_url)
