"""``outbox demo``: the lost refund response, twice, a lost email answer, then a
provider that is down for a few seconds.

What it shows, and what it needs, is :data:`DESCRIPTION`, the text ``outbox demo --help``
prints (plain text: a terminal shows it as written).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import os
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import Any

import aio_pika
import aiormq.exceptions
import httpx
import psycopg

from outbox import lifecycle, store
from outbox.awaiting import Outcome, OutcomeStatus, await_outcome_sync
from outbox.broker import connect as connect_to_broker
from outbox.callbacks import CallbackReceiver
from outbox.contracts import Registry
from outbox.decisions import record_decision
from outbox.errors import ServiceUnavailable, connect_failure
from outbox.loading import load_registry
from outbox.models import Operation, OperationEvent
from outbox.sandbox.processes import DaemonProcess, python_module
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.receiver import LocalReceiver
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.tools import (
    CALLBACK_WAIT_ENV,
    REFUND_DEADLINE_ENV,
    SANDBOX_PROVIDER,
    SANDBOX_URL_ENV,
)
from outbox.sandbox.webhooks import EMAIL, PAYMENTS, WebhookTarget
from outbox.settings import Settings, redact_amqp_urls, redact_url, with_database
from outbox.store import Store

TOOLS_MODULE = "outbox.sandbox.tools"
DEADLINE_SECONDS = 1.0
# The provider commits, then answers after this: past the tool's deadline, so the
# caller sees a timeout although the refund exists.
SLOW_ANSWER_MS = 1100
SETTLE_WITHIN_SECONDS = 60.0
# How long the email's unknown outcome waits for its delivery callback before its
# contract hands it to a person: longer than the scene needs, so the callback wins.
CALLBACK_WAIT_SECONDS = 30.0
# The webhook leaves the provider this long after the email: the consumer has recorded
# the lost answer by then, as it would have with a real provider's minutes.
WEBHOOK_DELAY_MS = 300
# The fourth scene: how many refunds are decided while the provider is down, and for
# how long it stays down once its breaker has opened.
OUTAGE_DECISIONS = 6
OUTAGE_SECONDS = 4.0
# How long each service may take to answer before the demo says it is missing.
SERVICE_CHECK_SECONDS = 5


DESCRIPTION = """\
Watch a lost refund response, twice, then a lost email answer.

First a naive runtime that retries on any exception: the provider commits the refund,
the response is lost to a timeout, and the retry refunds again. Then the same fault
under effect-outbox: the decision is recorded with its outbox row, the dispatcher
publishes it, the consumer calls the provider with the operation id as the idempotency
key, the timeout becomes outcome_unknown, and the reconciler looks the refund up and
finds it. The provider's ledger is the evidence: two refunds, then one. Last, an email,
which no lookup can find: its answer is lost too, and the provider's signed delivery
callback (verified and recorded as `outbox callbacks serve` does) settles it, where a
person would otherwise have had to. Then the refunds provider goes down for a few
seconds, answering 503 to every call and every lookup, while six refunds are decided:
the calls that get no answer open its breaker, the refunds wait without spending
attempts or lookups, one probe at a time finds it back, and all six settle, one refund
each, with nobody asked.

