"""Tool inputs stay in ``operations.input`` and nowhere else (docs/design.md section 10):
not in either daemon's log, at DEBUG and in both formats, not in the metrics, not in
``operation_events``, not in the messages on the broker."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import uuid

import aio_pika
import psycopg

from outbox import OperationState, Settings
from outbox.sandbox.provider import Faults

from support.system import SETTLED, Daemon, System, running_system
from support.waiting import eventually_sync

S = OperationState

_LISTENING = re.compile(r" action=http\.listening port=(\d+)")


def listening_port(line: str) -> int | None:
    """The metrics port from a daemon's ``http.listening`` line, in either log format."""
    if line.startswith("{"):
        fields = json.loads(line)
        return int(fields["port"]) if fields.get("action") == "http.listening" else None
    found = _LISTENING.search(line)
    return int(found.group(1)) if found else None


def scrape(daemon: Daemon) -> str:
    ports = [port for line in daemon.lines if (port := listening_port(line)) is not None]
    assert ports, f"{daemon.kind} never logged its metrics port"
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=5) as response:
        return str(response.read().decode())


def published_count(system: System) -> int:
    with psycopg.connect(system.database_url) as connection:
        row = connection.execute(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
        ).fetchone()
        assert row is not None
        return int(row[0])


async def peek_messages(amqp_url: str, queue: str, expect: int) -> list[tuple[bytes, str]]:
    """Every message in ``queue`` as (body, headers as text), each put back afterwards."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.get_queue(queue, ensure=True)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []
        # Held unacked, so the same message cannot come round twice while we read.
        while (message := await declared.get(no_ack=False, fail=False)) is not None:
            held.append(message)
        seen = [(m.body, repr(m.headers) + repr(m.properties)) for m in held]
        for message in held:
            await message.nack(requeue=True)
    assert len(seen) == expect, f"expected {expect} messages on {queue}, found {len(seen)}"
    return seen


def test_tool_inputs_reach_no_log_metric_event_or_message(
    settings: Settings, amqp_server_url: str
) -> None:
    tag = uuid.uuid4().hex[:12]
    canaries = {
        "reason": f"canaryReason{tag}",
        "subject": f"canarySubject{tag}",
        "body": f"canaryBody{tag}",
        "to": f"canaryto{tag}",
    }
    # Every response dropped: the refund goes through reconciliation, the email (no
    # lookup) escalates, so the unknown-outcome and escalation paths log too.
    with running_system(settings, faults=Faults(drop_response_every=1)) as system:
        system.environment["OUTBOX_LOG_LEVEL"] = "DEBUG"
        refund = system.decide(reason=f'customer said: {canaries["reason"]} "quoted"\nline')
        email = system.decide(
            "send_email",
            to=f"{canaries['to']}@example.com",
            subject=f"Re: {canaries['subject']}",
            body=f"Hello,\n{canaries['body']}\n",
        )

        # The dispatcher alone first (JSON logs), so the messages can be read off the
        # queue before any consumer takes them.
        dispatcher = (
            system.start_with("dispatcher", OUTBOX_LOG_FORMAT="json")
            if hasattr(system, "start_with")
            else _start(system, "dispatcher", "json")
        )
        eventually_sync(
            lambda: published_count(system) == 2, within=20, what="both messages published"
        )
        messages = asyncio.run(peek_messages(amqp_server_url, settings.queue, expect=2))

        consumer = _start(system, "consumer", "logfmt")
        assert system.wait_for(refund.id, *SETTLED).state is S.COMMITTED
        assert system.wait_for(email.id, *SETTLED).state is S.ESCALATED
        assert "operation.reconciled" in system.events(refund.id)
        exposition = {daemon.kind: scrape(daemon) for daemon in (dispatcher, consumer)}

        with psycopg.connect(system.database_url) as connection:
            inputs = [
                str(row[0])
                for row in connection.execute("SELECT input::text FROM operations ORDER BY id")
            ]
            events = [
                f"{name} {attributes}"
                for name, attributes in connection.execute(
                    "SELECT name, attributes::text FROM operation_events"
                )
            ]
        outputs = {daemon.kind: daemon.output() for daemon in (dispatcher, consumer)}

    # Sanity: the canaries are where they belong, so their absence elsewhere means something.
    stored = "\n".join(inputs)
    for canary in canaries.values():
        assert canary in stored
    # The daemons ran at DEBUG; their own lines came through, and third-party loggers
    # (httpx logs request URLs at INFO) were held at WARNING even so.
    dispatcher_lines = [json.loads(line) for line in outputs["dispatcher"].splitlines() if line]
    assert any(line["logger"].startswith("dispatcher") for line in dispatcher_lines)
    assert all(
        line["level"] in ("warning", "error", "critical")
        for line in dispatcher_lines
        if not line["logger"].startswith(("outbox", "dispatcher", "consumer"))
    )
    assert "level=info logger=consumer" in outputs["consumer"]
    # Fields are data in both formats: the start line's queue is a key, not message text.
    started = [line for line in dispatcher_lines if line.get("action") == "dispatcher.started"]
    assert [line["queue"] for line in started] == [settings.queue]
    assert " action=consumer.started worker=" in outputs["consumer"]
    assert f" queue={settings.queue} " in outputs["consumer"]
    assert "logger=httpx" not in outputs["consumer"]
    assert len(events) >= 8
    for kind in ("dispatcher", "consumer"):
        assert "outbox_" in exposition[kind]

    for name, canary in canaries.items():
        for kind, output in outputs.items():
            assert canary not in output, f"{name} leaked into the {kind} log"
        for kind, text in exposition.items():
            assert canary not in text, f"{name} leaked into the {kind} metrics"
        for event in events:
            assert canary not in event, f"{name} leaked into an event: {event}"
        for body, headers in messages:
            assert canary.encode() not in body, f"{name} leaked into a message body"
            assert canary not in headers, f"{name} leaked into message headers"


def _start(system: System, kind: str, log_format: str) -> Daemon:
    # Popen copies the environment at start, so each daemon keeps the format it began with.
    system.environment["OUTBOX_LOG_FORMAT"] = log_format
    return system.start(kind)
