"""One chaos run's loop: start the daemons, stream the decisions, inject the faults as
the schedule says and end them when due, then wait for every operation to settle."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from pydantic import SecretStr

from harness.background import OffLoop, Sampler
from harness.broker_control import BrokerControl
from harness.checker import SETTLED, Sample, quiet_rate, recovery_seconds
from harness.daemons import Daemon
from harness.diagnostics import session_snapshot
from harness.faults import FAULTS
from harness.parameters import (
    AMQP_HEARTBEAT_SECONDS,
    BURST_SHARE,
    CALLBACK_WAIT_SECONDS,
    DAEMONS,
    FAULT_RETRIES,
    FAULT_RETRY_AFTER_STREAM_SECONDS,
    FAULT_RETRY_SECONDS,
    LEASE_MARGIN_SECONDS,
    LOOP_SECONDS,
    OUTAGE_TOLERANCE_SECONDS,
    PROXIED_INDEX,
    PUBLISH_RETRY_MAX_SECONDS,
    READY_SECONDS,
    REFUND_DEADLINE_SECONDS,
    REQUEUE_STALE_AFTER_SECONDS,
    TOOLS_MODULE,
    TURN_SECONDS,
)
from harness.proxy import ThreadedProxy, url_through
from harness.rabbit_node import free_port
from harness.report import Tally, say
from harness.schedule import ScheduledFault, decision, stream_seconds
from outbox import store
from outbox.decisions import record_decision
from outbox.errors import OutboxError
from outbox.loading import load_registry
from outbox.sandbox.processes import stop_all
from outbox.sandbox.provider import SandboxProvider
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.tools import (
    CALLBACK_WAIT_ENV,
    OUTAGE_TOLERANCE_ENV,
    REFUND_DEADLINE_ENV,
    SANDBOX_URL_ENV,
)
from outbox.settings import split_amqp_urls
from outbox.states import OperationState
from outbox.store import Store


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

    def overload_over(self) -> None:
        self.overload_ended = time.monotonic()

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

    def lasting(
        self, kind: str, seconds: float, end: Callable[[], None], *, off_loop: bool = False
    ) -> bool:
        """Register how a fault that lasts ends; False if one of its kind still lasts."""
        if kind in self.endings:
            return False
        self.endings[kind] = (time.monotonic() + seconds, end, off_loop)
        return True

    def of_kind(self, kind: str) -> list[Daemon]:
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
