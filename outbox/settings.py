"""One settings model for every process, read from ``OUTBOX_*`` environment variables.

CLI flags override the environment; the CLI builds its flags from these fields, so a
flag and its variable can never drift apart. The URL settings are checked, converted and
redacted by :mod:`outbox.urls`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal, cast

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox import settings_checks
from outbox.bounds import DECISION_LOCK_TIMEOUT, MAX_DECISION_LOCK_TIMEOUT
from outbox.errors import ConfigurationError
from outbox.tool_queues import parse_tool_queues, tool_queue_problems

# The URL helpers live in outbox.urls; named here too, where every caller found them
# before, so that an import of outbox.settings keeps working.
from outbox.urls import DatabaseHost as DatabaseHost
from outbox.urls import check_amqp_url, check_database_hosts, check_libpq_reads, url_scheme
from outbox.urls import database_hosts as database_hosts
from outbox.urls import database_name as database_name
from outbox.urls import is_loopback as is_loopback
from outbox.urls import libpq_url as libpq_url
from outbox.urls import redact_amqp_urls as redact_amqp_urls
from outbox.urls import redact_url as redact_url
from outbox.urls import split_amqp_urls as split_amqp_urls
from outbox.urls import sqlalchemy_url as sqlalchemy_url
from outbox.urls import with_database as with_database
from outbox.variables import ENV_PREFIX as ENV_PREFIX

# Every other OUTBOX_* variable, and who reads it.
from outbox.variables import OTHER_VARIABLES as OTHER_VARIABLES
from outbox.variables import SETTING_GROUPS as SETTING_GROUPS
from outbox.variables import environment_value, setting_variable, unknown_variable
from outbox.variables import in_groups as _in

# The shortest duration any setting accepts. Below it a wait is a busy loop (a reconcile
# interval of 1 µs kept a core 81% busy) and no round trip fits in a timeout; zero or
# less is no wait at all.
MIN_SECONDS = 0.001

_SEPARATE_THEM = (
    "several broker URLs are separated by commas, so a comma in a user name or password "
    "must be written %2C"
)


# The most operations one broker message may carry (see outbox.broker.OperationChunk).
MAX_MESSAGE_OPERATIONS = 64


class Settings(BaseSettings):
    # extra="ignore" is about keyword arguments; unknown variables are refused by
    # load_settings, which sees the environment as a whole.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    database_url: SecretStr = Field(
        default=SecretStr("postgresql+psycopg://localhost:5432/outbox"),
        description="Postgres URL (postgresql:// or postgresql+psycopg://)",
    )
    # Several comma-separated URLs name the nodes of one cluster: each connect tries them
    # in turn (outbox.broker.connect), so a daemon carries on against the survivors.
    amqp_url: SecretStr = Field(
        json_schema_extra=_in("broker"),
        default=SecretStr("amqp://guest:guest@localhost:5672/"),
        description="RabbitMQ URL, or the URLs of a cluster's nodes separated by commas",
    )
    exchange: str = Field(
        json_schema_extra=_in("broker"),
        default="outbox",
        description="topic exchange operations are published to",
    )
    queue: str = Field(
        json_schema_extra=_in("broker"),
        default="outbox.operations",
        description="quorum queue consumers read",
    )
    dead_letter_exchange: str = Field(
        json_schema_extra=_in("broker"),
        default="outbox.dead",
        description="exchange that takes messages past the delivery limit",
    )
    dead_letter_queue: str = Field(
        json_schema_extra=_in("broker"),
        default="outbox.operations.dead",
        description="queue that keeps dead-lettered messages",
    )
    delivery_limit: int = Field(
        json_schema_extra=_in("broker"),
        default=5,
        ge=1,
        description="deliveries of one message before it is dead-lettered",
    )
    # A quorum queue per group of tools (checked by outbox.tool_queues.tool_queue_problems).
    tool_queues: str = Field(
        json_schema_extra=_in("broker"),
        default="",
        description="queues of their own for groups of tools: queue=tool,tool;queue=tool",
    )
    consume_queue: str | None = Field(
        default=None,
        description="the queue of OUTBOX_TOOL_QUEUES a consumer reads (unset: OUTBOX_QUEUE)",
    )
    amqp_heartbeat: int = Field(
        default=15, ge=1, description="AMQP heartbeat seconds: how fast a silent broker is noticed"
    )
    batch_size: int = Field(
        default=200, ge=1, le=10_000, description="outbox rows claimed and published per batch"
    )
    dispatch_lanes: int = Field(
        default=2,
        ge=1,
        le=16,
        description="batches a dispatcher has in flight at once, each its own transaction",
    )
    message_operations: int = Field(
        default=16,
        ge=1,
        le=MAX_MESSAGE_OPERATIONS,
        description="most operations the dispatcher puts in one broker message: one each "
        "while it keeps up, more as a backlog forms (1: always one each)",
    )
    # 10 ms, measured (docs/benchmarks.md, "2026-12-04, afternoon"): at 460 decisions/s
    # it took 25% off the CPU per operation for a p50 within the run's noise. Only
    # while three decisions come within it (dispatcher.daemon.GATHER_FROM_DECISIONS):
    # slower ones are claimed at once.
    dispatch_gather_ms: int = Field(
        default=10,
        ge=0,
        le=100,
        description="milliseconds the dispatcher waits before it claims while the last "
        "three decisions were notified within this long, so that a forming burst shares "
        "one batch (0: never)",
    )
    poll_interval: float = Field(
        json_schema_extra=_in("duration"),
        default=1.0,
        description="seconds between scans when no notification arrives",
    )
    publish_timeout: float = Field(
        json_schema_extra=_in("duration"),
        default=10.0,
        description="seconds to wait for a batch's broker confirms",
    )
    publish_retry_initial: float = Field(
        json_schema_extra=_in("duration"),
        default=1.0,
        description="seconds before a failed publish is retried (doubles)",
    )
    publish_retry_max: float = Field(
        json_schema_extra=_in("duration"),
        default=60.0,
        description="longest wait before a failed publish is retried",
    )
    retention: timedelta = Field(
        json_schema_extra=_in("duration"),
        default=timedelta(days=7),
        description="how long published rows are kept (seconds or ISO 8601)",
    )
    # docs/operating.md, "History retention": `outbox history archive` moves a settled
    # operation after the hot window, `outbox history drop` its day after the retention.
    history_hot: timedelta = Field(
        json_schema_extra=_in("duration"),
        default=timedelta(days=7),
        description="how long a settled operation stays in the hot tables (seconds or ISO 8601)",
    )
    history_retention: timedelta = Field(
        json_schema_extra=_in("duration"),
        default=timedelta(days=90),
        description="how long history keeps a settled operation (seconds or ISO 8601)",
    )
    tools: str = Field(
        default="",
        description="the tools modules, comma-separated: each exposes `registry` or "
        "`build_registry()`",
    )
    # 64, measured (docs/benchmarks.md, 2026-12-04 afternoon): on this project's 2-core
    # machine the default's drain was 2,846 ops/s at 16, 4,127 at 64 and 4,912 at 256;
    # 64 keeps most of that with a quarter of 256's operations in hand.
    prefetch: int = Field(
        default=64,
        ge=1,
        le=1000,
        description="messages a consumer holds unacknowledged at once (each one operation, "
        "or a chunk of up to OUTBOX_MESSAGE_OPERATIONS)",
    )
    # 20 s: the transaction deadlines derive from it, and a slow but working database
    # (a busy machine, a slow disk, a failover's first seconds) must finish well inside
    # them on a machine five times slower than a quiet one (docs/daemons.md).
    lease_margin: float = Field(
        json_schema_extra=_in("duration"),
        default=20.0,
        description="seconds a claim's lease outlives the tool's deadline; longer than the "
        "database transaction, statement, lock and idle-in-transaction timeouts",
    )
    # A database link that goes silent (NAT timeout, failover, cable) must cost seconds,
    # never a session idle in its transaction holding row locks forever. Unset values are
    # derived from the lease margin (see DatabaseBounds): a stuck commit is cut before
    # the lease runs out, so the reconciler can always take the operation over.
    db_transaction_timeout: float | None = Field(
        json_schema_extra=_in("database_bound", "duration", "lease_bounded"),
        default=None,
        description="seconds a daemon's transaction may take before its link is checked: cut "
        "if silent, left to run until the hard timeout if the server is working on it "
        "(default: a quarter of the lease margin)",
    )
    db_transaction_hard_timeout: float | None = Field(
        json_schema_extra=_in("database_bound", "duration", "lease_bounded"),
        default=None,
        description="seconds a transaction the server is still working on may take before "
        "its connection is cut (default: half the lease margin, at least the transaction "
        "timeout)",
    )
    db_statement_timeout: float | None = Field(
        json_schema_extra=_in("database_bound", "duration", "lease_bounded"),
        default=None,
        description="server-side statement_timeout, seconds (default: the hard transaction "
        "timeout)",
    )
    db_lock_timeout: float | None = Field(
        json_schema_extra=_in("database_bound", "duration", "lease_bounded"),
        default=None,
        description="server-side lock_timeout, seconds (default: half the hard transaction "
        "timeout)",
    )
    db_idle_in_transaction_timeout: float | None = Field(
        json_schema_extra=_in("database_bound", "duration", "lease_bounded"),
        default=None,
        description="server-side idle_in_transaction_session_timeout, seconds (default: the "
        "hard transaction timeout; the dispatcher adds its publish timeout)",
    )
    decision_lock_timeout: float = Field(
        json_schema_extra=_in("duration"),
        default=DECISION_LOCK_TIMEOUT,
        description="seconds an agent's decision waits for another session's lock before it "
        "raises DecisionBlocked, nothing written (outbox mcp; record_decision's lock_timeout)",
    )
    db_tcp_user_timeout: float = Field(
        json_schema_extra=_in("database_bound", "duration"),
        default=10.0,
        description="libpq tcp_user_timeout, seconds: how long sent data may go "
        "unacknowledged before the client drops the link",
    )
    db_keepalives_idle: int = Field(
        json_schema_extra=_in("database_bound"),
        default=5,
        ge=1,
        description="libpq keepalives_idle: seconds of silence before a probe",
    )
    db_keepalives_interval: int = Field(
        json_schema_extra=_in("database_bound"),
        default=2,
        ge=1,
        description="libpq keepalives_interval: seconds between probes",
    )
    db_keepalives_count: int = Field(
        json_schema_extra=_in("database_bound"),
        default=3,
        ge=1,
        description="libpq keepalives_count: probes lost before the link is dropped",
    )
    db_connect_timeout: int = Field(
        json_schema_extra=_in("database_bound"),
        default=10,
        ge=2,
        description="libpq connect_timeout, seconds",
    )
    reconcile_interval: float = Field(
        json_schema_extra=_in("duration"),
        default=0.5,
        description="seconds between reconciler scans",
    )
    requeue_stale_after: timedelta = Field(
        json_schema_extra=_in("duration"),
        default=timedelta(minutes=10),
        description="a prepared operation no message reached for this long is queued again",
    )
    undeliverable_after_requeues: int = Field(
        default=3,
        ge=1,
        description="a prepared operation queued again this many times, and refused this "
        "many times by consumers that cannot run it (the latest message too), is escalated "
        "to a person; requeues after timeouts or database errors never count",
    )
    approval_denial_grace: timedelta = Field(
        json_schema_extra=_in("duration"),
        default=timedelta(minutes=15),
        description="a denied approval with no grant after it for this long ends the "
        "operation rejected (seconds or ISO 8601)",
    )
    reconcile_batch: int = Field(
        default=50, ge=1, le=1000, description="operations one reconciler scan takes"
    )
    # The provider breaker (outbox/breaker.py, docs/contracts.md "When the provider is
    # down"): one verdict per provider, shared through Postgres by every consumer.
    provider_failures_to_open: int = Field(
        default=5,
        ge=2,
        le=100,
        description="operations whose calls to one provider got no answer, in a row, "
        "that open its breaker",
    )
    provider_failure_window: float = Field(
        json_schema_extra=_in("duration"),
        default=30.0,
        description="seconds within which those failures count as one streak",
    )
    provider_longest_probe: float = Field(
        json_schema_extra=_in("duration"),
        default=10.0,
        description="the longest pause, in seconds, between probes of an unavailable "
        "provider (they start at 1 s and double)",
    )
    provider_release_spread: float = Field(
        json_schema_extra=_in("duration"),
        default=5.0,
        description="seconds over which the operations that waited are released, at "
        "random, when their provider is back",
    )
    provider_health_refresh: float = Field(
        json_schema_extra=_in("duration"),
        default=1.0,
        description="seconds a consumer trusts its copy of the providers' breakers",
    )
    # Prometheus scrapes from another host or container, so all interfaces by default;
    # the endpoints serve counters and health only, never ids or payloads.
    metrics_host: str = Field(
        default="0.0.0.0",  # noqa: S104
        description="address /metrics and /healthz bind to",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="port for /metrics and /healthz (0 picks a free one; default per daemon)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="log level"
    )
    log_format: Literal["logfmt", "json"] = Field(default="logfmt", description="log line format")
    # Provider callbacks (`outbox callbacks serve`, outbox.callbacks.CallbackReceiver).
    callback_tolerance: float = Field(
        json_schema_extra=_in("duration"),
        default=300.0,
        description="seconds a callback's signed timestamp may be from now, either way: the "
        "replay window (at most 300, standardwebhooks' own)",
    )
    callback_max_body: int = Field(
        default=256 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="bytes of a callback's body read at most; a larger one is refused (413)",
    )
    # The front doors (outbox.serving): what one client may hold of a server, how long.
    serve_header_timeout: float = Field(
        default=10.0,
        description="seconds to send a whole request head (and an idle connection is kept)",
        json_schema_extra=_in("duration", "serving"),
    )
    serve_body_timeout: float = Field(
        default=30.0,
        description="seconds a request's whole body has after its head (then 408, closed)",
        json_schema_extra=_in("duration", "serving"),
    )
    serve_max_connections: int = Field(
        default=256,
        ge=1,
        description="connections one server holds at once; another is refused (503, closed)",
        json_schema_extra=_in("serving"),
    )
    serve_grace: float = Field(
        default=5.0,
        description="seconds the requests in hand get to finish after SIGTERM or SIGINT",
        json_schema_extra=_in("duration", "serving"),
    )
    # Off by default: a daemon that declares what it does not find turns a mistyped
    # name into a new queue nobody reads, and it looks healthy doing so.
    declare_topology: bool = Field(
        default=False,
        description="let a daemon declare the broker exchanges and queues itself instead of "
        "requiring the ones `outbox migrate --broker` created",
    )

    @field_validator("database_url")
    @classmethod
    def _postgres_scheme(cls, value: SecretStr) -> SecretStr:
        scheme = url_scheme(value.get_secret_value())
        if scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
            raise ValueError(
                f"database URL scheme {scheme!r} is not supported; use postgresql:// "
                "or postgresql+psycopg:// (psycopg 3)"
            )
        check_libpq_reads(value.get_secret_value())
        check_database_hosts(value.get_secret_value())
        return value

    @field_validator("amqp_url")
    @classmethod
    def _amqp_scheme(cls, value: SecretStr) -> SecretStr:
        urls = split_amqp_urls(value.get_secret_value())
        if len(urls) == 1:
            check_amqp_url(urls[0], first=True)
            return value
        for number, url in enumerate(urls, start=1):
            try:
                check_amqp_url(url, first=number == 1)
            except ValueError as problem:
                raise ValueError(
                    f"address {number} of {len(urls)}: {problem}; {_SEPARATE_THEM}"
                ) from None
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _seconds_as_text(cls, value: object, info: ValidationInfo) -> object:
        # pydantic reads "3600" as a malformed ISO 8601 duration, where the docs (and
        # every other duration setting) take a number of seconds.
        if isinstance(value, str) and info.field_name in _DURATIONS:
            with contextlib.suppress(ValueError):
                return float(value)
        return value

    @field_validator("*")
    @classmethod
    def _a_real_duration(cls, value: object, info: ValidationInfo) -> object:
        if value is None or info.field_name not in _DURATIONS:
            return value
        assert isinstance(value, float | int | timedelta)
        seconds = value.total_seconds() if isinstance(value, timedelta) else value
        if not math.isfinite(seconds):
            raise ValueError(f"{seconds} is no number of seconds: give {MIN_SECONDS:g} or more")
        if seconds < MIN_SECONDS:
            raise ValueError(
                f"{seconds:g} s is too short: give {MIN_SECONDS:g} or more (seconds; zero or "
                "less is no wait at all, and a loop that waits less than a millisecond only "
                "spins a core)"
            )
        return value

    @field_validator("callback_tolerance")
    @classmethod
    def _within_the_librarys_window(cls, value: float) -> float:
        # After _a_real_duration: a number of seconds by now. standardwebhooks refuses a
        # timestamp more than 5 minutes away whatever is asked of it.
        if value > 300.0:
            raise ValueError(
                f"{value:g} s is longer than the 300 s standardwebhooks allows: give 300 or less"
            )
        return value

    @field_validator("decision_lock_timeout")
    @classmethod
    def _a_decisions_wait(cls, value: float) -> float:
        # After _a_real_duration; outbox_record_decision refuses a longer one too.
        if value > MAX_DECISION_LOCK_TIMEOUT:
            raise ValueError(f"{value:g} s is too long: give {MAX_DECISION_LOCK_TIMEOUT:g} or less")
        return value

    @model_validator(mode="after")
    def _possible_together(self) -> Settings:
        lease_bounds = {name: getattr(self, name) for name in settings_in("lease_bounded")}
        problems = [
            *settings_checks.bounds_past_the_lease(self.lease_margin, lease_bounds),
            *settings_checks.retry_waits(self.publish_retry_initial, self.publish_retry_max),
            *settings_checks.history_windows(self.history_hot, self.history_retention),
        ]
        problems += tool_queue_problems(
            self.tool_queues, self.queue, self.dead_letter_queue, self.consume_queue
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def amqp_urls(self) -> list[str]:
        """The broker addresses, in the order a connect tries them first (secrets
        revealed: never log them; :func:`redact_amqp_urls` is for that)."""
        return split_amqp_urls(self.amqp_url.get_secret_value())

    @property
    def tool_queue_groups(self) -> dict[str, tuple[str, ...]]:
        """``OUTBOX_TOOL_QUEUES`` parsed: queue name -> its tools (empty: none)."""
        return parse_tool_queues(self.tool_queues)

    @property
    def sqlalchemy_url(self) -> str:
        return sqlalchemy_url(self.database_url.get_secret_value())

    @property
    def libpq_url(self) -> str:
        return libpq_url(self.database_url.get_secret_value())

    def to_environment(self) -> dict[str, str]:
        """Every set field as the ``OUTBOX_*`` variable :class:`Settings` reads back to
        an equal model; fields that are None are left out (unset is how they are None).

        Secrets are revealed: this is the environment of a child process, which needs
        them. Never log it.
        """
        return {
            setting_variable(name): environment_value(value)
            for name in type(self).model_fields
            if (value := getattr(self, name)) is not None
        }


def settings_in(group: str) -> tuple[str, ...]:
    """The settings tagged ``group`` (:data:`SETTING_GROUPS`), in the order
    :class:`Settings` declares them."""
    if group not in SETTING_GROUPS:
        raise ValueError(f"no setting group {group!r}: one of {', '.join(SETTING_GROUPS)}")
    return tuple(
        name
        for name, field in Settings.model_fields.items()
        if isinstance(field.json_schema_extra, dict)
        and group in cast("list[str]", field.json_schema_extra.get("groups", []))
    )


_DURATIONS = frozenset(settings_in("duration"))


def known_variables() -> frozenset[str]:
    """Every ``OUTBOX_*`` variable something in this project reads."""
    return frozenset(map(setting_variable, Settings.model_fields)) | frozenset(OTHER_VARIABLES)


def check_variables(environ: Mapping[str, str]) -> None:
    """Refuse every ``OUTBOX_*`` variable in ``environ`` that nothing reads, naming the
    known one nearest to it. Values are never shown: a mistyped name may hold a secret."""
    known = known_variables()
    problems = [
        unknown_variable(name, known, ENV_PREFIX)
        for name in sorted(environ)
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known
    ]
    if problems:
        raise ConfigurationError("; ".join(problems))


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit values (CLI flags) on top: what every
    command runs on. An ``OUTBOX_*`` variable nothing reads is refused first (a typo is
    the likeliest cause of anything else that looks wrong)."""
    from pydantic import ValidationError

    check_variables(os.environ)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(
            _problem(e) for e in exc.errors(include_input=False, include_url=False)
        )
        raise ConfigurationError(f"invalid settings: {problems}") from None


def _problem(error: Any) -> str:
    # Our own ValueErrors are whole sentences: without pydantic's "Value error, " prefix.
    cause = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
    text = str(cause) if cause is not None else error["msg"]
    if not error["loc"]:  # the combination check names its settings itself
        return text
    return f"{setting_variable('.'.join(map(str, error['loc'])))}: {text}"
