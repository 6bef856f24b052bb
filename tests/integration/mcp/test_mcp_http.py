"""`outbox mcp` over streamable HTTP: bearer tokens, principals, the throttle, what is
refused at startup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx2
import pytest
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from outbox import Registry, Settings
from outbox.cli import run_command
from outbox.credentials import Credential, FailureThrottle
from outbox.errors import ConfigurationError
from outbox.mcp.config import BEARER_PRINCIPAL, PRINCIPAL_SCOPE_KEY
from outbox.mcp.tools import RUN_ID_META, STATUS_TOOL
from outbox.mcp.transports import BearerGuard, http_app

from support.logs import logged, records_of, rendered
from support.mcp_cases import PAYMENT, key, meta, now, operation_count, outcome_of, server, text_of
from support.ports import closed_port
from support.waiting import eventually

# --- HTTP ----------------------------------------------------------------------------


TOKEN = "tok-CANARY-7f3a9d-4e1b2c8a0f5d6e3b9c"
SUPPORT = Credential("support-bot", "tok-CANARY-support-5f2a9c81d4e6b7a30c1f")
BILLING = Credential("billing-bot", "tok-CANARY-billing-0b8d3e6f2a9c41d7e5b2")


def bearer(token: str) -> tuple[Credential, ...]:
    """The single-token form: one token, the principal ``bearer``."""
    return (Credential(BEARER_PRINCIPAL, token),)


@contextlib.asynccontextmanager
async def serving_http(
    registry: Registry,
    settings: Settings,
    *,
    credentials: tuple[Credential, ...],
    throttle: FailureThrottle | None = None,
) -> AsyncIterator[str]:
    port = closed_port()
    app = http_app(
        server(registry, settings),
        host="127.0.0.1",
        credentials=credentials,
        throttle=throttle or FailureThrottle(),
    )
    http_server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.ensure_future(http_server.serve())
    try:
        await eventually(
            now(lambda: http_server.started or task.done()),
            within=30,
            what="the HTTP server to start",
        )
        assert http_server.started
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        http_server.should_exit = True
        await asyncio.wait_for(task, timeout=30)


@contextlib.asynccontextmanager
async def http_client(url: str, token: str | None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def test_http_with_a_token_binds_runs_to_the_principal(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with (
        serving_http(registry, settings, credentials=bearer(TOKEN)) as url,
        http_client(url, TOKEN) as client,
    ):
        default_run = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
        own_run = await client.call_tool("pay", PAYMENT, meta=key("call_1", run_id="r7"))
        status = await client.call_tool(
            STATUS_TOOL,
            {"operation_id": outcome_of(own_run).display_id},
            meta=meta({RUN_ID_META: "r7"}),
        )

    assert outcome_of(default_run).run_id == "bearer:mcp"
    assert outcome_of(own_run).run_id == "bearer:r7"
    assert outcome_of(status).operation_id == outcome_of(own_run).operation_id
    assert operation_count(database_url) == 2


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"],
)
async def test_http_with_a_token_refuses_requests_without_it(
    registry: Registry,
    settings: Settings,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
    authorization: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with (
        serving_http(registry, settings, credentials=bearer(TOKEN)) as url,
        httpx2.AsyncClient() as http,
    ):
        response = await http.post(url, json=body, headers=headers)

    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert TOKEN not in response.text
    assert TOKEN not in rendered(caplog)
    assert operation_count(database_url) == 0


@dataclasses.dataclass
class GuardProbe:
    """An ASGI app behind the guard that keeps what reached it, and what the guard sent."""

    reached: list[MutableMapping[str, Any]] = dataclasses.field(default_factory=list)
    sent: list[MutableMapping[str, Any]] = dataclasses.field(default_factory=list)

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        self.reached.append(scope)

    async def receive(self) -> MutableMapping[str, Any]:
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)


async def test_the_guard_passes_only_the_lifespan_and_the_token_holder() -> None:
    probe = GuardProbe()
    reached, sent, receive, send = probe.reached, probe.sent, probe.receive, probe.send
    guard = BearerGuard(probe.app, bearer(TOKEN), FailureThrottle())
    good = (b"authorization", f"Bearer {TOKEN}".encode())
    await guard({"type": "websocket", "headers": [good]}, receive, send)
    await guard({"type": "websocket", "headers": []}, receive, send)
    await guard({"type": "http", "headers": [good, good]}, receive, send)
    await guard({"type": "lifespan"}, receive, send)
    await guard(
        {"type": "http", "headers": [(b"Authorization", f"bearer {TOKEN}".encode())]}, receive, send
    )

    assert [scope["type"] for scope in reached] == ["websocket", "lifespan", "http"]
    assert reached[0][PRINCIPAL_SCOPE_KEY] == reached[2][PRINCIPAL_SCOPE_KEY] == "bearer"
    assert sent[0] == {"type": "websocket.close", "code": 1008}
    assert sent[1]["status"] == 401  # two Authorization headers: ambiguous, refused


async def test_each_token_holder_records_and_reads_as_its_own_principal(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    async with serving_http(registry, settings, credentials=(SUPPORT, BILLING)) as url:
        async with http_client(url, SUPPORT.token) as support:
            mine = await support.call_tool("pay", PAYMENT, meta=key("call_1"))
        async with http_client(url, BILLING.token) as billing:
            # The same key, another caller: another decision, never the first one's.
            theirs = await billing.call_tool("pay", PAYMENT, meta=key("call_1"))
            peek = await billing.call_tool(
                STATUS_TOOL, {"operation_id": outcome_of(mine).display_id}
            )

    assert outcome_of(mine).run_id == "support-bot:mcp"
    assert outcome_of(theirs).run_id == "billing-bot:mcp"
    assert outcome_of(mine).operation_id != outcome_of(theirs).operation_id
    assert peek.is_error is True
    assert text_of(peek).startswith("No operation op_")
    assert operation_count(database_url) == 2


async def test_failed_bearer_attempts_are_throttled_per_address_and_logged_by_address(
    registry: Registry,
    settings: Settings,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    throttle = FailureThrottle(limit=3)
    async with (
        serving_http(registry, settings, credentials=(SUPPORT,), throttle=throttle) as url,
        httpx2.AsyncClient() as http,
    ):
        guesses = [
            await http.post(url, json=body, headers={**headers, "Authorization": f"Bearer {g}"})
            for g in ("guess-CANARY-1", "guess-CANARY-2", "guess-CANARY-3")
        ]
        # Past the limit even the right token is refused unread: a guess learns nothing.
        right = await http.post(
            url, json=body, headers={**headers, "Authorization": f"Bearer {SUPPORT.token}"}
        )

    assert [guess.status_code for guess in guesses] == [401, 401, 401]
    assert right.status_code == 429
    assert 0 < int(right.headers["retry-after"]) <= 600
    assert "CANARY" not in right.text
    refused = records_of(caplog, "mcp.unauthorized")
    assert [(getattr(r, "address", None), getattr(r, "failures", None)) for r in refused] == [
        ("127.0.0.1", 1),
        ("127.0.0.1", 2),
        ("127.0.0.1", 3),
    ]
    assert logged(caplog, "mcp.throttled", address="127.0.0.1")
    assert "CANARY" not in rendered(caplog)
    assert operation_count(database_url) == 0


async def test_the_throttle_holds_back_only_the_address_that_failed() -> None:
    probe = GuardProbe()
    reached, sent, receive, send = probe.reached, probe.sent, probe.receive, probe.send

    def request(address: str, token: str) -> dict[str, Any]:
        headers = [(b"authorization", f"Bearer {token}".encode())]
        return {"type": "http", "headers": headers, "client": (address, 50000)}

    guard = BearerGuard(probe.app, (SUPPORT, BILLING), FailureThrottle(limit=2))
    for _ in range(2):
        await guard(request("10.0.0.9", "wrong"), receive, send)
    await guard(request("10.0.0.9", SUPPORT.token), receive, send)
    await guard(request("10.0.0.10", BILLING.token), receive, send)

    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [401, 401, 429]
    assert [scope[PRINCIPAL_SCOPE_KEY] for scope in reached] == ["billing-bot"]


async def test_http_on_loopback_without_a_token_serves_the_loopback_principal(
    registry: Registry, settings: Settings
) -> None:
    async with (
        serving_http(registry, settings, credentials=()) as url,
        http_client(url, None) as client,
    ):
        result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))

    assert outcome_of(result).run_id == "loopback:mcp"


async def test_an_http_app_without_the_guard_refuses_calls(
    registry: Registry, settings: Settings, database_url: str
) -> None:
    port = closed_port()
    # What someone would get by serving build_server's app directly: no principal.
    app = server(registry, settings).streamable_http_app(host="127.0.0.1")
    http_server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.ensure_future(http_server.serve())
    try:
        await eventually(
            now(lambda: http_server.started),
            within=30,
            what="the HTTP server to start",
        )
        async with http_client(f"http://127.0.0.1:{port}/mcp", None) as client:
            result = await client.call_tool("pay", PAYMENT, meta=key("call_1"))
    finally:
        http_server.should_exit = True
        await asyncio.wait_for(task, timeout=30)

    assert result.is_error is True
    assert text_of(result) == "Not done: this HTTP endpoint has no authenticated caller."
    assert operation_count(database_url) == 0


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "example.com", "::"])
def test_http_beyond_loopback_without_a_token_is_refused_at_startup(
    registry: Registry, settings: Settings, capsys: pytest.CaptureFixture[str], host: str
) -> None:
    with pytest.raises(ConfigurationError, match="not a loopback address"):
        http_app(server(registry, settings), host=host, credentials=())

    code = run_command(
        ["mcp", "--tools", "outbox.sandbox.tools", "--transport", "http", "--host", host]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith(f"outbox mcp: configuration error: --host {host} is not a loopback")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_token(registry: Registry, settings: Settings, host: str) -> None:
    assert http_app(server(registry, settings), host=host, credentials=()) is not None


@pytest.mark.parametrize(
    ("variables", "flags", "says"),
    [
        (
            {"OUTBOX_TEST_MCP_TOKEN": "CANARY-short-0123456789abcdef"},
            ["--bearer-token-env", "OUTBOX_TEST_MCP_TOKEN"],
            "--bearer-token-env OUTBOX_TEST_MCP_TOKEN: the token must be at least 32 characters",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"{SUPPORT.name}:{SUPPORT.token},billing-bot:CANARY-short-01"},
            [],
            "OUTBOX_MCP_TOKENS entry 2: the token must be at least 32 characters",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"ops team:{SUPPORT.token}"},
            [],
            "OUTBOX_MCP_TOKENS entry 1: a caller's name is 1-64 letters, digits",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"loopback:{SUPPORT.token}"},
            [],
            "OUTBOX_MCP_TOKENS entry 1: 'loopback' is the principal of calls without a token",
        ),
        (
            {"OUTBOX_MCP_TOKENS": f"a:{SUPPORT.token}", "OUTBOX_TEST_MCP_TOKEN": TOKEN},
            ["--bearer-token-env", "OUTBOX_TEST_MCP_TOKEN"],
            "set OUTBOX_MCP_TOKENS or --bearer-token-env, not both",
        ),
    ],
    ids=["short-single-token", "short-token-in-the-list", "bad-name", "reserved-name", "both"],
)
def test_bad_bearer_tokens_are_refused_at_start_without_echoing_them(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    flags: list[str],
    says: str,
) -> None:
    # Nothing answers there: a command that did not refuse would fail to connect instead.
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://nobody@127.0.0.1:{closed_port()}/x")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)

    code = run_command(
        ["mcp", "--tools", "outbox.sandbox.tools", "--transport", "http", "--port", "0", *flags]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith("outbox mcp: configuration error: ")
    assert says in err
    assert "CANARY" not in err


def test_an_unset_token_variable_is_refused_without_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_TEST_MCP_TOKEN", "  ")
    code = run_command(
        [
            "mcp",
            "--tools",
            "outbox.sandbox.tools",
            "--transport",
            "http",
            "--bearer-token-env",
            "OUTBOX_TEST_MCP_TOKEN",
        ]
    )

    assert code == 2
    assert "'OUTBOX_TEST_MCP_TOKEN', which is unset or empty" in capsys.readouterr().err


def test_http_flags_on_stdio_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_command(["mcp", "--tools", "outbox.sandbox.tools", "--port", "9000"])

    assert code == 2
    assert "apply to --transport http" in capsys.readouterr().err
