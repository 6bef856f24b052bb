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
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psycopg
from pydantic import SecretStr

from harness.checker import (
    SETTLED,
    Sample,
    Verdict,
    check,
    longest_outage,
    quiet_rate,
    recovery_seconds,
)
from harness.diagnostics import session_snapshot, terminate_backends
from harness.proxy import ThreadedProxy, url_through
from harness.rabbit_node import ClusterError, Node, RabbitCluster, free_port, private_broker
from harness.rabbit_node import installed as rabbitmq_installed
from outbox import store
from outbox.callbacks import CallbackReceiver
from outbox.cli import add_setting_flags, positive_int, run_parsed
from outbox.decisions import record_decision
from outbox.errors import ConfigurationError, OutboxError
from outbox.loading import load_registry
from outbox.sandbox.demo import demo_secrets
from outbox.sandbox.processes import DaemonProcess, python_module, stop_all
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.receiver import LocalReceiver
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.tools import (
    CALLBACK_WAIT_ENV,
    OUTAGE_TOLERANCE_ENV,
    REFUND_DEADLINE_ENV,
    SANDBOX_URL_ENV,
)
from outbox.sandbox.webhooks import WebhookTarget
from outbox.settings import Settings, redact_url, split_amqp_urls
from outbox.states import OperationState
from outbox.store import Store

TOOLS_MODULE = "outbox.sandbox.tools"
REFUND_DEADLINE_SECONDS = 5.0
# The daemons' database bounds derive from it (outbox/connections.py): half of it is how
# long one of their transactions may take before its connection is cut.
LEASE_MARGIN_SECONDS = 3.0
# A dead-lettered message's operation is queued again this much later; a failed publish
# waits at most this long before the next try. Both far shorter than the defaults, so
# that every decision can settle within the liveness bound after the faults end.
REQUEUE_STALE_AFTER_SECONDS = 10.0
PUBLISH_RETRY_MAX_SECONDS = 2.0
# What a run may take besides its stream and its liveness bound: starting four daemons,
# rabbitmqctl calls, the checker, stopping and removing everything (generous: a busy
# machine runs each of them several times slower).
RUN_OVERHEAD_SECONDS = 120.0
# A consumer paused this long has outlived the lease of anything it held (deadline +
# margin), so another process must take over and the paused one wake up as a zombie.
STOP_SECONDS = REFUND_DEADLINE_SECONDS + LEASE_MARGIN_SECONDS + 1.5
# Decisions arrive over this many seconds per operation, at least MIN_STREAM_SECONDS,
# so the faults land while work is in every state rather than after it all settled.
STREAM_SECONDS_PER_OPERATION = 0.1
MIN_STREAM_SECONDS = 15.0
# One fault every this many seconds of stream, beyond the one of each kind.
FAULT_SPACING_SECONDS = 3.0
# A fault that found nothing to act on (the daemon was between connections, the broker
# already down, no refund in the provider's hands) is tried again this much later, this
# many times, but not past this long after the last decision: with no new work, a
# fault that needs some would wait in vain (a seed once spent 210 s of growing retries
# on a kill-in-effect that could no longer find a refund to hold).
FAULT_RETRY_SECONDS = 1.0
FAULT_RETRIES = 20
FAULT_RETRY_AFTER_STREAM_SECONDS = 10.0
# A fault waiting its turn (the CPU hogs and the broker's CLI calls take turns) waits at
# most this long past that, then is tried as any other.
TURN_SECONDS = 180.0
LOOP_SECONDS = 0.05
MAX_AMOUNT_CENTS = 49_999  # under the sandbox tool's approval threshold (50,000)

# How long each fault that lasts a while lasts.
BROKER_DOWN_SECONDS = 3.0
LINK_FAULT_SECONDS = 5.0
# Longer than the daemons' heartbeat timeout below, so the silent broker is noticed.
LINK_BLACKHOLE_SECONDS = 8.0
LINK_DELAY_PER_CHUNK_SECONDS = 0.05
AMQP_HEARTBEAT_SECONDS = 2
PROVIDER_FAULT_SECONDS = 5.0
PROVIDER_CONFLICT_PROBABILITY = 0.5
# A provider outage (#44): 503 to every call and lookup for one of these, drawn from the
# seed for each run (--provider-outage-seconds fixes it): over before a lease would be,
# long enough for every consumer to meet it, and longer than the refund tool's tolerance.
PROVIDER_OUTAGE_SECONDS = (5.0, 60.0, 300.0)
# The refund tool's outage_tolerance in the run's daemons (OUTBOX_SANDBOX_OUTAGE_TOLERANCE):
# between the minute and the five minutes, so that the one outage must be waited out and
# the other ends with a person (the contract's 15 minutes would make every outage a wait).
OUTAGE_TOLERANCE_SECONDS = 120.0
# A rate limit: 429 to every 2nd call and lookup, each asking for this many seconds.
RATE_LIMIT_EVERY = 2
RATE_LIMIT_RETRY_AFTER_SECONDS = 2
# Keys older than this are forgotten while the fault lasts: longer than any lease here,
# so only a runtime that re-sends long after an effect (a blind retry) pays for it, with
# a second refund at the ledger.
PRUNE_KEYS_OLDER_THAN_SECONDS = 3 * STOP_SECONDS
# Killing a consumer between the provider's commit and the outcome record: the provider
# holds committed refunds' responses this long, and the harness waits this long for one.
HOLD_RESPONSE_MS = 4_000
HOLD_WAIT_SECONDS = 3.0

# The daemons' application and connection names (dispatcher/daemon.py and
# consumer/worker.py); spelled out because the base package never imports the daemons.
APPLICATION_NAMES = {"dispatcher": "outbox-dispatcher", "consumer": "outbox-consumer"}
DAEMONS = ("dispatcher", "dispatcher", "consumer", "consumer")
# Which of each kind reaches the broker and the database through the proxies.
PROXIED_INDEX = 1
LINKS = ("broker", "database")

# Every this-many-th decision is an email (no lookup: its callback settles an unknown
# outcome, or a person); the others refunds.
EMAIL_EVERY = 5
# How long an email's unknown outcome waits for its delivery callback before a person
# gets it: longer than the webhook faults below hold one, well inside the liveness bound.
CALLBACK_WAIT_SECONDS = 15.0
WEBHOOK_DROP_EVERY = 2
WEBHOOK_FORGE_EVERY = 2
WEBHOOK_STALE_EVERY = 3
WEBHOOK_DUPLICATE_EVERY = 2
WEBHOOK_REORDER = 3
WEBHOOK_DELAY_MS = 2_000

# Overload (#22): how long the CPU hogs and the slow database last; the hogs per core
# (slot 0 and 1); the slow database's wait per chunk; the burst.
OVERLOAD_SECONDS = 10.0
CPU_HOGS_PER_CORE = (2, 4)
SLOW_DATABASE_SECONDS = (0.05, 0.5)
BURST_FACTOR = 3.0
# The share of the decisions the steady stream leaves to the bursts (split evenly among
# the schedule's bursts): a burst then always has decisions to record, even one that
# comes after the steady stream has ended.
BURST_SHARE = 0.2
# With overload on, no fault comes in the stream's first seconds: the quiet rate that
# recovery is judged against is measured then.
QUIET_SECONDS = 8.0
# How often the run counts what is recorded and settled (the goodput series).
SAMPLE_SECONDS = 0.5
# How long the run waits for its daemons to say they are healthy before the stream.
READY_SECONDS = 120.0

# How a run injects a fault: False if it found nothing to act on (try again later).
Injector = Callable[["Chaos", "ScheduledFault"], bool]