Everything runs against the local Postgres and RabbitMQ, in a database and broker names
of its own, with the daemons as real subprocesses; all of it is removed at the end, also
when the demo is stopped with SIGTERM or Ctrl-C. Both services are checked first: a
missing one is named in one line, with how to start it. Exit status 0 only if the
guarantee held.
"""


def scratch_for(settings: Settings) -> ScratchEnvironment:
    """A database ``outbox_demo_<tag>`` and broker names ``demo.<tag>.*`` for one run: its
    tag is printed once they exist, so that they can be found (and checked gone)."""
    return ScratchEnvironment.unique(settings, "demo")


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="watch a lost refund response (a naive retry refunds twice, effect-outbox "
        "once), then a lost email answer settled by its provider's callback",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from outbox.cli import add_setting_flags

    add_setting_flags(parser, "database_url", "amqp_url")
    parser.set_defaults(handler=run)


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: unwind, so that what the demo made is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The handler only sets this; the demo's loops and steps look at it. An exception raised
# in the handler itself is lost (printed, and ignored) when the signal lands in a
# finalizer or a weakref callback, and then nothing would be removed.
_stop_requested: list[int] = []


def _request_stop(signum: int, frame: FrameType | None) -> None:
    _stop_requested.append(signum)


def checkpoint() -> None:
    if _stop_requested:
        raise Stopped(_stop_requested[0])


def run(args: argparse.Namespace, settings: Settings) -> int:
    # The story is told on stdout; the sandbox's and httpx's own chatter would drown it.
    for noisy in ("outbox.sandbox.provider", "outbox.lifecycle", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    check_services(settings)
    scratch = scratch_for(settings)
    # Python's default for SIGTERM ends the process without unwinding, and its
    # KeyboardInterrupt can be lost the same way as an exception raised by a handler:
    # the database and the queues would stay behind, and the daemons would run on.
    _stop_requested.clear()
    previous = {
        signum: signal.signal(signum, _request_stop) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        return tell_the_story(scratch)
    except Stopped as stopped:
        say(f"\ndemo stopped by {signal.Signals(stopped.signum).name}")
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def tell_the_story(scratch: ScratchEnvironment) -> int:
    say("effect-outbox demo: a refund, then an email, whose answers are lost\n")
    daemons: list[DaemonProcess] = []
    with SandboxProvider(faults=Faults(delay_ms=SLOW_ANSWER_MS)) as provider:
        naive_refunds = naive_runtime(provider)
        provider.reset()
        checkpoint()
        try:
            outbox_refunds = with_effect_outbox(scratch, provider, daemons)
            checkpoint()
            emails = settled_by_its_callback(scratch, provider, daemons)
            checkpoint()
            waited_out = wait_out_an_outage(scratch, provider, daemons)
        finally:
            # A second signal must not cut this short: the daemons would outlive us.
            with _signals_held():
                for daemon in daemons:
                    daemon.stop()
                clean_up(scratch)
    checkpoint()
    held = (
        naive_refunds == 2
        and outbox_refunds == 1
        and emails == 1
        and waited_out == OUTAGE_DECISIONS
    )
    say(
        "\nguarantee held: each decision one effect, settled without a person."
        if held
        else f"\nGUARANTEE BROKEN: effect-outbox produced {outbox_refunds} refunds and "
        f"{emails} settled emails, and {waited_out} of {OUTAGE_DECISIONS} refunds "
        "waited out the outage."
    )
    return 0 if held else 1


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    previous = {
        signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_services(settings: Settings) -> None:
    """Both services answer, or one line says which does not and how to start it. Without
    this, a missing broker showed half the demo and then nothing for a minute."""
    server = with_database(settings.libpq_url, "postgres")
    try:
        psycopg.connect(server, connect_timeout=SERVICE_CHECK_SECONDS).close()
    except psycopg.Error as failure:
        raise ServiceUnavailable(
            f"cannot connect to Postgres at {redact_url(server)} ({connect_failure(failure)}): "
            "is it running? Start it (`docker compose up -d postgres`, or your "
            "distribution's postgresql package) or point OUTBOX_DATABASE_URL at a running server"
        ) from None
    url = settings.amqp_url.get_secret_value()
    # aiormq logs each failed connect itself, with the address: the line below says it.
    client_log = logging.getLogger("aiormq")
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    try:
        asyncio.run(_broker_answers(url))
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as failure:
        raise ServiceUnavailable(
            f"cannot connect to RabbitMQ at {redact_amqp_urls(url)} ({_broker_failure(failure)}): "
            "is it running? Start it (`docker compose up -d rabbitmq`, or your "
            "distribution's rabbitmq-server package) or point OUTBOX_AMQP_URL at a running broker"
        ) from None
    finally:
        client_log.setLevel(level)


async def _broker_answers(url: str) -> None:
    async with asyncio.timeout(SERVICE_CHECK_SECONDS):
        connection = await connect_to_broker(url)
    await connection.close()


def _broker_failure(failure: BaseException) -> str:
    # aiormq's texts can quote the URL; its refusals carry the errno first.
    if isinstance(failure, ConnectionRefusedError) or (
        isinstance(failure, aiormq.exceptions.AMQPConnectionError)
        and failure.args
        and failure.args[0] == 111
    ):
        return "connection refused"
    if isinstance(failure, aiormq.exceptions.ProbableAuthenticationError):
        return "the broker refused the user name or password"
    return type(failure).__name__


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


def with_effect_outbox(
    scratch: ScratchEnvironment, provider: SandboxProvider, daemons: list[DaemonProcess]
) -> int:
    """The same fault under effect-outbox; the daemons it starts go into ``daemons``, for
    the caller to stop however this ends."""
    say("2. effect-outbox: the same fault")
    # The schema, and what `outbox migrate --broker` declares: the daemons require both.
    scratch.create()
    say_created(scratch)
    provider.set_faults(delay_ms=SLOW_ANSWER_MS)
    environment = daemon_environment(scratch.settings, provider)
    database_url = scratch.database_url
    run_id, operation = decide(
        database_url,
        load_registry([TOOLS_MODULE]),
        "send_refund",
        {"payment_id": "pay_demo", "amount_cents": 2500, "reason": "parcel arrived damaged"},
    )
    for module in ("dispatcher", "consumer"):
        checkpoint()
        daemons.append(start(module, environment))
    final = wait_until_settled(database_url, operation, daemons)
    tell_the_trace(database_url, operation, run_id, final, "refund_confirmed")
    count = len(provider.ledger()["refunds"])
    say(f"   provider ledger: {count} refund for one decision")
    return count


def settled_by_its_callback(
    scratch: ScratchEnvironment, provider: SandboxProvider, daemons: list[DaemonProcess]
) -> int:
    """An email (no lookup exists for one) whose answer is lost: the provider's signed
    delivery callback, verified and recorded by ``record_callback``, settles it. Returns
    how many emails went out for the one decision, if it settled committed."""
    say("\n3. an email whose answer is lost: the provider's signed callback settles it")
    keys = demo_secrets()
    registry = load_registry([TOOLS_MODULE])
    receiver = CallbackReceiver(registry, keys)
    with LocalReceiver(receiver, scratch.database_url) as local:
        say(
            f"   (callbacks verified and recorded at {local.url}/callbacks/<provider>, "
            "as `outbox callbacks serve` does)"
        )
        provider.set_webhooks(WebhookTarget(local.url, keys))
        provider.set_faults(delay_ms=0, drop_response_every=1, webhook_delay_ms=WEBHOOK_DELAY_MS)
        run_id, operation = decide(
            scratch.database_url,
            registry,
            "send_email",
            {
                "to": "customer@example.com",
                "subject": "Your refund is on its way",
                "body": "We refunded your damaged parcel.",
            },
        )
        final = wait_until_settled(scratch.database_url, operation, daemons)
        provider.set_webhooks(None)
    tell_the_trace(scratch.database_url, operation, run_id, final, "email_confirmed")
    emails = len(provider.ledger()["emails"])
    say(
        f"   provider log: {emails} email sent, its delivery reported by a signed callback; "
        "no person needed"
    )
    return emails if final.status is OutcomeStatus.COMMITTED else 0


def wait_out_an_outage(
    scratch: ScratchEnvironment, provider: SandboxProvider, daemons: list[DaemonProcess]
) -> int:
    """The refunds provider down for a few seconds while refunds are decided: they wait
    for it, spending nothing, and settle once it is back. Returns how many settled
    committed with exactly one refund each and nobody asked."""
    say("\n4. the provider is down for a few seconds: the decisions wait, then settle")
    provider.reset()
    provider.set_faults(unavailable=True)
    registry = load_registry([TOOLS_MODULE])
    decided = [
        decide(
            scratch.database_url,
            registry,
            "send_refund",
            {"payment_id": f"pay_outage_{n}", "amount_cents": 1500 + n},
        )
        for n in range(OUTAGE_DECISIONS)
    ]
    opened = wait_for_breaker(scratch.database_url, open_=True)
    say(
        f"   {'provider.unavailable':<{TRACE_WIDTH}} provider=sandbox after "
        f"{opened.failing} refunds' calls got 503: they wait, spending nothing"
    )
    down_until = time.monotonic() + OUTAGE_SECONDS
    while time.monotonic() < down_until:
        checkpoint()
        time.sleep(0.1)  # the outage the scene shows, not a wait for a condition
    provider.set_faults(unavailable=False)
    finals = [wait_until_settled(scratch.database_url, op, daemons) for _, op in decided]
    closed = wait_for_breaker(scratch.database_url, open_=False)
    say(
        f"   {'provider.available':<{TRACE_WIDTH}} provider=sandbox outage_seconds="
        f"{closed.outage_seconds:.1f} probes={closed.probes} operations_waited={closed.waited}"
    )
    refunds = provider.ledger()["refunds_by_key"]
    settled = [
        final
        for (_, op), final in zip(decided, finals, strict=True)
        if final.status is OutcomeStatus.COMMITTED and refunds.get(str(op.id)) == 1
    ]
    say(
        f"   {len(settled)} of {len(decided)} refunds committed, one refund each; "
        f"{sum(final.status is OutcomeStatus.ESCALATED for final in finals)} asked a person"
    )
    return len(settled)


class _Breaker:
    """What the scene says of the refunds provider's breaker."""

    def __init__(self, row: dict[str, Any] | None, event: dict[str, Any] | None) -> None:
        attributes = (event or {}).get("attributes") or {}
        self.failing = len((row or {}).get("failing_operations") or [])
        self.outage_seconds = float(attributes.get("outage_seconds", 0.0))
        self.probes = int(attributes.get("probes", 0))
        self.waited = int(attributes.get("operations_waited", 0))


