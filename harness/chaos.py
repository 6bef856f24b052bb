"""``python -m harness.chaos``: many refunds and emails through the whole system while it
is broken.

Two dispatchers and two consumers run as real subprocesses against a database, broker
names and payment sandbox of their own; one daemon of each kind reaches the broker and
the database through TCP proxies. The sandbox sends signed webhooks for what it does to
a callbacks receiver of the run's own, which records them in the run's inbox. The main
process records ``send_refund`` decisions (and every fifth a ``send_email``) at a steady
pace while a fault schedule drawn from the seed kills daemons (one of them while the
provider holds the response of a refund it has just committed), pauses a consumer past
its lease, restarts the broker, closes one daemon's broker connections, ends the
daemons' database sessions, slows, silences and cuts the proxied links, turns provider
faults on for a while (409 conflicts, lookups unavailable, idempotency keys forgotten,
429s with Retry-After), takes the provider down altogether (503 to every call and lookup
for 5 s, a minute or 5 minutes), overloads the machine (CPU hogs at 2x and 4x the cores,
a database link 50-500 ms slow a chunk, a burst of decisions at 3x the measured drain
rate) and disturbs the webhooks (dropped, forged or stale, duplicated and reordered,
delayed); throughout, the sandbox drops responses after committing and fails before
committing. When every operation has settled, a checker reads the event log, the inbox
and the provider's ledger and prints a verdict, with the escalations by reason and the
recovery time after the overload.

The same seed gives the same schedule (the daemons' own timing still varies). Exit
status 0 only if nothing was lost, no decision had two effects, no operation was
retried after an unknown outcome that was never proven absent, every operation's
events follow the state machine, nothing stayed in flight past its lease, nothing was
escalated as undeliverable, at most 1% escalated for a reason no fault forces (an outage
shorter than a tool's outage tolerance forces none), no callback contradicted a recorded
ending, and goodput came back within 30 s of the last overload (harness/checker.py).
Everything is removed at the end, and a broker the run stopped is started again.

``--broker private`` (the default) gives each run a RabbitMQ node of its own (free ports,
its own cookie and data directory, killed and deleted at the end) and aims the broker
faults at it alone, so that runs and sweeps can go on beside other work on the same
machine; ``--broker shared`` uses ``OUTBOX_AMQP_URL`` and ``rabbitmqctl`` on PATH, and
its ``stop_app`` stops that broker for everyone for a few seconds.

Not part of the wheel (it stops brokers and ends database sessions): run it from a
checkout, where the editable install puts the repository root on ``sys.path``. Its
flags, output and exit status are those of the former ``outbox chaos``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from harness.broker_control import BrokerControl, private_broker_control, shared_broker_control
from harness.checker import Verdict, check, longest_outage
from harness.faults import FAULT_CATEGORIES
from harness.parameters import (
    OUTAGE_TOLERANCE_SECONDS,
    PROVIDER_OUTAGE_SECONDS,
    TOOLS_MODULE,
    liveness_bound,
    outage_tolerances,
    tools_without_lookup,
)
from harness.proxy import ThreadedProxy
from harness.rabbit_node import installed as rabbitmq_installed
from harness.rabbit_node import private_broker
from harness.report import report, say, summary
from harness.run import Chaos
from harness.schedule import fault_schedule
from outbox.callbacks import CallbackReceiver
from outbox.cli import add_setting_flags, positive_int, run_parsed
from outbox.errors import ConfigurationError
from outbox.loading import load_registry
from outbox.sandbox.demo import demo_secrets
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.receiver import LocalReceiver
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.webhooks import WebhookTarget
from outbox.settings import Settings, redact_url, split_amqp_urls

PROGRAM = "python -m harness.chaos"
BROKER_MODES = ("private", "shared")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The two flags `outbox` took before a subcommand: every flag of `outbox chaos` stays.
    add_setting_flags(parser, "log_level", "log_format")
    add_setting_flags(parser, "database_url", "amqp_url")
    # Chunked messages meet the same faults: the run's daemons take it as they take
    # every other setting of the run.
    add_setting_flags(parser, "message_operations")
    parser.add_argument(
        "--operations", type=positive_int, default=300, help="decisions to record (300)"
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the fault schedule (7)")
    parser.add_argument(
        "--faults",
        type=_fault_categories,
        default=_fault_categories("all"),
        help=f"all, or a comma-separated subset of {','.join(FAULT_CATEGORIES)} (all)",
    )
    parser.add_argument(
        "--seeds",
        type=seed_range,
        default=None,
        help="a sweep: one run per seed, e.g. 1-20 or 3,5,8 (overrides --seed); exit 0 only "
        "if every run held",
    )
    parser.add_argument(
        "--broker",
        choices=BROKER_MODES,
        default="private",
        help="private: a RabbitMQ node of the run's own, the only one its broker faults touch "
        "(needs rabbitmq-server installed); shared: OUTBOX_AMQP_URL, whose broker the "
        "broker faults stop for everyone (private)",
    )
    parser.add_argument(
        "--provider-outage-seconds",
        type=_positive_seconds,
        default=None,
        help="how long the provider outage lasts (default: drawn per seed from "
        + ", ".join(f"{seconds:g}" for seconds in PROVIDER_OUTAGE_SECONDS)
        + f"; the refund tool waits {OUTAGE_TOLERANCE_SECONDS:g} s before a person is asked)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds to wait after the faults end for every operation to settle (default: "
        "the liveness bound, 2 x (lease + reconcile budget) of the sandbox refund tool)",
    )
    parser.set_defaults(handler=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, then run as ``outbox`` runs its commands: the same settings, logging and
    exit codes (2 for configuration, 1 for anything the runtime refused)."""
    return run_parsed(build_parser().parse_args(argv), PROGRAM)


