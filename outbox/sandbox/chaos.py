"""``outbox chaos``: many refunds through the whole system while it is being broken.

Two dispatchers and two consumers run as real subprocesses against a database, broker
names and payment sandbox of their own. The main process records ``send_refund``
decisions at a steady pace while a fault schedule drawn from the seed kills daemons,
pauses a consumer past its lease, closes one daemon's broker connections and ends the
daemons' database sessions; the sandbox meanwhile drops responses after committing and
fails before committing. When every operation has settled, a checker reads the event
log and the provider's ledger and prints a verdict.

The same seed gives the same schedule (the daemons' own timing still varies). Exit
status 0 only if nothing was lost, no decision had two effects, no operation was
retried after an unknown outcome that was never proven absent, and every operation's
events follow the state machine. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg

from outbox import store
from outbox.decisions import record_decision
from outbox.errors import ConfigurationError
from outbox.loading import load_registry
from outbox.migrate import migrate
from outbox.models import OperationEvent
from outbox.sandbox.demo import DemoNames, clean_up
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.settings import Settings, redact_url, with_database
from outbox.states import EventName, OperationState, is_legal
from outbox.store import Store

TOOLS_MODULE = "outbox.sandbox.tools"
REFUND_DEADLINE_SECONDS = 5.0
LEASE_MARGIN_SECONDS = 1.0
# A consumer paused this long has outlived the lease of anything it held (deadline +
# margin), so another process must take over and the paused one wake up as a zombie.
STOP_SECONDS = REFUND_DEADLINE_SECONDS + LEASE_MARGIN_SECONDS + 1.5
# Decisions arrive over this many seconds per operation, at least MIN_STREAM_SECONDS,
# so the faults land while work is in every state rather than after it all settled.
STREAM_SECONDS_PER_OPERATION = 0.1
MIN_STREAM_SECONDS = 15.0
# One fault every this many seconds of stream, beyond the one of each kind.
FAULT_SPACING_SECONDS = 3.0
# A broker or database fault that found nothing to close (the daemon was between
# connections) is tried again this much later, this many times.
FAULT_RETRY_SECONDS = 1.0
FAULT_RETRIES = 20
DEFAULT_DRAIN_SECONDS = 120.0
LOOP_SECONDS = 0.05
MAX_AMOUNT_CENTS = 49_999  # under the sandbox tool's approval threshold (50,000)

# The daemons' application and connection names (dispatcher/daemon.py and
# consumer/worker.py); spelled out because the base package never imports the daemons.
APPLICATION_NAMES = {"dispatcher": "outbox-dispatcher", "consumer": "outbox-consumer"}
DAEMONS = ("dispatcher", "dispatcher", "consumer", "consumer")

PROCESS_FAULTS = ("dispatcher_kill", "consumer_kill", "consumer_stop")
FAULT_CATEGORIES: dict[str, tuple[str, ...]] = {
    "process": PROCESS_FAULTS,
    "broker": ("broker_connection_close",),
    "database": ("db_connection_kill",),
    "provider": (),  # the sandbox's own faults, not on the schedule
}
SETTLED = (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED)


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "chaos",
        help="stream refunds through the whole system under seeded faults; check the guarantee",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from outbox.cli import add_setting_flags

    add_setting_flags(parser, "database_url", "amqp_url")
    parser.add_argument(
        "--operations", type=_positive_int, default=300, help="decisions to record (300)"
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the fault schedule (7)")
    parser.add_argument(
        "--faults",
        type=_fault_categories,
        default=_fault_categories("all"),
        help="all, or a comma-separated subset of process,broker,database,provider (all)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help=f"seconds to wait for every operation to settle ({DEFAULT_DRAIN_SECONDS:g})",
    )
    parser.set_defaults(handler=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


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

    def describe(self) -> str:
        return f"t=+{self.at:5.1f}s {self.kind:<24} {self.target()}"

    def target(self) -> str:
        return {
            "dispatcher_kill": f"dispatcher#{self.slot}",
            "consumer_kill": f"consumer#{self.slot}",
            "consumer_stop": f"consumer#{self.slot} for {STOP_SECONDS:g} s",
            "broker_connection_close": f"{_slot_kind(self.slot)}#{self.slot % 2}",
            "db_connection_kill": "every daemon's sessions",
        }[self.kind]


def _slot_kind(slot: int) -> str:
    return DAEMONS[slot]


def stream_seconds(operations: int) -> float:
    return max(MIN_STREAM_SECONDS, operations * STREAM_SECONDS_PER_OPERATION)


def fault_schedule(seed: int, operations: int, categories: frozenset[str]) -> list[ScheduledFault]:
    """The faults, in time order: at least one of every enabled kind whatever the seed,
    then more of random kinds as the stream gets longer. Only ``seed`` and the
    arguments decide it, so a run can be repeated."""
    # Not for security: a reproducible schedule is the point of the seed.
    rng = random.Random(seed)  # noqa: S311
    kinds = [kind for category in sorted(categories) for kind in FAULT_CATEGORIES[category]]
    if not kinds:
        return []
    duration = stream_seconds(operations)
    extra = max(0, int(duration // FAULT_SPACING_SECONDS) - len(kinds))
    chosen = kinds + [rng.choice(kinds) for _ in range(extra)]
    rng.shuffle(chosen)
    times = sorted(rng.uniform(1.0, duration) for _ in chosen)
    schedule = []
    for at, kind in zip(times, chosen, strict=True):
        # broker closes pick any of the four daemons; the others one of two of a kind
        slot = (
            rng.randrange(len(DAEMONS)) if kind == "broker_connection_close" else rng.randrange(2)
        )
        schedule.append(ScheduledFault(round(at, 1), kind, slot))
    return schedule


# --- the daemons ----------------------------------------------------------------------


@dataclass
class Daemon:
    kind: str
    index: int
    environment: dict[str, str]
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    generation: int = 0
    stopped_until: float | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}#{self.index}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.kind}{self.index}.{self.generation}.log"

    def start(self) -> None:
        self.generation += 1
        self.log = self.log_path.open("wb")
        # The command is this interpreter and one of the project's own modules.
        self.process = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", self.kind],
            env=self.environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.stopped_until = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill_and_restart(self) -> None:
        assert self.process is not None
        self.process.kill()  # SIGKILL ends a stopped process too
        self.process.wait(timeout=30)
        self._close_log()
        self.start()

    def pause(self, until: float) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self.stopped_until = until

    def resume_if_due(self, now: float) -> None:
        if self.stopped_until is not None and now >= self.stopped_until:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
            self.stopped_until = None

    def exited_unplanned(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot act on TERM
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


# --- the run --------------------------------------------------------------------------


@dataclass
class Tally:
    dispatcher_kills: int = 0
    consumer_kills: int = 0
    consumer_stops: int = 0
    broker_connection_closes: int = 0
    db_connection_kills: int = 0
    unplanned_exits: int = 0
    faults_that_found_nothing: int = 0


@dataclass
class Verdict:
    decisions: int
    effects: int = 0
    rejected: int = 0
    escalated: int = 0
    lost: int = 0
    duplicate_effects: int = 0
    committed_without_one_refund: int = 0
    refunds_without_an_effect_state: int = 0
    outcome_unknown_opened: int = 0
    reconciled: int = 0
    blind_retries: int = 0
    illegal_sequences: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not (
            self.lost
            or self.duplicate_effects
            or self.blind_retries
            or self.illegal_sequences
            or self.committed_without_one_refund
            or self.refunds_without_an_effect_state
        )


def run(args: argparse.Namespace, settings: Settings) -> int:
    for noisy in ("outbox.sandbox.provider", "outbox.lifecycle", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    rabbitmqctl = shutil.which("rabbitmqctl")
    categories: frozenset[str] = args.faults
    if "broker" in categories and rabbitmqctl is None:
        raise ConfigurationError("broker faults need rabbitmqctl on PATH; or leave out broker")
    names = _fresh_names(settings)
    schedule = fault_schedule(args.seed, args.operations, categories)
    say(
        f"outbox chaos: {args.operations} decisions, seed {args.seed}, "
        f"faults {','.join(sorted(categories))}"
    )
    say(f"database {redact_url(names.database_url)}, queue {names.queue}")
    say(f"fault schedule ({len(schedule)}):")
    for fault in schedule:
        say(f"  {fault.describe()}")
    provider_faults = (
        Faults(seed=args.seed, drop_response_probability=0.15, fail_before_commit_probability=0.05)
        if "provider" in categories
        else Faults()
    )
    with (
        SandboxProvider(faults=provider_faults) as provider,
        tempfile.TemporaryDirectory(prefix="outbox-chaos-") as log_dir,
    ):
        try:
            migrate(names.database_url)
            chaos = Chaos(
                names=names,
                amqp_url=settings.amqp_url.get_secret_value(),
                provider=provider,
                log_dir=Path(log_dir),
                operations=args.operations,
                schedule=schedule,
                rabbitmqctl=rabbitmqctl,
                drain_timeout=args.drain_timeout,
            )
            try:
                drain_s = chaos.run()
            finally:
                chaos.stop()
            verdict = check(names.database_url, args.operations, provider)
        finally:
            clean_up(settings, names)
    tally = chaos.tally
    say(
        f"decisions={verdict.decisions} effects={verdict.effects} rejected={verdict.rejected} "
        f"escalated={verdict.escalated} lost={verdict.lost} "
        f"duplicate_effects={verdict.duplicate_effects}"
    )
    # Skipped deliveries are only counted in the consumers' metrics, which a SIGKILL loses.
    say(
        "duplicate_deliveries_suppressed=n/a "
        f"outcome_unknown_opened={verdict.outcome_unknown_opened} "
        f"reconciled={verdict.reconciled} blind_retries={verdict.blind_retries}"
    )
    say(
        f"dispatcher_kills={tally.dispatcher_kills} consumer_kills={tally.consumer_kills} "
        f"consumer_stops={tally.consumer_stops} "
        f"broker_connection_closes={tally.broker_connection_closes} "
        f"db_connection_kills={tally.db_connection_kills} "
        f"drain_s={'timeout' if drain_s is None else f'{drain_s:.1f}'}"
    )
    say(
        f"illegal_sequences={verdict.illegal_sequences} "
        f"committed_without_one_refund={verdict.committed_without_one_refund} "
        f"refunds_without_an_effect_state={verdict.refunds_without_an_effect_state} "
        f"unplanned_exits={tally.unplanned_exits} "
        f"faults_that_found_nothing={tally.faults_that_found_nothing}"
    )
    for example in verdict.examples[:10]:
        say(f"  {example}")
    say("guarantee held." if verdict.held else "GUARANTEE BROKEN.")
    return 0 if verdict.held else 1


def say(line: str) -> None:
    print(line, flush=True)


def _fresh_names(settings: Settings) -> DemoNames:
    tag = uuid.uuid4().hex[:8]
    return DemoNames(
        database_url=with_database(settings.libpq_url, f"outbox_chaos_{tag}"),
        exchange=f"chaos.{tag}.outbox",
        queue=f"chaos.{tag}.operations",
        dead_letter_exchange=f"chaos.{tag}.dead",
        dead_letter_queue=f"chaos.{tag}.operations.dead",
    )


@dataclass
class Chaos:
    names: DemoNames
    amqp_url: str
    provider: SandboxProvider
    log_dir: Path
    operations: int
    schedule: list[ScheduledFault]
    rabbitmqctl: str | None
    drain_timeout: float
    tally: Tally = field(default_factory=Tally)
    daemons: list[Daemon] = field(default_factory=list)

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "OUTBOX_DATABASE_URL": self.names.database_url,
            "OUTBOX_AMQP_URL": self.amqp_url,
            "OUTBOX_EXCHANGE": self.names.exchange,
            "OUTBOX_QUEUE": self.names.queue,
            "OUTBOX_DEAD_LETTER_EXCHANGE": self.names.dead_letter_exchange,
            "OUTBOX_DEAD_LETTER_QUEUE": self.names.dead_letter_queue,
            "OUTBOX_TOOLS": TOOLS_MODULE,
            "OUTBOX_SANDBOX_URL": self.provider.url,
            "OUTBOX_SANDBOX_REFUND_DEADLINE": f"{REFUND_DEADLINE_SECONDS:g}",
            "OUTBOX_LEASE_MARGIN": f"{LEASE_MARGIN_SECONDS:g}",
            "OUTBOX_POLL_INTERVAL": "0.2",
            "OUTBOX_RECONCILE_INTERVAL": "0.2",
            "OUTBOX_METRICS_HOST": "127.0.0.1",
            "OUTBOX_METRICS_PORT": "0",
            "OUTBOX_LOG_LEVEL": "WARNING",
        }

    def run(self) -> float | None:
        """Stream the decisions and the faults, then wait for every operation to settle;
        the seconds that took after the stream ended, None past the drain deadline."""
        environment = self.environment()
        counts: Counter[str] = Counter()
        for kind in DAEMONS:
            daemon = Daemon(kind, counts[kind], environment, self.log_dir)
            counts[kind] += 1
            daemon.start()
            self.daemons.append(daemon)
        registry = load_registry([TOOLS_MODULE])
        pending = list(self.schedule)
        retries: Counter[ScheduledFault] = Counter()
        rate = self.operations / stream_seconds(self.operations)
        recorded = 0
        start = time.monotonic()
        with psycopg.connect(self.names.database_url) as connection:
            while recorded < self.operations or pending or self._any_stopped():
                elapsed = time.monotonic() - start
                due = min(self.operations, int(elapsed * rate) + 1)
                for n in range(recorded, due):
                    record_decision(
                        connection,
                        registry,
                        "send_refund",
                        {
                            "payment_id": f"pay_chaos_{n}",
                            "amount_cents": 100 + (n * 7919) % (MAX_AMOUNT_CENTS - 100),
                        },
                        run_id="chaos",
                        decision_key=f"call_{n}",
                    )
                connection.commit()
                recorded = max(recorded, due)
                while pending and pending[0].at <= elapsed:
                    fault = pending.pop(0)
                    if not self._inject(fault, elapsed) and retries[fault] < FAULT_RETRIES:
                        retries[fault] += 1
                        later = ScheduledFault(
                            fault.at + FAULT_RETRY_SECONDS * retries[fault], fault.kind, fault.slot
                        )
                        retries[later] = retries[fault]
                        pending.append(later)
                        pending.sort(key=lambda f: f.at)
                self._tend(time.monotonic())
                # Pacing the schedule, not waiting for a condition.
                time.sleep(LOOP_SECONDS)
        stream_end = time.monotonic()
        deadline = stream_end + self.drain_timeout
        while time.monotonic() < deadline:
            self._tend(time.monotonic())
            if self._settled():
                return time.monotonic() - stream_end
            time.sleep(LOOP_SECONDS * 4)  # polling the database, with the deadline above
        return None

    def _any_stopped(self) -> bool:
        return any(daemon.stopped_until is not None for daemon in self.daemons)

    def _tend(self, now: float) -> None:
        """Wake paused consumers when due; restart a daemon that died on its own (and
        count it: the schedule never kills without saying so)."""
        for daemon in self.daemons:
            daemon.resume_if_due(now)
            if daemon.exited_unplanned():
                self.tally.unplanned_exits += 1
                say(f"  ! {daemon.name} exited on its own; restarting. Its last lines:")
                say(daemon.tail())
                daemon.stop()
                daemon.start()

    def _of_kind(self, kind: str) -> list[Daemon]:
        return [daemon for daemon in self.daemons if daemon.kind == kind]

    def _inject(self, fault: ScheduledFault, elapsed: float) -> bool:
        """Apply one fault; False if it found nothing to act on (try again later)."""
        tally = self.tally
        if fault.kind == "dispatcher_kill":
            self._of_kind("dispatcher")[fault.slot].kill_and_restart()
            tally.dispatcher_kills += 1
        elif fault.kind == "consumer_kill":
            self._of_kind("consumer")[fault.slot].kill_and_restart()
            tally.consumer_kills += 1
        elif fault.kind == "consumer_stop":
            consumers = self._of_kind("consumer")
            # Never both at once: the point is a zombie waking beside a live worker.
            awake = [c for c in consumers if c.stopped_until is None]
            if len(awake) < len(consumers):
                return False
            consumers[fault.slot].pause(time.monotonic() + STOP_SECONDS)
            tally.consumer_stops += 1
        elif fault.kind == "broker_connection_close":
            closed = self._close_broker_connections(self.daemons[fault.slot])
            if not closed:
                return False
            tally.broker_connection_closes += closed
        elif fault.kind == "db_connection_kill":
            with psycopg.connect(self.names.database_url, autocommit=True) as connection:
                ended = store.terminate_backends(connection, list(APPLICATION_NAMES.values()))
            if not ended:
                return False
            tally.db_connection_kills += ended
        say(f"  at +{elapsed:5.1f}s {fault.kind:<24} {fault.target()}")
        return True

    def _close_broker_connections(self, daemon: Daemon) -> int:
        """Close this daemon's own connections only, found by the connection name it
        gives (application name, host, pid): other work shares the broker."""
        assert self.rabbitmqctl is not None
        marker = f"{APPLICATION_NAMES[daemon.kind]} {socket.gethostname()}:{daemon.pid}:"
        listing = _rabbitmqctl(
            self.rabbitmqctl,
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        )
        closed = 0
        for line in listing.splitlines():
            pid, _, properties = line.partition("\t")
            if marker in properties:
                _rabbitmqctl(self.rabbitmqctl, "close_connection", pid.strip(), "outbox chaos")
                closed += 1
        if not closed:
            self.tally.faults_that_found_nothing += 1
        return closed

    def _settled(self) -> bool:
        with psycopg.connect(self.names.database_url) as connection:
            counts = Store(connection).run(store.operations_by_state())
        # Every decision settled implies none is in flight, past its lease or not.
        return (
            sum(counts[state] for state in SETTLED) == self.operations
            and counts[OperationState.IN_FLIGHT] == 0
        )

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()


def _rabbitmqctl(executable: str, *args: str) -> str:
    # The executable is the one found on PATH; the arguments are this module's own.
    result = subprocess.run(  # noqa: S603
        [executable, *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        first_line = (result.stderr.strip().splitlines() or [""])[0]
        say(f"  (rabbitmqctl {args[0]} failed: {first_line[:200]})")
        return ""
    return result.stdout


# --- the checker ----------------------------------------------------------------------


def check(database_url: str, decisions: int, provider: SandboxProvider) -> Verdict:
    verdict = Verdict(decisions=decisions)
    refunds: dict[str, int] = {
        str(key): int(count) for key, count in provider.ledger()["refunds_by_key"].items()
    }
    verdict.duplicate_effects = sum(count - 1 for count in refunds.values() if count > 1)
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        summaries = runner.run(store.list_operation_summaries(limit=decisions * 2 + 100))
        effect_states: set[str] = set()
        for summary in summaries:
            state = summary.state
            if state is OperationState.COMMITTED:
                verdict.effects += 1
                if refunds.get(str(summary.id), 0) != 1:
                    verdict.committed_without_one_refund += 1
                    verdict.examples.append(
                        f"{summary.id} committed with {refunds.get(str(summary.id), 0)} refunds"
                    )
            elif state is OperationState.REJECTED:
                verdict.rejected += 1
            elif state is OperationState.ESCALATED:
                verdict.escalated += 1
            if state in (OperationState.COMMITTED, OperationState.ESCALATED):
                effect_states.add(str(summary.id))
            events = runner.run(store.events(summary.id))
            _check_sequence(verdict, str(summary.id), state, events)
    # A refund may exist for a committed operation, or one escalated to a person with
    # its outcome unsettled; for anything else it is an effect nobody accounts for.
    verdict.refunds_without_an_effect_state = len(set(refunds) - effect_states)
    verdict.lost = decisions - (verdict.effects + verdict.rejected + verdict.escalated)
    return verdict


def _check_sequence(
    verdict: Verdict, operation_id: str, final: OperationState, events: list[OperationEvent]
) -> None:
    """Walk one operation's events: every transition legal and from the state the walk
    is in, the walk ending in the operation's state, and no attempt after an unknown
    outcome unless a lookup proved the effect absent or the outcome was a definite
    failure scheduled for retry."""
    state: OperationState | None = None
    unproven_unknown = False
    for event in events:
        name = event.name
        if name == EventName.OUTCOME_UNKNOWN:
            verdict.outcome_unknown_opened += 1
        elif name == EventName.RECONCILED:
            verdict.reconciled += 1
        if name == EventName.PREPARED:
            source, target = None, OperationState.PREPARED
        elif name == EventName.ATTEMPTED:
            source, target = OperationState.PREPARED, OperationState.IN_FLIGHT
            if unproven_unknown:
                verdict.blind_retries += 1
                verdict.examples.append(f"{operation_id} attempted again after an unknown outcome")
        elif "from" in event.attributes and "to" in event.attributes:
            source = OperationState(str(event.attributes["from"]))
            target = OperationState(str(event.attributes["to"]))
        else:
            continue  # an event that changes no state (deferred lookups, approvals)
        if source != state or (source is not None and not is_legal(source, target)):
            verdict.illegal_sequences += 1
            verdict.examples.append(f"{operation_id}: {name} {source}->{target} while {state}")
            return
        if target is OperationState.OUTCOME_UNKNOWN:
            unproven_unknown = True
        elif target is OperationState.PREPARED and (
            (name == EventName.RECONCILED and event.attributes.get("result") == "not_found")
            or name == EventName.RETRY_SCHEDULED
        ):
            unproven_unknown = False
        state = target
    if state is not final:
        verdict.illegal_sequences += 1
        verdict.examples.append(f"{operation_id}: events end in {state}, the row is {final}")
