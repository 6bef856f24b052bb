"""The demo's claim made through MCP: an agent whose call timed out retries with the same
decision key and hears "committed", and the provider refunded once.

`outbox mcp` runs as a real stdio subprocess of the official MCP client; the dispatcher
and consumer run as daemons; the payment sandbox commits the refund and loses its
response."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx2
import psycopg
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import RequestParamsMeta, TextContent

from outbox import Outcome, Settings
from outbox.mcp.tools import DECISION_KEY_META, RECORDED_META
from outbox.sandbox.provider import Faults

from support.ports import closed_port, taken_port
from support.system import Daemon, System, running_system
from support.waiting import eventually

OUTBOX = str(Path(sys.executable).parent / "outbox")
KEY = "call_refund_CANARY_5d1e"
REFUND = {"payment_id": "pay_1", "amount_cents": 1250}
# The provider holds the committed refund's response until the test releases it, so the
# first call's client timeout fires while the effect has happened and nobody knows it.
HELD = 600_000


def operations(system: System) -> list[tuple[Any, ...]]:
    with psycopg.connect(system.database_url) as connection:
        return connection.execute(
            "SELECT id, run_id, decision_key, state FROM operations"
        ).fetchall()


@pytest.mark.timeout(180)
async def test_a_timed_out_call_retried_with_its_key_is_one_refund(
    settings: Settings, tmp_path: Path
) -> None:
    faults = Faults(drop_response_every=1, delay_ms=HELD)
    # A deadline longer than the test: the consumer waits for the held response.
    with running_system(settings, faults=faults, refund_deadline=120.0) as system:
        system.start("dispatcher")
        system.start("consumer")
        server = StdioServerParameters(
            command=OUTBOX,
            args=["mcp", "--tools", "outbox.sandbox.tools", "--run-id", "t1", "--wait", "60"],
            env=system.environment,
        )
        server_log = tmp_path / "mcp.log"
        meta = cast("RequestParamsMeta", {DECISION_KEY_META: KEY})
        with server_log.open("w") as errlog:
            async with Client(stdio_client(server, errlog=errlog)) as client:
                with pytest.raises(MCPError) as timed_out:
                    await client.call_tool("send_refund", REFUND, read_timeout_seconds=5, meta=meta)
                assert timed_out.value.code == -32001  # the client gave up, not the server

                async def the_provider_committed() -> bool:
                    return bool(system.provider.ledger()["totals"]["refunds"] == 1)

                await eventually(
                    the_provider_committed,
                    within=60,
                    what="the provider to commit the refund whose response it holds",
                )
                system.provider.set_faults(delay_ms=0)  # released, and then lost
                retry = await client.call_tool("send_refund", REFUND, meta=meta)

    outcome = Outcome.model_validate(retry.structured_content)
    ledger = system.provider.ledger()
    assert retry.is_error is False
    assert outcome.status == "committed"
    assert (outcome.run_id, outcome.decision_key) == ("t1", KEY)
    assert retry.meta is not None
    assert retry.meta[RECORDED_META] == "existing"  # the first, timed-out call recorded it
    block = retry.content[0]
    assert isinstance(block, TextContent)
    assert (
        block.text
        == f"Done: send_refund committed (provider reference {ledger['refunds'][0]['id']})."
    )
    assert ledger["totals"]["refunds"] == 1
    assert system.refunds_for(outcome.operation_id) == 1
    assert [(row[0], row[3]) for row in operations(system)] == [(outcome.operation_id, "committed")]
    assert "operation.reconciled" in system.events(outcome.operation_id)
    log = server_log.read_text()
    assert "mcp.ready" in log
    assert KEY not in log  # a client-chosen key never reaches a log line


TRANSPORTS = pytest.mark.parametrize(
    "transport", [[], ["--transport", "http", "--port", "0"]], ids=["stdio", "http"]
)


def serve_on(database_url: str, transport: list[str]) -> subprocess.CompletedProcess[str]:
    """`outbox mcp` on ``database_url``, expected to stop by itself: one that served
    would run into the timeout instead."""
    return subprocess.run(
        [OUTBOX, "mcp", "--tools", "outbox.sandbox.tools", *transport],
        env={**os.environ, "OUTBOX_DATABASE_URL": database_url},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@TRANSPORTS
def test_an_unreachable_database_stops_the_server_at_once_in_one_line(
    transport: list[str],
) -> None:
    result = serve_on(f"postgresql://nobody@127.0.0.1:{closed_port()}/x", transport)

    assert result.returncode == 1
    assert result.stdout == ""  # on stdio, stdout is the protocol's alone
    assert result.stderr.splitlines()[-1].startswith(
        "outbox mcp: error: the outcome watcher could not connect: OperationalError"
    )
    assert "Traceback" not in result.stderr


@TRANSPORTS
def test_a_database_without_the_schema_stops_the_server_at_once_in_one_line(
    empty_database_url: str, transport: list[str]
) -> None:
    """As the consumer does, rather than answer every call "the database did not
    answer, call again" for as long as nobody runs `outbox migrate`."""
    result = serve_on(empty_database_url, transport)

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "outbox mcp: error: The outbox tables are missing in this database: run `outbox migrate`."
    )
    assert "mcp.ready" not in result.stderr
    assert "Traceback" not in result.stderr


