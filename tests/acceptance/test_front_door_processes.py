"""The three network front ends as processes, started by their commands: SIGTERM stops
each with status 0 (uvicorn's own handling used to re-raise the signal, and the process
died of it), the serving limits reach each through its settings, and a port that is taken
is refused in one line that names it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from outbox.console.config import OPERATORS_ENV
from outbox.sandbox.processes import DaemonProcess

from support.callback_helpers import FOREIGN_SECRET, PAYMENTS_SECRET
from support.console_helpers import OPERATOR, TOKEN, operator_login
from support.ports import taken_port

FRONT_DOORS = ["callbacks", "console", "mcp"]
COMMANDS = {
    "callbacks": ["callbacks", "serve", "--tools", "outbox.sandbox.tools"],
    "console": ["console"],
    "mcp": ["mcp", "--tools", "outbox.sandbox.tools", "--transport", "http"],
}
PATIENCE = 30.0


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


def environment(front_door: str, database_url: str, operator_url: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OUTBOX_CONSOLE_", "OUTBOX_CALLBACK_", "OUTBOX_SERVE_"))
    }
    env["OUTBOX_DATABASE_URL"] = operator_url if front_door == "console" else database_url
    env["OUTBOX_CALLBACK_SECRETS"] = (
        f"sandbox-payments:{PAYMENTS_SECRET},sandbox-email:{FOREIGN_SECRET}"
    )
    env[OPERATORS_ENV] = f"{OPERATOR}:{TOKEN}"
    # Short enough that a test waits seconds for the head deadline.
    env["OUTBOX_SERVE_HEADER_TIMEOUT"] = "1"
    env["OUTBOX_CALLBACK_MAX_BODY"] = "2048"
    return env


def command(front_door: str, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "outbox", *COMMANDS[front_door], "--port", str(port)]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A command expected to stop by itself: one that served would run into the timeout."""
    return subprocess.run(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )


def address_in(line: str) -> tuple[str, int]:
    found = re.search(r"http://(127\.0\.0\.1):(\d+)", line)
    assert found, line
    return found.group(1), int(found.group(2))


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_sigterm_stops_it_with_status_0_and_its_limits_hold(
    front_door: str, database_url: str, operator_url: str
) -> None:
    env = environment(front_door, database_url, operator_url)
    with DaemonProcess(command(front_door), environment=env, capture=True) as process:
        address = address_in(process.wait_for_line(" on http://127.0.0.1:", within=PATIENCE))
        with socket.create_connection(address, timeout=PATIENCE) as client:
            # Over every front end's limit (MCP's is the SDK's 4 MiB).
            client.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000000\r\n\r\n")
            too_large = client.recv(65536)
        with socket.create_connection(address, timeout=PATIENCE) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            # Closed by the head deadline (1 s), long before the socket's own timeout.
            closed = slow.recv(65536)
        process.terminate()
        code = process.wait(PATIENCE)
        output = process.output()

    assert too_large.startswith(b"HTTP/1.1 413 ")
    assert closed == b""
    assert code == 0
    assert "stopping signal=SIGTERM" in output
    assert "Traceback" not in output
    assert TOKEN not in output


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_taken_port_is_refused_in_one_line_that_names_it(
    front_door: str, database_url: str, operator_url: str
) -> None:
    env = environment(front_door, database_url, operator_url)
    with taken_port() as port:
        ran = run(command(front_door, port), env)

    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1].endswith(
        f"error: port {port} on 127.0.0.1 is already in use: stop what listens there, or "
        "give another --port (0 for any free one)"
    )
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize(
    ("variable", "value", "why"),
    [
        ("OUTBOX_SERVE_HEADER_TIMEOUT", "0", "0 s is too short: give 0.001 or more"),
        ("OUTBOX_SERVE_BODY_TIMEOUT", "-1", "-1 s is too short: give 0.001 or more"),
        ("OUTBOX_SERVE_MAX_CONNECTIONS", "0", "greater than or equal to 1"),
    ],
)
def test_a_deadline_or_cap_of_zero_or_less_is_refused_before_it_serves(
    variable: str, value: str, why: str, database_url: str, operator_url: str
) -> None:
    # Settings are read before any command runs: one front end stands for the three.
    env = {**environment("callbacks", database_url, operator_url), variable: value}
    ran = run(command("callbacks"), env)

    assert ran.returncode == 2
    assert f"{variable}: " in ran.stderr
    assert why in ran.stderr
    assert "serving" not in ran.stdout