@dataclass(frozen=True)
class Fault:
    """One kind of fault: the category ``--faults`` enables it by, what it targets given
    its slot (the schedule and the run's lines print it), and how a run injects it.

    ``off_loop``: its calls start a CLI's Erlang VM (rabbitmqctl), which a busy machine
    may take a minute to boot. Such a fault runs on the broker-control thread, so the
    stream's loop keeps recording decisions and ending other faults on time meanwhile (a
    sweep beside fsync-heavy writers once saw one call hold the loop for 61.6 s: an
    overload due to end after 10 s lasted 70, and eight faults then landed at once).

    ``needs_no_work``: what it acts on (a daemon's broker connection) does not depend on
    decisions in flight, so it keeps its tries past the stream's last decision instead of
    giving up :data:`FAULT_RETRY_AFTER_STREAM_SECONDS` after it."""

    category: str
    target: Callable[[int], str]
    inject: Injector
    off_loop: bool = False
    needs_no_work: bool = False


# Every kind of fault, in the order the schedule draws from: each ``Chaos._fault_*``
# method registers itself with ``@fault_kind`` (below), so a kind, its description and its
# handler are written once, side by side. FAULT_CATEGORIES is derived from it.
FAULTS: dict[str, Fault] = {}


def fault_kind(
    kind: str,
    category: str,
    target: Callable[[int], str],
    *,
    off_loop: bool = False,
    needs_no_work: bool = False,
) -> Callable[[Injector], Injector]:
    def register(inject: Injector) -> Injector:
        if kind in FAULTS:
            raise ValueError(f"fault {kind} registered twice")
        FAULTS[kind] = Fault(category, target, inject, off_loop, needs_no_work)
        return inject

    return register


PROGRAM = "python -m harness.chaos"
START_APP_TRIES = 3
BROKER_MODES = ("private", "shared")
# rabbitmqctl: a command's arguments in, its output out (None, with a line, if it failed).
BrokerControl = Callable[..., "str | None"]
T = TypeVar("T")


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


def liveness_bound() -> float:
    """Seconds after the faults end within which every decision must have settled:
    twice the refund tool's lease plus its whole reconcile budget (every lookup at its
    deadline, every backoff at its longest)."""
    from outbox.sandbox.tools import build_registry

    # The daemons run the tool with REFUND_DEADLINE_SECONDS (their environment says so).
    policy = build_registry().get("send_refund", 1).retry
    deadline = REFUND_DEADLINE_SECONDS
    lookups = sum(
        min(
            policy.initial_backoff.total_seconds() * policy.multiplier ** (n - 1),
            policy.max_backoff.total_seconds(),
        )
        * (1 + policy.jitter)
        + deadline
        for n in range(1, policy.reconcile_max_attempts + 1)
    )
    return 2 * (deadline + LEASE_MARGIN_SECONDS + lookups)


def run_deadline(operations: int, outage_seconds: float = max(PROVIDER_OUTAGE_SECONDS)) -> float:
    """The longest one run of ``operations`` decisions may take, start to exit: what a
    caller (a test, a CI job) waits before it stops the run with SIGTERM. A provider
    outage of ``outage_seconds`` (the longest the schedule draws) may begin as the
    stream ends, and the liveness bound counts from its end."""
    return stream_seconds(operations) + outage_seconds + liveness_bound() + RUN_OVERHEAD_SECONDS


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


# --- the schedule ---------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledFault:
    at: float  # seconds after the first decision
    kind: str
    slot: int  # which of the two daemons of the kind the fault targets
    seconds: float | None = None  # how long it lasts, where the schedule draws that

    def describe(self) -> str:
        return f"t=+{self.at:5.1f}s {self.kind:<24} {self.target()}"

    def target(self) -> str:
        what = FAULTS[self.kind].target(self.slot)
        return what if self.seconds is None else f"{what} for {self.seconds:g} s"


def stream_seconds(operations: int) -> float:
    return max(MIN_STREAM_SECONDS, operations * STREAM_SECONDS_PER_OPERATION)


# Once a run, never among the extra faults: an outage's length is the point of it, and a
# second one would only add minutes to the run.
ONCE_A_RUN = frozenset({"provider_outage"})


