"""``outbox console`` as a process: what it refuses before it serves, and serving as a
login that is only an operator. Credentials go in through the environment and never
come out in its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from psycopg import sql

from outbox.console.config import (
    HOSTS_ENV,
    OPERATORS_ENV,
    PROXY_HEADER_ENV,
    TRUSTED_PROXIES_ENV,
)
from outbox.sandbox.processes import DaemonProcess

from support.console_helpers import OPERATOR, TOKEN, as_user, operator_login


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


def environment(database_url: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_CONSOLE_")}
    return {**env, "OUTBOX_DATABASE_URL": database_url, **more}


def console(database_url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", "console", *args],
        env=environment(database_url, **env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_it_refuses_to_serve_without_authentication(database_url: str) -> None:
    ran = console(database_url, "--port", "0")

    assert ran.returncode == 2
    assert OPERATORS_ENV in ran.stderr


def test_it_refuses_a_public_address_without_allow_remote(database_url: str) -> None:
    ran = console(database_url, "--host", "0.0.0.0", **{OPERATORS_ENV: f"ada:{TOKEN}"})

    assert ran.returncode == 2
    assert "--allow-remote" in ran.stderr
    assert TOKEN not in ran.stderr + ran.stdout


def test_it_refuses_a_login_that_is_not_an_operator(
    postgres_server_url: str, database_url: str
) -> None:
    user = "outbox_test_console_nobody"
    with psycopg.connect(postgres_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(user)))
    try:
        ran = console(as_user(database_url, user), "--port", "0", **{OPERATORS_ENV: f"ada:{TOKEN}"})
    finally:
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))

    assert ran.returncode == 2
    assert "is not a member of outbox_operator" in ran.stderr


def test_it_refuses_a_malformed_host_list(database_url: str) -> None:
    ran = console(
        database_url,
        "--port",
        "0",
        **{OPERATORS_ENV: f"ada:{TOKEN}", HOSTS_ENV: "https://console.example.com"},
    )

    assert ran.returncode == 2
    assert HOSTS_ENV in ran.stderr


def test_it_serves_as_an_operator_login(operator_url: str) -> None:
    command = [sys.executable, "-m", "outbox", "console", "--port", "0"]
    env = environment(
        operator_url,
        **{OPERATORS_ENV: f"{OPERATOR}:{TOKEN}", HOSTS_ENV: "console.example.com"},
    )
    with DaemonProcess(command, environment=env, capture=True) as process:
        line = process.wait_for_line("serving on", within=30)
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line
        with httpx.Client(base_url=url.group(0), follow_redirects=False) as http:
            assert http.get("/").headers["location"] == "/login"
            # The names it answers to: its own address, and those listed; no other
            # (a rebound DNS name), whatever the path.
            named = http.get("/login", headers={"host": "console.example.com"})
            assert named.status_code == 200
            assert http.get("/login", headers={"host": "evil.example"}).status_code == 421
            login = http.get("/login")
            csrf = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
            assert csrf
            answer = http.post("/login", data={"token": TOKEN, "csrf_token": csrf.group(1)})
            assert answer.status_code == 303
            assert OPERATOR in http.get("/").text
        process.stop()

    assert "superuser" not in line
    assert TOKEN not in process.output()


@pytest.mark.parametrize(
    ("header", "proxies", "named"),
    [
        ("X-Forwarded-User", "0.0.0.0/0", TRUSTED_PROXIES_ENV),
        ("Cookie", "10.0.0.7", PROXY_HEADER_ENV),
    ],
    ids=["every-address", "cookie"],
)
def test_it_refuses_a_proxy_that_would_let_anyone_name_the_operator(
    database_url: str, header: str, proxies: str, named: str
) -> None:
    ran = console(
        database_url, "--port", "0", **{PROXY_HEADER_ENV: header, TRUSTED_PROXIES_ENV: proxies}
    )

    assert ran.returncode == 2
    assert ran.stderr.count("\n") == 1
    assert ran.stderr.startswith(f"outbox console: configuration error: {named}: ")
    assert "serving on" not in ran.stdout


def test_it_warns_loudly_when_the_trusted_proxy_is_a_local_address(operator_url: str) -> None:
    command = [sys.executable, "-m", "outbox", "console", "--port", "0"]
    env = environment(
        operator_url, **{PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: "127.0.0.1"}
    )
    with DaemonProcess(command, environment=env, capture=True) as process:
        process.wait_for_line("serving on", within=30)
        process.stop()

    lines = process.output().splitlines()
    logged = [line for line in lines if "action=console.local_proxy" in line]
    assert len(logged) == 1
    assert "level=warning" in logged[0]
    assert "networks=127.0.0.1/32" in logged[0]
    said = [line for line in lines if line.startswith("outbox console: WARNING: ")]
    assert len(said) == 1
    assert "any process on this machine can name itself any operator" in said[0]
    assert lines.index(said[0]) < next(i for i, line in enumerate(lines) if "serving on" in line)