def wait_for_breaker(database_url: str, *, open_: bool) -> _Breaker:
    """Wait for the refunds provider's breaker to open (``open_``) or to have closed
    again after its outage, and read what the scene tells of it."""
    deadline = time.monotonic() + SETTLE_WITHIN_SECONDS
    while True:
        checkpoint()
        with psycopg.connect(database_url) as connection:
            runner = Store(connection)
            rows = {row.health.provider: row for row in runner.run(store.all_providers())}
            events = runner.run(store.provider_events(SANDBOX_PROVIDER, limit=1))
        row = rows.get(SANDBOX_PROVIDER)
        if open_ and row is not None and not row.health.available:
            return _Breaker(row.health.model_dump(), None)
        if not open_ and events and events[0]["name"] == "provider.available":
            return _Breaker(None, dict(events[0]))
        if time.monotonic() > deadline:
            raise ServiceUnavailable(
                "the refunds provider's breaker did not "
                + ("open" if open_ else "close")
                + f" within {SETTLE_WITHIN_SECONDS:g} s"
            )
        time.sleep(0.1)


def decide(
    database_url: str, registry: Registry, tool: str, tool_input: dict[str, Any]
) -> tuple[str, Operation]:
    """What the agent does: record the decision, in a run of its own, and commit."""
    run_id = f"run_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(database_url) as connection:
        recorded = record_decision(
            connection, registry, tool, tool_input, run_id=run_id, decision_key=f"call_{tool}"
        )
        connection.commit()
    return run_id, recorded.operation


