"""The operator console under test: a database login that is only an operator, the
console's settings for it, and logging in through its forms."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import psycopg
from psycopg import sql
from pydantic import SecretStr
from starlette.testclient import TestClient

from outbox import Operation, Registry, Settings
from outbox import schema as outbox_schema
from outbox.broker import OperationChunk, OperationMessage, Topology, declare_topology
from outbox.console.app import Console, create_app
from outbox.console.config import AuthConfig, Credential, ProxyIdentity, parse_proxies

from support.broker_helpers import message_count, wait_for_dead_letter_queue, wait_for_messages
from support.waiting import POLL_SECONDS

OPERATOR = "ada@example.com"
TOKEN = "tok-" + "a1" * 16
OTHER = "grace@example.com"
OTHER_TOKEN = "tok-" + "b2" * 16
CANARY = "<script>alert('canary')</script>"

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def as_user(url: str, user: str) -> str:
    """The same server and database, as ``user`` (the test cluster trusts local users)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))


@contextlib.contextmanager
def operator_login(postgres_server_url: str, database_url: str) -> Iterator[str]:
    """roles.sql applied to the database, and a LOGIN user whose only role is
    outbox_operator; yields its URL for that database and drops it afterwards."""
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_roles(connection)
    user = f"outbox_test_console_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE outbox_operator").format(sql.Identifier(user))
        )
    try:
        yield as_user(database_url, user)
    finally:
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("REVOKE outbox_operator FROM {}").format(sql.Identifier(user)))
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))


def console_settings(settings: Settings, operator_url: str) -> Settings:
    return settings.model_copy(update={"database_url": SecretStr(operator_url)})


def token_auth() -> AuthConfig:
    return AuthConfig(
        credentials=(
            Credential(name=OPERATOR, token=TOKEN),
            Credential(name=OTHER, token=OTHER_TOKEN),
        )
    )


def proxy_auth(proxies: str = "10.0.0.7") -> AuthConfig:
    return AuthConfig(
        proxy=ProxyIdentity(header="X-Forwarded-User", proxies=parse_proxies(proxies))
    )


def console(
    settings: Settings, *, registry: Registry | None = None, auth: AuthConfig | None = None
) -> Console:
    return Console(settings=settings, auth=auth or token_auth(), registry=registry)


def client(app_console: Console, *, address: str = "127.0.0.1") -> TestClient:
    return TestClient(
        create_app(app_console),
        base_url="http://127.0.0.1",
        client=(address, 50000),
        follow_redirects=False,
    )


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


def logged_in(test_client: TestClient, token: str = TOKEN) -> TestClient:
    page = test_client.get("/login")
    assert page.status_code == 200
    answer = test_client.post("/login", data={"token": token, "csrf_token": csrf_of(page.text)})
    assert answer.status_code == 303, answer.text
    return test_client


def csrf(test_client: TestClient, path: str = "/") -> str:
    page = test_client.get(path)
    assert page.status_code == 200, page.text
    return csrf_of(page.text)


async def dead_letter_one(
    settings: Settings,
    envelope: OperationMessage | OperationChunk | bytes,
    *,
    message_id: str = "outbox-1",
) -> None:
    """A genuine dead letter, x-death and all: taken from the operations queue (this
    test's topology, declared here) and rejected without requeue, as the consumer
    rejects poison. Bytes are a body that is no envelope, sent as send_refund v1's.
    Returns once the letter is in the dead-letter queue: the broker dead-letters after
    the reject is acknowledged, not before."""
    if isinstance(envelope, bytes):
        body, routing_key = envelope, "send_refund.v1"
    else:
        first = envelope.operations[0] if isinstance(envelope, OperationChunk) else envelope
        body = envelope.model_dump_json().encode()
        routing_key = f"{first.tool}.v{first.tool_version}"
    amqp_url = settings.amqp_url.get_secret_value()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await declare_topology(channel, Topology.from_settings(settings))
        dead_before = await message_count(amqp_url, settings.dead_letter_queue)
        if not dead_before:  # a queue that holds a letter has shown it takes them
            await wait_for_dead_letter_queue(amqp_url, settings.dead_letter_queue)
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(
            aio_pika.Message(body, message_id=message_id), routing_key=routing_key
        )
        queue = await channel.get_queue(settings.queue)
        taken = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        # A confirmed message takes a moment to become visible in a quorum queue.
        while taken is None and loop.time() < deadline:
            taken = await queue.get(no_ack=False, fail=False)
            if taken is None:
                await asyncio.sleep(POLL_SECONDS)
        assert taken is not None
        await taken.reject(requeue=False)
    await wait_for_messages(amqp_url, settings.dead_letter_queue, count=dead_before + 1)


def envelope_of(op: Operation) -> OperationMessage:
    return OperationMessage(
        operation_id=op.id,
        outbox_id=7,
        tool=op.tool_name,
        tool_version=op.tool_version,
        input_fingerprint=op.input_fingerprint,
    )