def seed_range(text: str) -> list[int]:
    seeds: list[int] = []
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            low, high = int(first), int(last if dash else first)
            if high < low:
                raise ValueError(part)
            seeds.extend(range(low, high + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed list: use 1-20, 3,5,8 or a mix (1-5,9)"
        ) from None
    return seeds


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds


def _fault_categories(text: str) -> frozenset[str]:
    names = {part.strip() for part in text.split(",") if part.strip()}
    if names == {"all"}:
        return frozenset(FAULT_CATEGORIES)
    unknown = names - set(FAULT_CATEGORIES)
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown fault categories {sorted(unknown)}; choose all or "
            f"{','.join(FAULT_CATEGORIES)}"
        )
    return frozenset(names)


def _exit_on_terminate(signum: int, frame: object) -> None:
    # A SIGTERM would otherwise end the process without its finally blocks: the broker
    # left stopped, the daemons and the run's database left behind.
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace, settings: Settings) -> int:
    rabbitmqctl = shutil.which("rabbitmqctl")
    categories: frozenset[str] = args.faults
    if args.broker == "private" and not rabbitmq_installed():
        raise ConfigurationError(
            "--broker private starts a RabbitMQ node of its own and needs rabbitmq-server "
            "installed; or use --broker shared"
        )
    if args.broker == "shared" and "broker" in categories and rabbitmqctl is None:
        raise ConfigurationError("broker faults need rabbitmqctl on PATH; or leave out broker")
    # Process-wide, so only once the run goes ahead (a refused one changes nothing).
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    for noisy in ("outbox.sandbox.provider", "outbox.lifecycle", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    seeds: list[int] = args.seeds or [args.seed]
    drain_timeout = args.drain_timeout if args.drain_timeout is not None else liveness_bound()
    summaries: list[str] = []
    held = 0
    for seed in seeds:
        verdict, summary = run_once(
            settings,
            seed,
            args.operations,
            categories,
            args.broker,
            rabbitmqctl,
            drain_timeout,
            outage_seconds=args.provider_outage_seconds,
        )
        held += verdict.held
        summaries.append(f"seed={seed} {summary}")
    if len(seeds) > 1:
        say(f"sweep: {len(seeds)} runs of {args.operations} decisions")
        for line in summaries:
            say(f"  {line}")
        say(f"sweep: {held} of {len(seeds)} held.")
    return 0 if held == len(seeds) else 1


def run_once(
    settings: Settings,
    seed: int,
    operations: int,
    categories: frozenset[str],
    broker: str,
    rabbitmqctl: str | None,
    drain_timeout: float,
    *,
    outage_seconds: float | None = None,
) -> tuple[Verdict, str]:
    """One run; its verdict and a one-line summary."""
    began = time.monotonic()
    # Nothing here runs `outbox migrate --broker`: the daemons declare their names.
    scratch = ScratchEnvironment.unique(settings, "chaos", declare_topology=False)
    schedule = fault_schedule(seed, operations, categories, outage_seconds=outage_seconds)
    say(
        f"outbox chaos: {operations} decisions, seed {seed}, faults {','.join(sorted(categories))}"
        f", broker {broker}, {settings.message_operations} operation(s) per message"
    )
    say(f"database {redact_url(scratch.database_url)}, queue {scratch.topology.queue}")
    say(f"fault schedule ({len(schedule)}):")
    for fault in schedule:
        say(f"  {fault.describe()}")
    provider_faults = (
        Faults(seed=seed, drop_response_probability=0.15, fail_before_commit_probability=0.05)
        if "provider" in categories
        else Faults()
    )
    evidence: Path | None = None
    timings: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        provider = stack.enter_context(SandboxProvider(faults=provider_faults))
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-chaos-"))
        database_link = stack.enter_context(_proxy_to(scratch.database_url, 5432))
        # Before the try: a database that cannot be created (the server unreachable)
        # leaves nothing to remove, and its error is the one to report; and it comes
        # before a private broker's boot, which takes seconds.
        scratch.create()
        # Closed before the database is dropped (in the finally below): no webhook may
        # hold a session of it then.
        callbacks = stack.enter_context(contextlib.ExitStack())
        try:
            # Entered after the database, left after it is removed (the stack unwinds
            # backwards): the queues are deleted while the node still runs.
            broker_control = stack.enter_context(_broker(broker, scratch, rabbitmqctl))
            # A cluster's first node only: the proxied daemons' broker faults go through it.
            broker_link = stack.enter_context(_proxy_to(split_amqp_urls(scratch.amqp_url)[0], 5672))
            _receive_webhooks(callbacks, provider, scratch.database_url)
            chaos = Chaos(
                scratch=scratch,
                provider=provider,
                links={"broker": broker_link, "database": database_link},
                log_dir=Path(log_dir),
                operations=operations,
                schedule=schedule,
                broker_control=broker_control,
                drain_timeout=drain_timeout,
                timings=timings,
            )
            try:
                drain_s = chaos.run()
            finally:
                sessions = chaos.sessions()
                stopping = time.monotonic()
                chaos.stop()
                chaos.timings["stop_daemons"] = time.monotonic() - stopping
            checking = time.monotonic()
            verdict = check(
                scratch.database_url,
                operations,
                provider,
                tools_without_lookup=tools_without_lookup(),
                provider_outage=longest_outage(chaos.outage_spans),
                outage_tolerances=outage_tolerances(),
            )
            if verdict.last_settled_at is not None:
                verdict.settle_s = max(
                    0.0, verdict.last_settled_at.timestamp() - chaos.faults_ended_at
                )
            verdict.recovery_judged = chaos.overload_ended is not None
            verdict.recovery_s = chaos.recovery()
            verdict.quiet_rate = chaos.quiet_rate
            chaos.timings["check"] = time.monotonic() - checking
            if not verdict.held or drain_s is None:
                evidence = _keep_evidence(scratch, Path(log_dir), sessions)
                scratch.keep()
        finally:
            cleaning = time.monotonic()
            callbacks.close()
            for problem in scratch.remove():
                say(f"   ({problem})")
            if evidence is None:
                timings["clean_up"] = time.monotonic() - cleaning
    timings["total"] = time.monotonic() - began
    report(verdict, chaos.tally, drain_s, timings)
    if evidence is not None:
        say(f"evidence kept: the daemons' logs and sessions in {evidence}; the database")
        if broker == "private":
            say(f"  {redact_url(scratch.database_url)} stays until you drop it (the queues")
            say("  went with the run's own broker).")
        else:
            say(f"  {redact_url(scratch.database_url)} and the queues {scratch.topology.queue},")
            say(f"  {scratch.topology.dead_letter_queue} stay until you drop them.")
    return verdict, summary(verdict, timings)


def _receive_webhooks(
    stack: contextlib.ExitStack, provider: SandboxProvider, database_url: str
) -> None:
    """Fresh secrets for the run; a receiver that verifies and records the sandbox's
    webhooks into the run's inbox, as ``outbox callbacks serve`` does; the sandbox
    aimed at it (and stopped sending when ``stack`` closes)."""
    keys = demo_secrets()
    receiver = stack.enter_context(
        LocalReceiver(CallbackReceiver(load_registry([TOOLS_MODULE]), keys), database_url)
    )
    provider.set_webhooks(WebhookTarget(receiver.url, keys))
    stack.callback(provider.set_webhooks, None)


def _keep_evidence(scratch: ScratchEnvironment, log_dir: Path, sessions: list[str]) -> Path:
    """Copy the daemons' logs (and the database sessions seen as the run ended) out of
    the temporary directory; the caller then leaves the database and queues in place."""
    kept = Path(tempfile.mkdtemp(prefix=f"outbox-chaos-evidence-{scratch.tag}-"))
    shutil.copytree(log_dir, kept, dirs_exist_ok=True)
    (kept / "sessions.txt").write_text("\n".join(sessions) + "\n")
    return kept


@contextlib.contextmanager
def _broker(
    mode: str, scratch: ScratchEnvironment, rabbitmqctl: str | None
) -> Iterator[BrokerControl | None]:
    """The run's broker: a node of its own (``scratch`` is pointed at it, and the node is
    killed and deleted when the block ends), or the shared one ``scratch`` names."""
    if mode == "shared":
        yield None if rabbitmqctl is None else shared_broker_control(rabbitmqctl)
        return
    started = time.monotonic()
    with private_broker() as (cluster, node):
        scratch.settings = scratch.settings.model_copy(update={"amqp_url": SecretStr(node.url)})
        say(f"private broker {node.name} on {node.address} ({time.monotonic() - started:.0f} s)")
        yield private_broker_control(cluster, node)


@contextlib.contextmanager
def _proxy_to(url: str, default_port: int) -> Iterator[ThreadedProxy]:
    parts = urlsplit(url)
    with ThreadedProxy(parts.hostname or "127.0.0.1", parts.port or default_port) as proxy:
        yield proxy


if __name__ == "__main__":
    sys.exit(main())