def demo_secrets() -> dict[str, tuple[str]]:
    """Fresh secrets for this run's webhooks, in each scheme's own format."""
    return {
        PAYMENTS.name: ("whsec_" + secrets.token_hex(24),),
        EMAIL.name: ("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode(),),
    }


def tell_the_trace(
    database_url: str, operation: Operation, run_id: str, final: Outcome, confirmed: str
) -> None:
    for event in events_of(database_url, operation):
        say("   " + trace_line(event, operation))
    outcome = confirmed if final.status is OutcomeStatus.COMMITTED else str(final.status)
    completed = lifecycle.agent_completed(run_id, outcome)
    name, _, fields = completed.partition(" ")
    say(f"   {name:<{TRACE_WIDTH}} {fields}")


def say_created(scratch: ScratchEnvironment) -> None:
    say(
        f"   (database {scratch.database.name} and broker names demo.{scratch.tag}.* "
        "created for this run, removed at the end)"
    )


def daemon_environment(settings: Settings, provider: SandboxProvider) -> dict[str, str]:
    """The daemons' environment: ``settings`` (this run's names), the sandbox's tools
    at ``provider``, and waits short enough for a story told in seconds."""
    daemon_settings = settings.model_copy(
        update={
            "tools": TOOLS_MODULE,
            "poll_interval": 0.2,
            "reconcile_interval": 0.1,
            "metrics_host": "127.0.0.1",
            "metrics_port": 0,
            "log_level": "WARNING",
            # The outage scene lasts seconds: probe it often, release at once.
            "provider_longest_probe": 2.0,
            "provider_release_spread": 1.0,
            "provider_health_refresh": 0.2,
        }
    )
    return {
        **os.environ,
        **daemon_settings.to_environment(),
        SANDBOX_URL_ENV: provider.url,
        REFUND_DEADLINE_ENV: str(DEADLINE_SECONDS),
        CALLBACK_WAIT_ENV: str(CALLBACK_WAIT_SECONDS),
    }


def start(module: str, environment: dict[str, str]) -> DaemonProcess:
    # Its output is kept to say why, should it exit early.
    return DaemonProcess(python_module(module), environment=environment, capture=True)


def wait_until_settled(
    database_url: str, operation: Operation, daemons: list[DaemonProcess]
) -> Outcome:
    """What the agent does: await the outcome (in slices, to notice a daemon that died
    or a Ctrl-C between them)."""
    deadline = time.monotonic() + SETTLE_WITHIN_SECONDS
    while True:
        checkpoint()
        outcome = await_outcome_sync(database_url, operation, timeout=0.5)
        if outcome.status is not OutcomeStatus.PENDING:
            return outcome
        for daemon in daemons:
            if not daemon.running():
                checkpoint()  # Ctrl-C in a terminal stops the daemons too: not a failure
                raise ServiceUnavailable(
                    f"a daemon exited early with status {daemon.returncode}:\n"
                    f"{daemon.output()[-2000:]}"
                )
        if time.monotonic() > deadline:
            raise ServiceUnavailable(
                f"{operation.display_id} did not settle within {SETTLE_WITHIN_SECONDS:g} s "
                f"(state {outcome.state})"
            )


def events_of(database_url: str, operation: Operation) -> list[OperationEvent]:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(store.events(operation.id))


TRACE_WIDTH = 27
_SHOWN = {
    "operation.prepared": ("tool",),
    "operation.attempted": ("attempt",),
    "operation.outcome_unknown": ("reason",),
    "operation.callback_received": ("provider", "status"),
    "operation.reconciled": ("result", "method"),
    "operation.committed": ("provider_reference",),
    "operation.reconcile_deferred": ("reason",),
    "operation.escalated": ("reason",),
    "operation.retry_scheduled": ("reason",),
    "operation.waiting": ("provider", "reason"),
}


def trace_line(event: OperationEvent, operation: Operation) -> str:
    fields: dict[str, lifecycle.Scalar] = {"id": operation.display_id}
    for key in _SHOWN.get(event.name, ()):
        value = event.attributes.get(key)
        if value is not None:
            fields[key] = value
    return f"{event.name:<{TRACE_WIDTH}} " + lifecycle.format_event("", fields).strip()


def clean_up(scratch: ScratchEnvironment) -> None:
    """Remove the run's database and broker names; say so if something stays."""
    for problem in scratch.remove():
        say(f"   ({problem})")