def fault_schedule(
    seed: int,
    operations: int,
    categories: frozenset[str],
    *,
    outage_seconds: float | None = None,
) -> list[ScheduledFault]:
    """The faults, in time order: at least one of every enabled kind whatever the seed,
    then more of random kinds as the stream gets longer. Only ``seed`` and the
    arguments decide it, so a run can be repeated. A provider outage lasts one of
    :data:`PROVIDER_OUTAGE_SECONDS`, drawn from the seed, or ``outage_seconds``."""
    # Not for security: a reproducible schedule is the point of the seed.
    rng = random.Random(seed)  # noqa: S311
    kinds = [kind for category in sorted(categories) for kind in FAULT_CATEGORIES[category]]
    if not kinds:
        return []
    duration = stream_seconds(operations)
    extra = max(0, int(duration // FAULT_SPACING_SECONDS) - len(kinds))
    repeatable = [kind for kind in kinds if kind not in ONCE_A_RUN]
    chosen = kinds + [rng.choice(repeatable) for _ in range(extra) if repeatable]
    rng.shuffle(chosen)
    _outage_after_the_kills_in_effect(chosen)
    # Recovery from overload is judged against the quiet rate: measured first.
    first = QUIET_SECONDS if "overload" in categories else 1.0
    times = sorted(rng.uniform(first, duration) for _ in chosen)
    schedule = []
    for at, kind in zip(times, chosen, strict=True):
        seconds = None
        if kind == "broker_connection_close":
            # any of the four daemons; the others one of two of a kind
            slot = rng.randrange(len(DAEMONS))
        elif kind == "provider_outage":
            slot = rng.randrange(len(PROVIDER_OUTAGE_SECONDS))
            seconds = PROVIDER_OUTAGE_SECONDS[slot] if outage_seconds is None else outage_seconds
        else:
            slot = rng.randrange(2)
        schedule.append(ScheduledFault(round(at, 1), kind, slot, seconds))
    return schedule


def _outage_after_the_kills_in_effect(chosen: list[str]) -> None:
    """Move the outage behind every kill in effect (``chosen`` is in time order): no
    refund is in the provider's hands while it is down, and after a long one nothing may
    be left to hold, so a kill due during it would find nothing at all."""
    if "provider_outage" not in chosen:
        return
    outage = chosen.index("provider_outage")
    kills = [n for n, kind in enumerate(chosen) if kind == "consumer_kill_in_effect"]
    if kills and kills[-1] > outage:
        chosen[outage], chosen[kills[-1]] = chosen[kills[-1]], chosen[outage]


def decision(n: int) -> tuple[str, dict[str, Any]]:
    """The n-th decision of the stream: every EMAIL_EVERY-th an email, the rest refunds."""
    if n % EMAIL_EVERY == EMAIL_EVERY - 1:
        return "send_email", {
            "to": f"customer{n}@example.com",
            "subject": f"About your order {n}",
            "body": "Your refund is on its way.",
        }
    return "send_refund", {
        "payment_id": f"pay_chaos_{n}",
        "amount_cents": 100 + (n * 7919) % (MAX_AMOUNT_CENTS - 100),
    }


# --- the daemons ----------------------------------------------------------------------


@dataclass
class Daemon:
    """One of the four daemons, through its restarts: each start is a new process, with
    a log file of its own."""

    kind: str
    index: int
    environment: dict[str, str]
    log_dir: Path
    metrics_port: int | None = None
    process: DaemonProcess | None = None
    generation: int = 0
    stopped_until: float | None = None

    def healthy(self) -> bool:
        """Whether its /healthz answers 200 (its sessions are up)."""
        if self.metrics_port is None or self.process is None or not self.process.running():
            return False
        url = f"http://127.0.0.1:{self.metrics_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def name(self) -> str:
        return f"{self.kind}#{self.index}"

    def start(self) -> None:
        self.generation += 1
        self.process = DaemonProcess(
            python_module(self.kind),
            environment=self.environment,
            log=self.log_dir / f"{self.kind}{self.index}.{self.generation}.log",
            name=self.name,
        )
        self.stopped_until = None

    @property
    def current(self) -> DaemonProcess:
        assert self.process is not None, f"{self.name} was never started"
        return self.process

    @property
    def pid(self) -> int:
        return self.current.pid

    def kill_and_restart(self) -> None:
        self.current.kill()
        self.start()

    def pause(self, until: float) -> None:
        self.current.signal(signal.SIGSTOP)
        self.stopped_until = until

    def resume_if_due(self, now: float) -> bool:
        """Wake a paused daemon whose pause is over; True if it did."""
        if self.stopped_until is not None and now >= self.stopped_until:
            self.current.signal(signal.SIGCONT)
            self.stopped_until = None
            return True
        return False

    def exited_unplanned(self) -> bool:
        return self.process is not None and not self.process.running()


# --- the run --------------------------------------------------------------------------


@dataclass
class Tally:
    dispatcher_kills: int = 0
    consumer_kills: int = 0  # every SIGKILL of a consumer, the in-effect ones included
    consumer_kills_in_effect: int = 0
    consumer_stops: int = 0
    broker_restarts: int = 0
    broker_connection_closes: int = 0
    db_connection_kills: int = 0
    link_delays: int = 0
    link_blackholes: int = 0
    link_cuts: int = 0
    provider_conflict_windows: int = 0
    lookup_outages: int = 0
    key_prunings: int = 0
    provider_outages: int = 0
    rate_limit_windows: int = 0
    cpu_starvations: int = 0
    slow_databases: int = 0
    decision_bursts: int = 0
    webhook_drop_windows: int = 0
    webhook_forge_windows: int = 0
    webhook_duplicate_windows: int = 0
    webhook_delay_windows: int = 0
    unplanned_exits: int = 0
    faults_that_found_nothing: int = 0


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
    summary = (
        f"decisions={verdict.decisions} effects={verdict.effects} rejected={verdict.rejected} "
        f"escalated={verdict.escalated} lost={verdict.lost} "
        f"duplicate_effects={verdict.duplicate_effects} blind_retries={verdict.blind_retries} "
        f"illegal_sequences={verdict.illegal_sequences} contradictions={verdict.contradictions} "
        f"escalated_share={verdict.escalated_share:.1%} "
        f"recovery_s={_recovery(verdict)} settle_s={_seconds(verdict.settle_s)} "
        f"longest_outage_s={verdict.provider_outage_s:.0f} "
        f"total_s={timings['total']:.0f} "
        f"escalated_by_reason={_reasons(verdict) or '-'} "
        + ("guarantee held." if verdict.held else "GUARANTEE BROKEN.")
    )
    return verdict, summary


def _reasons(verdict: Verdict) -> str:
    return ",".join(f"{r}={n}" for r, n in sorted(verdict.escalation_reasons.items()))


def _recovery(verdict: Verdict) -> str:
    if not verdict.recovery_judged:
        return "-"
    return "never" if verdict.recovery_s is None else f"{verdict.recovery_s:.1f}"


def outage_tolerances() -> dict[str, timedelta]:
    """How long each sandbox tool waits for its provider in the run's daemons: their
    contracts' own, but the refund tool's as the run sets it."""
    tolerances = {
        contract.name: contract.outage_tolerance for contract in load_registry([TOOLS_MODULE])
    }
    tolerances["send_refund"] = timedelta(seconds=OUTAGE_TOLERANCE_SECONDS)
    return tolerances


def tools_without_lookup() -> frozenset[str]:
    """The sandbox's writes that no lookup can find (their effects are emails)."""
    registry = load_registry([TOOLS_MODULE])
    return frozenset(
        name for name in ("send_refund", "send_email") if registry.get(name, 1).reconcile is None
    )


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


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _keep_evidence(scratch: ScratchEnvironment, log_dir: Path, sessions: list[str]) -> Path:
    """Copy the daemons' logs (and the database sessions seen as the run ended) out of
    the temporary directory; the caller then leaves the database and queues in place."""
    kept = Path(tempfile.mkdtemp(prefix=f"outbox-chaos-evidence-{scratch.tag}-"))
    shutil.copytree(log_dir, kept, dirs_exist_ok=True)
    (kept / "sessions.txt").write_text("\n".join(sessions) + "\n")
    return kept


def report(
    verdict: Verdict, tally: Tally, drain_s: float | None, timings: dict[str, float]
) -> None:
    say(
        f"decisions={verdict.decisions} effects={verdict.effects} rejected={verdict.rejected} "
        f"escalated={verdict.escalated} lost={verdict.lost} "
        f"duplicate_effects={verdict.duplicate_effects}"
    )
    say(
        f"duplicate_deliveries_suppressed={verdict.duplicate_deliveries_suppressed} "
        f"outcome_unknown_opened={verdict.outcome_unknown_opened} "
        f"reconciled={verdict.reconciled} blind_retries={verdict.blind_retries}"
    )
    say(
        f"dispatcher_kills={tally.dispatcher_kills} consumer_kills={tally.consumer_kills} "
        f"broker_restarts={tally.broker_restarts} "
        f"db_connection_kills={tally.db_connection_kills} "
        f"drain_s={'timeout' if drain_s is None else f'{drain_s:.1f}'} "
        f"settle_s={_seconds(verdict.settle_s)}"
    )
    say(
        f"consumer_kills_in_effect={tally.consumer_kills_in_effect} "
        f"consumer_stops={tally.consumer_stops} "
        f"broker_connection_closes={tally.broker_connection_closes} "
        f"link_delays={tally.link_delays} link_blackholes={tally.link_blackholes} "
        f"link_cuts={tally.link_cuts} "
        f"provider_conflict_windows={tally.provider_conflict_windows} "
        f"lookup_outages={tally.lookup_outages} key_prunings={tally.key_prunings} "
        f"provider_outages={tally.provider_outages} "
        f"rate_limit_windows={tally.rate_limit_windows} "
        f"longest_outage_s={verdict.provider_outage_s:.1f} "
        f"outage_tolerance_s={OUTAGE_TOLERANCE_SECONDS:g}"
    )
    say(
        f"illegal_sequences={verdict.illegal_sequences} "
        f"in_flight_past_lease={verdict.in_flight_past_lease} "
        f"committed_without_one_refund={verdict.committed_without_one_refund} "
        f"refunds_without_an_effect_state={verdict.refunds_without_an_effect_state} "
        f"unplanned_exits={tally.unplanned_exits} "
        f"faults_that_found_nothing={tally.faults_that_found_nothing}"
    )
    say(
        f"cpu_starvations={tally.cpu_starvations} slow_databases={tally.slow_databases} "
        f"decision_bursts={tally.decision_bursts} "
        f"webhook_drop_windows={tally.webhook_drop_windows} "
        f"webhook_forge_windows={tally.webhook_forge_windows} "
        f"webhook_duplicate_windows={tally.webhook_duplicate_windows} "
        f"webhook_delay_windows={tally.webhook_delay_windows}"
    )
    say(
        f"contradictions={verdict.contradictions} "
        f"settled_by_callback={verdict.settled_by_callback} "
        f"retried_by_callback={verdict.retried_by_callback} "
        f"callbacks_unapplied={verdict.callbacks_unapplied} "
        f"callbacks_unmatched={verdict.callbacks_unmatched} "
        f"committed_without_one_email={verdict.committed_without_one_email} "
        f"emails_without_an_effect_state={verdict.emails_without_an_effect_state}"
    )
    quiet = "-" if verdict.quiet_rate is None else f"{verdict.quiet_rate:.1f}"
    say(
        f"undeliverable={verdict.undeliverable} "
        f"escalations_excused={verdict.escalations_excused} "
        f"escalated_share={verdict.escalated_share:.1%} "
        f"quiet_rate={quiet} recovery_s={_recovery(verdict)}"
    )
    say("timings: " + " ".join(f"{phase}_s={seconds:.1f}" for phase, seconds in timings.items()))
    say(f"escalated by reason: {', '.join(_reasons(verdict).split(',')) or 'none'}")
    for example in verdict.examples[:10]:
        say(f"  {example}")
    say("guarantee held." if verdict.held else "GUARANTEE BROKEN.")


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


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Chaos:
    scratch: ScratchEnvironment
    provider: SandboxProvider
    links: dict[str, ThreadedProxy]
    log_dir: Path
    operations: int
    schedule: list[ScheduledFault]
    broker_control: BrokerControl | None
    drain_timeout: float
    tally: Tally = field(default_factory=Tally)
    daemons: list[Daemon] = field(default_factory=list)
    # Where a run's wall time goes, by phase (the faults' own calls, rabbitmqctl above
    # all, count apart from the stream they interrupt).
    timings: dict[str, float] = field(default_factory=dict)
    # When the last fault ended: wall clock (to compare with the event log) and monotonic.
    faults_ended_at: float = field(default_factory=time.time)
    faults_ended_monotonic: float = field(default_factory=time.monotonic)
    # Faults that last a while, by kind: when each ends, what ends it, and whether
    # that runs off the loop (a broker's start_app, an Erlang VM of its own).
    endings: dict[str, tuple[float, Callable[[], None], bool]] = field(default_factory=dict)
    # The broker faults' CLI calls, on a thread of their own (Fault.off_loop).
    off_loop: OffLoop = field(default_factory=lambda: OffLoop())
    # Faults due and not yet applied, how often each was tried, and until when the
    # stream's faults are retried (seconds into the stream, from stream_start).
    pending: list[ScheduledFault] = field(default_factory=list)
    retries: Counter[ScheduledFault] = field(default_factory=Counter)
    retry_until: float = 0.0
    stream_start: float = 0.0
    # The goodput series (every SAMPLE_SECONDS), the quiet rate measured from it when the
    # first fault came (with the backlog of the quiet phase), and when the last
    # overload ended (monotonic; None if none ran).
    samples: list[Sample] = field(default_factory=list)
    quiet_rate: float | None = None
    quiet_rate_measured: bool = False
    quiet_backlog: int = 0
    overload_ended: float | None = None
    # A burst under way (since when, at how many decisions a second, and how many the
    # bursts had recorded before it); each burst's size; how many decisions the
    # bursts have recorded (or handed back to the stream, if one never came).
    burst: tuple[float, float, int] | None = None
    burst_size: int = 0
    burst_recorded: int = 0
    # Decisions recorded so far, and the rate the stream offers them at.
    recorded: int = 0
    rate: float = 0.0
    hogs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    sampler: Sampler | None = None
    # When the provider, or its lookups, were down (monotonic start and end, each window
    # once it is over), and when the last whole outage ended.
    outage_spans: list[tuple[float, float]] = field(default_factory=list)
    provider_back: float | None = None

    @property
    def database_url(self) -> str:
        return self.scratch.database_url

    def environment(self, proxied: bool, metrics_port: int) -> dict[str, str]:
        database_url, amqp_url = self.database_url, self.scratch.amqp_url
        if proxied:
            database_url = url_through(database_url, self.links["database"].port)
            amqp_url = url_through(split_amqp_urls(amqp_url)[0], self.links["broker"].port)
        daemon_settings = self.scratch.settings.model_copy(
            update={
                "database_url": SecretStr(database_url),
                "amqp_url": SecretStr(amqp_url),
                "amqp_heartbeat": AMQP_HEARTBEAT_SECONDS,
                "tools": TOOLS_MODULE,
                # Nothing here runs `outbox migrate --broker`: the daemons declare their names.
                "declare_topology": True,
                "lease_margin": LEASE_MARGIN_SECONDS,
                "requeue_stale_after": timedelta(seconds=REQUEUE_STALE_AFTER_SECONDS),
                "publish_retry_max": PUBLISH_RETRY_MAX_SECONDS,
                "poll_interval": 0.2,
                "reconcile_interval": 0.2,
                "metrics_host": "127.0.0.1",
                # A port of its own, kept through restarts: the run asks /healthz.
                "metrics_port": metrics_port,
                "log_level": "WARNING",
            }
        )
        return {
            **os.environ,
            **daemon_settings.to_environment(),
            SANDBOX_URL_ENV: self.provider.url,
            REFUND_DEADLINE_ENV: f"{REFUND_DEADLINE_SECONDS:g}",
            CALLBACK_WAIT_ENV: f"{CALLBACK_WAIT_SECONDS:g}",
            OUTAGE_TOLERANCE_ENV: f"{OUTAGE_TOLERANCE_SECONDS:g}",
        }

    def run(self) -> float | None:
        """Stream the decisions and the faults, then wait for every operation to settle;
        the seconds that took after the stream ended, None past the drain deadline."""
        starting = time.monotonic()
        counts: Counter[str] = Counter()
        for kind in DAEMONS:
            index = counts[kind]
            counts[kind] += 1
            port = free_port()
            environment = self.environment(index == PROXIED_INDEX, port)
            daemon = Daemon(kind, index, environment, self.log_dir, metrics_port=port)
            daemon.start()
            self.daemons.append(daemon)
        registry = load_registry([TOOLS_MODULE])
        self._await_ready(time.monotonic() + READY_SECONDS)
        self.timings["start_daemons"] = time.monotonic() - starting
        self.timings["faults"] = 0.0
        self.timings["broker_calls"] = 0.0
        self.pending = list(self.schedule)
        rate = self.operations / stream_seconds(self.operations)
        self.retry_until = stream_seconds(self.operations) + FAULT_RETRY_AFTER_STREAM_SECONDS
        recorded = 0
        start = self.stream_start = time.monotonic()
        self.rate = rate
        bursts = sum(fault.kind == "decision_burst" for fault in self.schedule)
        self.burst_size = int(self.operations * BURST_SHARE / bursts) if bursts else 0
        steady = self.operations - bursts * self.burst_size
        self.sampler = Sampler(self.database_url, self._sample)
        self.sampler.start()
        with psycopg.connect(self.database_url) as connection:
            while recorded < self.operations or self.pending or self._faults_last():
                now = time.monotonic()
                elapsed = now - start
                self._advance_burst(now)
                paced = min(steady, int(elapsed * rate) + 1)
                due = min(self.operations, paced + self.burst_recorded)
                for n in range(recorded, due):
                    tool, tool_input = decision(n)
                    record_decision(
                        connection,
                        registry,
                        tool,
                        tool_input,
                        run_id="chaos",
                        decision_key=f"call_{n}",
                    )
                connection.commit()
                recorded = max(recorded, due)
                self.recorded = recorded
                while self.pending and self.pending[0].at <= elapsed:
                    fault = self.pending.pop(0)
                    self._measure_quiet_rate()
                    if self._waits_its_turn(fault) and elapsed < self.retry_until + TURN_SECONDS:
                        self._postpone(fault, elapsed)
                        continue
                    self._inject(fault, elapsed)
                self._tend(time.monotonic())
                # Pacing the schedule, not waiting for a condition.
                time.sleep(LOOP_SECONDS)
        stream_end = time.monotonic()
        self.timings["stream"] = stream_end - start
        # Liveness: every decision settles within the bound after the last fault ended
        # (or after the last decision, when the stream outlasted the faults).
        deadline = max(self.faults_ended_monotonic, stream_end) + self.drain_timeout
        try:
            while time.monotonic() < deadline:
                self._tend(time.monotonic())
                if self._settled():
                    return time.monotonic() - stream_end
                time.sleep(LOOP_SECONDS * 4)  # polling the database, with the deadline above
            return None
        finally:
            self.timings["drain"] = time.monotonic() - stream_end
            self.sampler.stop()
            self.sampler = None
            # The last word on the series: what was settled when the run ended.
            with psycopg.connect(self.database_url) as connection:
                self._sample(connection, time.monotonic())

    def _await_ready(self, deadline: float) -> None:
        """Before the first decision, until every daemon says it is healthy (its sessions
        held) or ``deadline``: as a deployment runs, and so the quiet phase measures a
        running system. Beside a sweep's hogs and fsync writers the daemons took over 10
        s to start, so the stream met no consumer, its quiet phase answered almost
        nothing, and recovery was judged against the offered rate instead."""
        waiting = list(self.daemons)
        while waiting and time.monotonic() < deadline:
            waiting = [daemon for daemon in waiting if not daemon.healthy()]
            if waiting:
                time.sleep(LOOP_SECONDS * 4)  # polling /healthz, with the deadline above
        if waiting:
            names = ", ".join(daemon.name for daemon in waiting)
            say(f"  ! not healthy after {READY_SECONDS:g} s: {names}; the stream starts anyway")

    def _fault_over(self) -> None:
        self.faults_ended_at = time.time()
        self.faults_ended_monotonic = time.monotonic()

    def _overload_over(self) -> None:
        self.overload_ended = time.monotonic()

    # --- the goodput series ---------------------------------------------------------

    def _sample(self, connection: psycopg.Connection[Any], now: float) -> None:
        """Count what is settled (on the sampler's thread, and once at the end)."""
        counts = Store(connection).run(store.operations_by_state())
        connection.commit()
        goodput = counts[OperationState.COMMITTED] + counts[OperationState.REJECTED]
        settled = goodput + counts[OperationState.ESCALATED]
        waiting = counts[OperationState.OUTCOME_UNKNOWN]
        self.samples.append(Sample(now, self.recorded, goodput, settled, waiting))

    def _measure_quiet_rate(self) -> None:
        """When the first fault comes: the goodput of the quiet phase before it (or, if
        that saw too few answers, the rate decisions were offered at), and its backlog."""
        if self.quiet_rate_measured:
            return
        self.quiet_rate_measured = True
        now = time.monotonic()
        measured = quiet_rate(self.samples, now)
        self.quiet_rate = measured if measured is not None else self.rate
        self.quiet_backlog = max((sample.backlog for sample in self.samples), default=0)
        source = "goodput" if measured is not None else "offered, too few answers"
        say(f"  quiet rate {self.quiet_rate:.1f}/s ({source}), backlog {self.quiet_backlog}")

    def recovery(self) -> float | None:
        """Seconds from the last overload's end until goodput was back (None: never);
        from the provider's return, if it was down later than that: while it is down,
        refunds wait for it by design, and no speed of the runtime answers them."""
        if self.overload_ended is None or self.quiet_rate is None:
            return None
        since = max(self.overload_ended, self.provider_back or self.overload_ended)
        return recovery_seconds(self.samples, since, self.quiet_rate, self.quiet_backlog)

    def _advance_burst(self, now: float) -> None:
        """During a burst, its decisions come at its rate, on top of the stream's."""
        if self.burst is None:
            return
        since, burst_rate, before = self.burst
        self.burst_recorded = before + min(self.burst_size, int(burst_rate * (now - since)))

    def _faults_last(self) -> bool:
        return (
            bool(self.endings)
            or self.off_loop.busy()
            or any(d.stopped_until is not None for d in self.daemons)
        )

    def _tend(self, now: float) -> None:
        """Take what the broker-control thread finished; end faults that are due to end;
        wake paused consumers when due; restart a daemon that died on its own (and count
        it: the schedule never kills without saying so)."""
        self.off_loop.run_finished()
        if "provider_outage" in self.endings:
            # Refunds wait for the provider and go on when it is back: a fault that needs
            # work in flight keeps its tries until a while after that.
            self.retry_until = max(
                self.retry_until, now - self.stream_start + FAULT_RETRY_AFTER_STREAM_SECONDS
            )
        for kind, (ends_at, end, off_loop) in list(self.endings.items()):
            if now >= ends_at:
                del self.endings[kind]
                if off_loop:
                    # Over when the call returns: a broker still stopped is still a fault.
                    self.off_loop.submit(end, lambda _: self._fault_over())
                else:
                    end()
                    self._fault_over()
        for daemon in self.daemons:
            if daemon.resume_if_due(now):
                self._fault_over()
            if daemon.exited_unplanned():
                self.tally.unplanned_exits += 1
                say(f"  ! {daemon.name} exited on its own; restarting. Its last lines:")
                say(daemon.current.tail())
                daemon.start()

    def _lasting(
        self, kind: str, seconds: float, end: Callable[[], None], *, off_loop: bool = False
    ) -> bool:
        """Register how a fault that lasts ends; False if one of its kind still lasts."""
        if kind in self.endings:
            return False
        self.endings[kind] = (time.monotonic() + seconds, end, off_loop)
        return True

    def _of_kind(self, kind: str) -> list[Daemon]:
        return [daemon for daemon in self.daemons if daemon.kind == kind]

    def _inject(self, fault: ScheduledFault, elapsed: float) -> None:
        """Apply one fault, here or (its calls slow to start) on the broker-control
        thread; one that found nothing to act on is tried again later."""
        entry = FAULTS[fault.kind]
        if entry.off_loop:

            def call() -> bool:
                began = time.monotonic()
                try:
                    return entry.inject(self, fault)
                finally:
                    self.timings["broker_calls"] += time.monotonic() - began

            self.off_loop.submit(call, lambda acted: self._injected(fault, elapsed, acted))
            return
        began = time.monotonic()
        acted = entry.inject(self, fault)
        self.timings["faults"] += time.monotonic() - began
        self._injected(fault, elapsed, acted)

    def _waits_its_turn(self, fault: ScheduledFault) -> bool:
        """Whether a fault that takes turns with another must wait for it: the CPU hogs
        and the broker's CLI calls, whose Erlang VM would starve beside them (and a
        start_app left starving leaves the broker stopped). Waiting is not a try: the
        broker's calls take up to two minutes beside fsync writers, and counted as
        tries they made the CPU hogs give up in 12 of 18 runs of a sweep."""
        if fault.kind == "cpu_starvation":
            return "broker_restart" in self.endings or self.off_loop.busy()
        if fault.kind == "consumer_kill_in_effect" and "provider_outage" in self.endings:
            return True  # the provider holds no refund while it is down
        if fault.kind == "broker_connection_close" and "broker_restart" in self.endings:
            # Nothing to close until the broker is back (beside hogs, start_app came
            # 19 s late once, and the close's tries ran out meanwhile).
            return True
        if FAULTS[fault.kind].off_loop:
            return bool(self.hogs)
        return False

    def _postpone(self, fault: ScheduledFault, elapsed: float) -> None:
        later = ScheduledFault(round(elapsed + FAULT_RETRY_SECONDS, 1), fault.kind, fault.slot)
        self.retries[later] = self.retries[fault]
        self.pending.append(later)
        self.pending.sort(key=lambda f: f.at)

    def _injected(self, fault: ScheduledFault, due: float, acted: bool) -> None:
        """On the stream's loop, once a fault was applied (or found nothing to act on)."""
        elapsed = time.monotonic() - self.stream_start
        if acted:
            late = f" (due at +{due:.1f}s)" if elapsed - due >= 1.0 else ""
            say(f"  at +{elapsed:5.1f}s {fault.kind:<24} {fault.target()}{late}")
            self._fault_over()  # a lasting fault's end moves this again
            return
        past_stream = elapsed >= self.retry_until and not FAULTS[fault.kind].needs_no_work
        if self.retries[fault] >= FAULT_RETRIES or past_stream:
            say(f"  ! {fault.kind} found nothing to act on; given up")
            self.tally.faults_that_found_nothing += 1
            if fault.kind == "decision_burst":
                # Its decisions still belong to the run: recorded at once.
                self.burst_recorded += self.burst_size
            return
        self.retries[fault] += 1
        self._postpone(fault, elapsed)

    # --- the faults, one method each, registered in FAULTS by @fault_kind ------------

    @fault_kind(
        "dispatcher_kill",
        "process",
        lambda slot: f"dispatcher#{slot}",
    )
    def _fault_dispatcher_kill(self, fault: ScheduledFault) -> bool:
        self._of_kind("dispatcher")[fault.slot].kill_and_restart()
        self.tally.dispatcher_kills += 1
        return True

    @fault_kind(
        "consumer_kill",
        "process",
        lambda slot: f"consumer#{slot}",
    )
    def _fault_consumer_kill(self, fault: ScheduledFault) -> bool:
        self._of_kind("consumer")[fault.slot].kill_and_restart()
        self.tally.consumer_kills += 1
        return True

    @fault_kind(
        "consumer_kill_in_effect",
        "process",
        lambda slot: "the consumer whose refund the provider holds",
    )
    def _fault_consumer_kill_in_effect(self, fault: ScheduledFault) -> bool:
        """SIGKILL the consumer whose refund the provider has committed but not answered:
        the effect exists, its outcome record never will."""
        if "lookups_unavailable" in self.endings or "provider_outage" in self.endings:
            return False  # keep the provider's faults apart: one window at a time
        self.provider.set_faults(delay_ms=HOLD_RESPONSE_MS)
        try:
            victim = self._holder_of_a_committed_refund(time.monotonic() + HOLD_WAIT_SECONDS)
            if victim is None:
                return False
            victim.kill_and_restart()
        finally:
            self.provider.set_faults(delay_ms=0)  # releases the held responses
        self.tally.consumer_kills += 1
        self.tally.consumer_kills_in_effect += 1
        return True

    def _holder_of_a_committed_refund(self, deadline: float) -> Daemon | None:
        consumers = {daemon.pid: daemon for daemon in self._of_kind("consumer")}
        with psycopg.connect(self.database_url) as connection:
            runner = Store(connection)
            while time.monotonic() < deadline:
                for key in self.provider.executing_keys():
                    try:
                        operation = runner.run(store.find_operation(uuid.UUID(key)))
                    except ValueError:
                        continue
                    owner = operation.lease_owner if operation is not None else None
                    # lease owner: host:pid:instance (consumer/worker.py)
                    pid = owner.split(":")[-2] if owner and owner.count(":") >= 2 else ""
                    if pid.isdigit() and int(pid) in consumers:
                        return consumers[int(pid)]
                time.sleep(LOOP_SECONDS / 2)  # polling the provider, with the deadline above
        return None

    @fault_kind(
        "consumer_stop",
        "process",
        lambda slot: f"consumer#{slot} for {STOP_SECONDS:g} s",
    )
    def _fault_consumer_stop(self, fault: ScheduledFault) -> bool:
        consumers = self._of_kind("consumer")
        # Never both at once: the point is a zombie waking beside a live worker.
        if any(c.stopped_until is not None for c in consumers):
            return False
        consumers[fault.slot].pause(time.monotonic() + STOP_SECONDS)
        self.tally.consumer_stops += 1
        return True

    @fault_kind(
        "broker_connection_close",
        "broker",
        lambda slot: f"{DAEMONS[slot]}#{slot % 2}",
        off_loop=True,
        needs_no_work=True,
    )
    def _fault_broker_connection_close(self, fault: ScheduledFault) -> bool:
        if "broker_restart" in self.endings:
            return False  # nothing to close while the broker is down
        if self.hogs:
            return False  # rabbitmqctl's own VM starves beside the hogs: after them
        closed = self._close_broker_connections(self.daemons[fault.slot])
        self.tally.broker_connection_closes += closed
        return closed > 0

    @fault_kind(
        "broker_restart",
        "broker",
        lambda slot: f"stop_app, start_app {BROKER_DOWN_SECONDS:g} s later",
        off_loop=True,
    )
    def _fault_broker_restart(self, fault: ScheduledFault) -> bool:
        control = self.broker_control
        assert control is not None
        if "broker_restart" in self.endings:
            return False
        if self.hogs:
            # Its start_app (an Erlang VM of its own) would starve beside the hogs and
            # leave the broker stopped: the two faults take turns.
            return False
        if control("stop_app") is None:
            return False
        self._lasting(
            "broker_restart", BROKER_DOWN_SECONDS, lambda: _start_app(control), off_loop=True
        )
        self.tally.broker_restarts += 1
        return True

    @fault_kind(
        "db_connection_kill",
        "database",
        lambda slot: "every daemon's sessions",
    )
    def _fault_db_connection_kill(self, fault: ScheduledFault) -> bool:
        with psycopg.connect(self.database_url, autocommit=True) as connection:
            ended = terminate_backends(connection, list(APPLICATION_NAMES.values()))
        self.tally.db_connection_kills += ended
        return ended > 0

    @fault_kind(
        "link_delay",
        "network",
        lambda slot: (
            f"{LINKS[slot % 2]} link +{LINK_DELAY_PER_CHUNK_SECONDS * 1000:g} ms a chunk "
            f"for {LINK_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_link_delay(self, fault: ScheduledFault) -> bool:
        if not self._link_fault(
            fault, LINK_FAULT_SECONDS, lambda link: link.delay(LINK_DELAY_PER_CHUNK_SECONDS)
        ):
            return False
        self.tally.link_delays += 1
        return True

    @fault_kind(
        "link_blackhole",
        "network",
        lambda slot: f"{LINKS[slot % 2]} link silent for {LINK_BLACKHOLE_SECONDS:g} s",
    )
    def _fault_link_blackhole(self, fault: ScheduledFault) -> bool:
        if not self._link_fault(fault, LINK_BLACKHOLE_SECONDS, ThreadedProxy.blackhole):
            return False
        self.tally.link_blackholes += 1
        return True

    def _link_fault(
        self, fault: ScheduledFault, seconds: float, start: Callable[[ThreadedProxy], None]
    ) -> bool:
        """Slow or silence one link for a while; one such fault per link at a time."""
        link = self.links[LINKS[fault.slot % 2]]
        if not self._lasting(f"link_{fault.slot % 2}", seconds, link.restore):
            return False
        start(link)
        return True

    @fault_kind(
        "link_cut",
        "network",
        lambda slot: f"{LINKS[slot % 2]} link reset",
    )
    def _fault_link_cut(self, fault: ScheduledFault) -> bool:
        cut = self.links[LINKS[fault.slot % 2]].cut()
        self.tally.link_cuts += cut > 0
        return cut > 0

    # provider windows: besides these the sandbox drops responses and fails before
    # committing throughout the run

    @fault_kind(
        "provider_conflicts",
        "provider",
        lambda slot: (
            f"409 to {PROVIDER_CONFLICT_PROBABILITY:.0%} of refunds "
            f"for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_provider_conflicts(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "provider_conflicts",
            {"conflict_probability": PROVIDER_CONFLICT_PROBABILITY},
            "provider_conflict_windows",
        )

    @fault_kind(
        "lookups_unavailable",
        "provider",
        lambda slot: f"503 to lookups for {PROVIDER_FAULT_SECONDS:g} s",
    )
    def _fault_lookups_unavailable(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "lookups_unavailable", {"lookups_unavailable": True}, "lookup_outages", outage=True
        )

    @fault_kind(
        "provider_outage",
        "provider",
        lambda slot: "503 to every call and lookup",
    )
    def _fault_provider_outage(self, fault: ScheduledFault) -> bool:
        """The provider down (#44): every refund, email and lookup answered 503 and
        nothing done. Refunds must wait for it, spending no attempt and no lookup, and
        go to a person only once it has outlasted their tolerance."""
        seconds = (
            fault.seconds or PROVIDER_OUTAGE_SECONDS[fault.slot % len(PROVIDER_OUTAGE_SECONDS)]
        )

        def back() -> None:
            self.provider_back = time.monotonic()

        return self._provider_window(
            "provider_outage",
            {"unavailable": True},
            "provider_outages",
            seconds=seconds,
            outage=True,
            then=back,
        )

    @fault_kind(
        "provider_rate_limit",
        "provider",
        lambda slot: (
            f"429 with Retry-After: {RATE_LIMIT_RETRY_AFTER_SECONDS} to every "
            f"{RATE_LIMIT_EVERY}nd call and lookup for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_provider_rate_limit(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "provider_rate_limit",
            {
                "rate_limit_every": RATE_LIMIT_EVERY,
                "rate_limit_retry_after_s": RATE_LIMIT_RETRY_AFTER_SECONDS,
            },
            "rate_limit_windows",
        )

    @fault_kind(
        "keys_pruned",
        "provider",
        lambda slot: (
            f"keys older than {PRUNE_KEYS_OLDER_THAN_SECONDS:g} s forgotten "
            f"for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_keys_pruned(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "keys_pruned",
            {"prune_keys_older_than_s": PRUNE_KEYS_OLDER_THAN_SECONDS},
            "key_prunings",
        )

    # overload (#22)

    @fault_kind(
        "cpu_starvation",
        "overload",
        lambda slot: f"{CPU_HOGS_PER_CORE[slot % 2]} busy loops a core for {OVERLOAD_SECONDS:g} s",
    )
    def _fault_cpu_starvation(self, fault: ScheduledFault) -> bool:
        """Busy loops at normal priority, 2x or 4x the cores this process may use: the
        daemons, Postgres and this harness all get a share of what is left."""
        if self.hogs or "broker_restart" in self.endings or self.off_loop.busy():
            return False  # one at a time; a broker's CLI calls (start_app above all) first
        count = CPU_HOGS_PER_CORE[fault.slot % 2] * len(os.sched_getaffinity(0))
        self.hogs = [
            # This interpreter, a loop of its own: nothing of the caller's reaches it.
            subprocess.Popen(
                [sys.executable, "-c", "while True: pass"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(count)
        ]
        self._lasting("cpu_starvation", OVERLOAD_SECONDS, self._end_cpu_starvation)
        self.tally.cpu_starvations += 1
        return True

    def _end_cpu_starvation(self) -> None:
        hogs, self.hogs = self.hogs, []
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
        self._overload_over()

    @fault_kind(
        "slow_database",
        "overload",
        lambda slot: (
            f"database link +{SLOW_DATABASE_SECONDS[0] * 1000:g}-"
            f"{SLOW_DATABASE_SECONDS[1] * 1000:g} ms a chunk for {OVERLOAD_SECONDS:g} s"
        ),
    )
    def _fault_slow_database(self, fault: ScheduledFault) -> bool:
        """The proxied daemons' database link: every chunk 50-500 ms late, both ways."""
        link = self.links["database"]

        def end() -> None:
            link.restore()
            self._overload_over()

        # The database link's slot: one link fault at a time on it (link_delay's too).
        if not self._lasting(f"link_{LINKS.index('database')}", OVERLOAD_SECONDS, end):
            return False
        link.delay(SLOW_DATABASE_SECONDS[0], up_to=SLOW_DATABASE_SECONDS[1])
        self.tally.slow_databases += 1
        return True

    @fault_kind(
        "decision_burst",
        "overload",
        lambda slot: (
            f"decisions at {BURST_FACTOR:g}x the measured drain rate (its "
            f"share of the {BURST_SHARE:.0%} kept for bursts)"
        ),
    )
    def _fault_decision_burst(self, fault: ScheduledFault) -> bool:
        """Decisions at 3x the drain rate measured when quiet, on top of the stream's:
        this burst's share of the decisions the steady stream left to the bursts."""
        if self.burst is not None:
            return False
        drain_rate = self.quiet_rate if self.quiet_rate else self.rate
        burst_rate = BURST_FACTOR * drain_rate
        self.burst = (time.monotonic(), burst_rate, self.burst_recorded)
        before = self.burst_recorded

        def end() -> None:
            self.burst_recorded = before + self.burst_size
            self.burst = None
            self._overload_over()

        self._lasting("decision_burst", self.burst_size / burst_rate, end)
        self.tally.decision_bursts += 1
        return True

    # callbacks (#25): the webhooks flow all run long; these disturb them for a while

    @fault_kind(
        "webhooks_dropped",
        "callbacks",
        lambda slot: (
            f"every {WEBHOOK_DROP_EVERY}nd webhook dropped for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_webhooks_dropped(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "webhooks_dropped", {"webhook_drop_every": WEBHOOK_DROP_EVERY}, "webhook_drop_windows"
        )

    @fault_kind(
        "webhooks_forged",
        "callbacks",
        lambda slot: (
            f"every {WEBHOOK_FORGE_EVERY}nd webhook forged, every "
            f"{WEBHOOK_STALE_EVERY}rd stale, for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_webhooks_forged(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "webhooks_forged",
            {
                "webhook_forge_every": WEBHOOK_FORGE_EVERY,
                "webhook_stale_every": WEBHOOK_STALE_EVERY,
            },
            "webhook_forge_windows",
        )

    @fault_kind(
        "webhooks_duplicated",
        "callbacks",
        lambda slot: (
            f"every {WEBHOOK_DUPLICATE_EVERY}nd webhook twice, "
            f"{WEBHOOK_REORDER} at a time newest first, for {PROVIDER_FAULT_SECONDS:g} s"
        ),
    )
    def _fault_webhooks_duplicated(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "webhooks_duplicated",
            {
                "webhook_duplicate_every": WEBHOOK_DUPLICATE_EVERY,
                "webhook_reorder": WEBHOOK_REORDER,
            },
            "webhook_duplicate_windows",
        )

    @fault_kind(
        "webhooks_delayed",
        "callbacks",
        lambda slot: f"webhooks held {WEBHOOK_DELAY_MS} ms for {PROVIDER_FAULT_SECONDS:g} s",
    )
    def _fault_webhooks_delayed(self, fault: ScheduledFault) -> bool:
        return self._provider_window(
            "webhooks_delayed", {"webhook_delay_ms": WEBHOOK_DELAY_MS}, "webhook_delay_windows"
        )

    def _provider_window(
        self,
        kind: str,
        fault_fields: dict[str, Any],
        counter: str,
        *,
        seconds: float = PROVIDER_FAULT_SECONDS,
        outage: bool = False,
        then: Callable[[], None] | None = None,
    ) -> bool:
        """Turn provider faults on for ``seconds``; an ``outage`` (the provider or its
        lookups down) is kept in :attr:`outage_spans` for the checker."""
        base = self.provider.faults
        normal = {name: getattr(base, name) for name in fault_fields}
        provider = self.provider
        started = time.monotonic()

        def end() -> None:
            provider.set_faults(**normal)
            if outage:
                self.outage_spans.append((started, time.monotonic()))
            if then is not None:
                then()

        if not self._lasting(kind, seconds, end):
            return False
        self.provider.set_faults(**fault_fields)
        setattr(self.tally, counter, getattr(self.tally, counter) + 1)
        return True

    def _close_broker_connections(self, daemon: Daemon) -> int:
        """Close this daemon's own connections only, found by the connection name it
        gives (application name, host, pid): other work shares the broker."""
        control = self.broker_control
        assert control is not None
        marker = f"{APPLICATION_NAMES[daemon.kind]} {socket.gethostname()}:{daemon.pid}:"
        listing = control(
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        )
        closed = 0
        for line in (listing or "").splitlines():
            pid, _, properties = line.partition("\t")
            if marker in properties:
                control("close_connection", pid.strip(), "outbox chaos")
                closed += 1
        if not closed:
            self.tally.faults_that_found_nothing += 1
        return closed

    def _settled(self) -> bool:
        with psycopg.connect(self.database_url) as connection:
            counts = Store(connection).run(store.operations_by_state())
        # Every decision settled implies none is in flight, past its lease or not.
        return (
            sum(counts[state] for state in SETTLED) == self.operations
            and counts[OperationState.IN_FLIGHT] == 0
        )

    def sessions(self) -> list[str]:
        """The run database's sessions now (evidence if the run did not settle)."""
        try:
            with psycopg.connect(self.database_url, autocommit=True) as connection:
                return session_snapshot(connection)
        except (psycopg.Error, OutboxError) as failure:
            return [f"(no snapshot: {type(failure).__name__})"]

    def stop(self) -> None:
        """End every fault still lasting (above all: start a broker this run stopped),
        then stop the daemons."""
        if self.sampler is not None:
            self.sampler.stop()
        # A broker call under way finishes first (a start_app above all).
        self.off_loop.close()
        for kind, (_, end, _) in list(self.endings.items()):
            del self.endings[kind]
            try:
                end()
            except Exception as error:  # keep ending the others
                say(f"  ! could not end {kind}: {type(error).__name__}")
        # All at once: each finishes the effects in hand while the others do the same.
        stop_all([daemon.process for daemon in self.daemons if daemon.process is not None])


# The kinds ``--faults`` enables by category, in the order they were registered.
FAULT_CATEGORIES: dict[str, tuple[str, ...]] = {
    category: tuple(kind for kind, entry in FAULTS.items() if entry.category == category)
    for category in dict.fromkeys(entry.category for entry in FAULTS.values())
}


class Sampler:
    """Counts the run's operations every SAMPLE_SECONDS on a thread and a connection of
    its own. Not in the stream's loop: a fault's own call can hold that loop (rabbitmqctl,
    an Erlang VM of its own, took 50 s beside the CPU hogs of a sweep), and a series with
    a hole where the system recovered read as a recovery 50 s late."""

    def __init__(
        self, database_url: str, take: Callable[[psycopg.Connection[Any], float], None]
    ) -> None:
        self._database_url = database_url
        self._take = take
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        connection: psycopg.Connection[Any] | None = None
        try:
            while True:
                try:
                    if connection is None:
                        connection = psycopg.connect(self._database_url)
                    self._take(connection, time.monotonic())
                except psycopg.Error:
                    # The run's faults may end this session too: a new one next time.
                    if connection is not None:
                        with contextlib.suppress(psycopg.Error):
                            connection.close()
                    connection = None
                if self._stopping.wait(SAMPLE_SECONDS):
                    return
        finally:
            if connection is not None:
                with contextlib.suppress(psycopg.Error):
                    connection.close()


class OffLoop:
    """Calls that may take a minute (rabbitmqctl boots an Erlang VM of its own, slow on a
    busy machine), run one at a time in the order given on a thread of their own. What
    follows each (``then``) runs on the stream's loop, when it asks (``run_finished``);
    a call's exception is raised there, as it would have been in the loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-broker")
        self._under_way: list[tuple[Future[Any], Callable[[Any], None]]] = []

    def submit(self, call: Callable[[], T], then: Callable[[T], None]) -> None:
        self._under_way.append((self._executor.submit(call), then))

    def busy(self) -> bool:
        """A call under way, or finished with its ``then`` still to run."""
        return bool(self._under_way)

    def run_finished(self) -> None:
        # In submission order: a later call's result never overtakes an earlier one's.
        while self._under_way and self._under_way[0][0].done():
            future, then = self._under_way.pop(0)
            then(future.result())

    def close(self) -> None:
        """Wait for the calls under way (their ``then`` is not run)."""
        self._executor.shutdown(wait=True)
        self._under_way.clear()


def _start_app(control: BrokerControl) -> None:
    # A CLI call is an Erlang VM of its own, which a starved machine may not boot
    # within its timeout: a broker left stopped would fail the run for the harness's
    # sake, so try again before giving up.
    for _ in range(START_APP_TRIES):
        if control("start_app") is not None:
            return
    raise RuntimeError("rabbitmqctl start_app failed; start the broker by hand")


def shared_broker_control(executable: str) -> BrokerControl:
    """rabbitmqctl on PATH, acting on the broker it finds by default: the shared one."""

    def control(*args: str) -> str | None:
        return _rabbitmqctl(executable, *args)

    return control


def private_broker_control(cluster: RabbitCluster, node: Node) -> BrokerControl:
    """rabbitmqctl aimed at the run's own node (by name, with the node's own cookie): a
    mistake here cannot reach the shared broker, whose cookie differs."""

    def control(*args: str) -> str | None:
        try:
            return cluster.ctl(node, *args)
        except ClusterError as failure:
            first_line = (str(failure).strip().splitlines() or [""])[0]
            say(f"  (rabbitmqctl {args[0]} failed: {first_line[:200]})")
            return None

    return control


def _rabbitmqctl(executable: str, *args: str) -> str | None:
    """What the command printed; None (and a line saying why) if it failed."""
    # The executable is the one found on PATH; the arguments are this module's own.
    result = subprocess.run(  # noqa: S603
        [executable, *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        first_line = (result.stderr.strip().splitlines() or [""])[0]
        say(f"  (rabbitmqctl {args[0]} failed: {first_line[:200]})")
        return None
    return result.stdout


if __name__ == "__main__":
    sys.exit(main())