TOKEN = "tok-CANARY-2b8e41-7c9d0a3f5e1b6d8c2a4f"
SUPPORT_TOKEN = "tok-CANARY-support-93ab5d7f1c2e4a6b8d0f"
BILLING_TOKEN = "tok-CANARY-billing-41c7e9a2b5d8f0a3c6e1"
LIST_TOOLS = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
ACCEPT = {"Accept": "application/json, text/event-stream"}


@contextlib.contextmanager
def serving_over_http(
    database_url: str, variables: dict[str, str], *flags: str
) -> Iterator[tuple[str, Daemon]]:
    """`outbox mcp --transport http` on a port of its own, until the block ends."""
    port = closed_port()
    server = Daemon(
        "mcp",
        {**os.environ, "OUTBOX_DATABASE_URL": database_url, **variables},
        [
            OUTBOX,
            "mcp",
            "--tools",
            "outbox.sandbox.tools",
            "--transport",
            "http",
            "--port",
            str(port),
            "--wait",
            "0",
            *flags,
        ],
    )
    try:
        server.wait_for_line(f"serving on http://127.0.0.1:{port}/mcp", within=60)
        yield f"http://127.0.0.1:{port}/mcp", server
    finally:
        server.kill()


def test_http_through_the_command_answers_only_the_token_holder(database_url: str) -> None:
    with serving_over_http(
        database_url,
        {"OUTBOX_TEST_MCP_TOKEN": TOKEN},
        "--bearer-token-env",
        "OUTBOX_TEST_MCP_TOKEN",
        "--run-id",
        "h1",
    ) as (url, server):
        refused, outcome = asyncio.run(_call_over_http(url))
        server.signal(signal.SIGTERM)
        code = server.wait(30)
        output = server.output()

    assert refused == 401
    assert outcome.run_id == "bearer:h1"  # the single-token form keeps its principal
    assert outcome.status == "pending"  # --wait 0: the answer right after recording
    assert code == 0
    assert "mcp.stopping signal=SIGTERM" in output
    assert "Traceback" not in output
    assert TOKEN not in output
    assert KEY not in output


async def _call_over_http(url: str) -> tuple[int, Outcome]:
    async with httpx2.AsyncClient() as anonymous:
        refused = await anonymous.post(url, json=LIST_TOOLS, headers=ACCEPT)
    return refused.status_code, await _refund_as(url, TOKEN)


async def _refund_as(url: str, token: str) -> Outcome:
    meta = cast("RequestParamsMeta", {DECISION_KEY_META: KEY})
    async with (
        create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        result = await client.call_tool("send_refund", REFUND, meta=meta)
    return Outcome.model_validate(result.structured_content)


def test_http_through_the_command_serves_each_caller_as_itself_and_throttles_guesses(
    database_url: str,
) -> None:
    tokens = f"support-bot:{SUPPORT_TOKEN}, billing-bot:{BILLING_TOKEN}"
    with serving_over_http(database_url, {"OUTBOX_MCP_TOKENS": tokens}) as (url, server):

        async def callers_then_a_guesser() -> tuple[list[Outcome], list[httpx2.Response]]:
            outcomes = [await _refund_as(url, t) for t in (SUPPORT_TOKEN, BILLING_TOKEN)]
            answers = []
            async with httpx2.AsyncClient() as guesser:
                for n in range(12):
                    # The address is the TCP peer's: a forwarding header changes nothing.
                    headers = {
                        **ACCEPT,
                        "Authorization": f"Bearer guess-CANARY-{n}",
                        "X-Forwarded-For": f"192.0.2.{n}",
                    }
                    answers.append(await guesser.post(url, json=LIST_TOOLS, headers=headers))
                right = {**ACCEPT, "Authorization": f"Bearer {SUPPORT_TOKEN}"}
                answers.append(await guesser.post(url, json=LIST_TOOLS, headers=right))
            return outcomes, answers

        (support, billing), answers = asyncio.run(callers_then_a_guesser())
        output = server.output()

    assert (support.run_id, billing.run_id) == ("support-bot:mcp", "billing-bot:mcp")
    assert support.operation_id != billing.operation_id  # one key, two callers' decisions
    assert [a.status_code for a in answers] == [401] * 10 + [429] * 3
    assert 0 < int(answers[-1].headers["retry-after"]) <= 600
    assert output.count("action=mcp.unauthorized") == 10
    assert "address=127.0.0.1" in output
    assert output.count("action=mcp.throttled") == 1
    assert "CANARY" not in output
    assert "192.0.2." not in output


def test_http_on_a_taken_port_fails_in_one_line(database_url: str) -> None:
    with taken_port() as port:
        result = subprocess.run(
            [
                OUTBOX,
                "mcp",
                "--tools",
                "outbox.sandbox.tools",
                "--transport",
                "http",
                "--port",
                str(port),
            ],
            env={**os.environ, "OUTBOX_DATABASE_URL": database_url},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"outbox mcp: error: port {port} on 127.0.0.1 is already in use: stop what listens "
        "there, or give another --port (0 for any free one)"
    )
