"""``outbox demo``: the lost refund response, twice.

First a naive runtime that retries on any exception: the provider commits the refund,
the response is lost to a timeout, the retry refunds again. Then the same fault under
effect-outbox: the decision is recorded with its outbox row, the dispatcher publishes
it, the consumer calls the provider with the operation id as the idempotency key, the
timeout becomes ``outcome_unknown``, the reconciler looks the refund up and finds it.
The provider's ledger is the evidence: two refunds, then one.

Everything runs against the local Postgres and RabbitMQ in a database and broker names
of its own, with the daemons as real subprocesses; all of it is removed at the end.
Exit status 0 only if the guarantee held.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx
import psycopg

from outbox import lifecycle, store
from outbox.decisions import record_decision
from outbox.errors import ServiceUnavailable
from outbox.loading import load_registry
from outbox.migrate import migrate
from outbox.models import Operation, OperationEvent
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.settings import Settings, database_name, redact_url, with_database
from outbox.states import OperationState
from outbox.store import Store

TOOLS_MODULE = "outbox.sandbox.tools"
DEADLINE_SECONDS = 1.0
# The provider commits, then answers after this: past the tool's deadline, so the
# caller sees a timeout although the refund exists.
SLOW_ANSWER_MS = 1100
SETTLE_WITHIN_SECONDS = 60.0


@dataclass(frozen=True)
class DemoNames:
    database_url: str
    exchange: str
    queue: str
    dead_letter_exchange: str
    dead_letter_queue: str

    @classmethod
    def fresh(cls, settings: Settings) -> DemoNames:
        tag = uuid.uuid4().hex[:8]
        return cls(
            database_url=with_database(settings.libpq_url, f"outbox_demo_{tag}"),
            exchange=f"demo.{tag}.outbox",
            queue=f"demo.{tag}.operations",
            dead_letter_exchange=f"demo.{tag}.dead",
            dead_letter_queue=f"demo.{tag}.operations.dead",
        )


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="watch a lost refund response: a naive retry refunds twice, effect-outbox once",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from outbox.cli import add_setting_flags

    add_setting_flags(parser, "database_url", "amqp_url")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    # The story is told on stdout; the sandbox's and httpx's own chatter would drown it.
    for noisy in ("outbox.sandbox.provider", "outbox.lifecycle", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    names = DemoNames.fresh(settings)
    say("effect-outbox demo: a refund whose response is lost in a timeout\n")
    with SandboxProvider(faults=Faults(delay_ms=SLOW_ANSWER_MS)) as provider:
        naive_refunds = naive_runtime(provider)
        provider.reset()
        try:
            outbox_refunds = with_effect_outbox(settings, names, provider)
        finally:
            clean_up(settings, names)
    held = naive_refunds == 2 and outbox_refunds == 1
    say(
        "\nguarantee held: one decision, one effect."
        if held
        else f"\nGUARANTEE BROKEN: effect-outbox produced {outbox_refunds} refunds."
    )
    return 0 if held else 1


def say(line: str) -> None:
    print(line, flush=True)


def naive_runtime(provider: SandboxProvider) -> int:
    say("1. a naive runtime: retry on exception")
    refund = {"payment_id": "pay_demo_naive", "amount_cents": 2500, "currency": "EUR"}
    with httpx.Client(base_url=provider.url, timeout=DEADLINE_SECONDS) as http:
        for attempt in (1, 2):
            key = str(uuid.uuid4())  # a new key per attempt: the naive runtime's mistake
            try:
                response = http.post("/refunds", json=refund, headers={"Idempotency-Key": key})
            except httpx.TimeoutException as timeout:
                say(
                    f"   attempt {attempt}  POST /refunds -> no answer within "
                    f"{DEADLINE_SECONDS:g} s ({type(timeout).__name__}); retrying"
                )
                provider.set_faults(delay_ms=0)  # the network recovers for the retry
                continue
            status = response.status_code
            say(f"   attempt {attempt}  POST /refunds -> {status}, the trace says: success")
            break
    count = len(provider.ledger()["refunds"])
    say(f"   provider ledger: {count} refunds for one decision  <- refunded twice\n")
    return count


def with_effect_outbox(settings: Settings, names: DemoNames, provider: SandboxProvider) -> int:
    say("2. effect-outbox: the same fault")
    migrate(names.database_url)
    provider.set_faults(delay_ms=SLOW_ANSWER_MS)
    run_id = f"run_{uuid.uuid4().hex[:6]}"
    environment = daemon_environment(settings, names, provider)
    registry = load_registry([TOOLS_MODULE])
    with psycopg.connect(names.database_url) as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_demo", "amount_cents": 2500, "reason": "parcel arrived damaged"},
            run_id=run_id,
            decision_key="call_demo_1",
        )
        connection.commit()
    operation = recorded.operation
    daemons = [start(module, environment) for module in ("dispatcher", "consumer")]
    try:
        final = wait_until_settled(names.database_url, operation, daemons)
    finally:
        for daemon in daemons:
            stop(daemon)
    for event in events_of(names.database_url, operation):
        say("   " + trace_line(event, operation))
    outcome = "refund_confirmed" if final.state is OperationState.COMMITTED else str(final.state)
    completed = lifecycle.agent_completed(run_id, outcome)
    name, _, fields = completed.partition(" ")
    say(f"   {name:<25} {fields}")
    count = len(provider.ledger()["refunds"])
    say(f"   provider ledger: {count} refund for one decision")
    return count


def daemon_environment(
    settings: Settings, names: DemoNames, provider: SandboxProvider
) -> dict[str, str]:
    return {
        **os.environ,
        "OUTBOX_DATABASE_URL": names.database_url,
        "OUTBOX_AMQP_URL": settings.amqp_url.get_secret_value(),
        "OUTBOX_EXCHANGE": names.exchange,
        "OUTBOX_QUEUE": names.queue,
        "OUTBOX_DEAD_LETTER_EXCHANGE": names.dead_letter_exchange,
        "OUTBOX_DEAD_LETTER_QUEUE": names.dead_letter_queue,
        "OUTBOX_TOOLS": TOOLS_MODULE,
        "OUTBOX_SANDBOX_URL": provider.url,
        "OUTBOX_SANDBOX_REFUND_DEADLINE": str(DEADLINE_SECONDS),
        "OUTBOX_POLL_INTERVAL": "0.2",
        "OUTBOX_RECONCILE_INTERVAL": "0.1",
        "OUTBOX_METRICS_HOST": "127.0.0.1",
        "OUTBOX_METRICS_PORT": "0",
        "OUTBOX_LOG_LEVEL": "WARNING",
    }


def start(module: str, environment: dict[str, str]) -> subprocess.Popen[bytes]:
    # The command is this interpreter and one of the project's own modules.
    return subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", module],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop(daemon: subprocess.Popen[bytes]) -> None:
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    if daemon.stderr is not None:
        daemon.stderr.close()


def wait_until_settled(
    database_url: str, operation: Operation, daemons: list[subprocess.Popen[bytes]]
) -> Operation:
    deadline = time.monotonic() + SETTLE_WITHIN_SECONDS
    while True:
        with psycopg.connect(database_url) as connection:
            current = Store(connection).run(store.get_operation(operation.id))
        if current.state in (
            OperationState.COMMITTED,
            OperationState.REJECTED,
            OperationState.ESCALATED,
        ):
            return current
        for daemon in daemons:
            if daemon.poll() is not None:
                errors = daemon.stderr.read().decode(errors="replace") if daemon.stderr else ""
                raise ServiceUnavailable(
                    f"a daemon exited early with status {daemon.returncode}:\n{errors[-2000:]}"
                )
        if time.monotonic() > deadline:
            raise ServiceUnavailable(
                f"{operation.display_id} did not settle within {SETTLE_WITHIN_SECONDS:g} s "
                f"(state {current.state})"
            )
        time.sleep(0.05)  # polling the database for the outcome, with the deadline above


def events_of(database_url: str, operation: Operation) -> list[OperationEvent]:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(store.events(operation.id))


_SHOWN = {
    "operation.prepared": ("tool",),
    "operation.attempted": ("attempt",),
    "operation.outcome_unknown": ("reason",),
    "operation.reconciled": ("result",),
    "operation.committed": ("provider_reference",),
    "operation.reconcile_deferred": ("reason",),
    "operation.escalated": ("reason",),
    "operation.retry_scheduled": ("reason",),
}


def trace_line(event: OperationEvent, operation: Operation) -> str:
    fields: dict[str, lifecycle.Scalar] = {"id": operation.display_id}
    for key in _SHOWN.get(event.name, ()):
        value = event.attributes.get(key)
        if value is not None:
            fields[key] = value
    return f"{event.name:<25} " + lifecycle.format_event("", fields).strip()


def clean_up(settings: Settings, names: DemoNames) -> None:
    """Remove the demo's database and broker objects; say so if something stays."""
    try:
        with psycopg.connect(
            with_database(settings.libpq_url, "postgres"), autocommit=True
        ) as admin:
            store.drop_database(admin, database_name(names.database_url))
    except (psycopg.Error, OSError) as failure:
        say(f"   (could not drop {redact_url(names.database_url)}: {type(failure).__name__})")
    try:
        asyncio.run(_delete_broker_objects(settings.amqp_url.get_secret_value(), names))
    except (OSError, aio_pika.exceptions.AMQPError) as failure:
        say(f"   (could not delete the demo's queues: {type(failure).__name__})")


async def _delete_broker_objects(amqp_url: str, names: DemoNames) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for queue in (names.queue, names.dead_letter_queue):
            await channel.queue_delete(queue)
        for exchange in (names.exchange, names.dead_letter_exchange):
            await channel.exchange_delete(exchange)
