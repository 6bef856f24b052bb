"""One settings model for every process, read from ``OUTBOX_*`` environment variables.

CLI flags override the environment; the CLI builds its flags from these fields, so a
flag and its variable can never drift apart.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.errors import ConfigurationError

ENV_PREFIX = "OUTBOX_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    database_url: SecretStr = Field(
        default=SecretStr("postgresql+psycopg://localhost:5432/outbox"),
        description="Postgres URL (postgresql:// or postgresql+psycopg://)",
    )
    amqp_url: SecretStr = Field(
        default=SecretStr("amqp://guest:guest@localhost:5672/"),
        description="RabbitMQ URL",
    )
    exchange: str = Field(
        default="outbox", description="topic exchange operations are published to"
    )
    queue: str = Field(default="outbox.operations", description="quorum queue consumers read")
    dead_letter_exchange: str = Field(
        default="outbox.dead", description="exchange that takes messages past the delivery limit"
    )
    dead_letter_queue: str = Field(
        default="outbox.operations.dead", description="queue that keeps dead-lettered messages"
    )
    delivery_limit: int = Field(
        default=5, ge=1, description="deliveries of one message before it is dead-lettered"
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
    poll_interval: float = Field(
        default=1.0, gt=0, description="seconds between scans when no notification arrives"
    )
    publish_timeout: float = Field(
        default=10.0, gt=0, description="seconds to wait for a batch's broker confirms"
    )
    publish_retry_initial: float = Field(
        default=1.0, gt=0, description="seconds before a failed publish is retried (doubles)"
    )
    publish_retry_max: float = Field(
        default=60.0, gt=0, description="longest wait before a failed publish is retried"
    )
    retention: timedelta = Field(
        default=timedelta(days=7),
        description="how long published rows are kept (seconds or ISO 8601)",
    )
    tools: str = Field(
        default="",
        description="comma-separated modules exposing a tools Registry (consumer, contracts)",
    )
    prefetch: int = Field(
        default=16, ge=1, le=1000, description="deliveries a consumer works on at once"
    )
    lease_margin: float = Field(
        default=10.0,
        gt=0,
        description="seconds a claim's lease outlives the tool's deadline",
    )
    # A database link that goes silent (NAT timeout, failover, cable) must cost seconds,
    # never a session idle in its transaction holding row locks forever. Unset values are
    # derived from the lease margin (see DatabaseBounds): a stuck commit is cut before
    # the lease runs out, so the reconciler can always take the operation over.
    db_transaction_timeout: float | None = Field(
        default=None,
        gt=0,
        description="seconds a daemon's transaction may take before its connection is cut "
        "(default: half the lease margin)",
    )
    db_statement_timeout: float | None = Field(
        default=None,
        gt=0,
        description="server-side statement_timeout, seconds (default: the transaction timeout)",
    )
    db_lock_timeout: float | None = Field(
        default=None,
        gt=0,
        description="server-side lock_timeout, seconds (default: half the transaction timeout)",
    )
    db_idle_in_transaction_timeout: float | None = Field(
        default=None,
        gt=0,
        description="server-side idle_in_transaction_session_timeout, seconds (default: the "
        "transaction timeout; the dispatcher adds its publish timeout)",
    )
    db_tcp_user_timeout: float = Field(
        default=10.0,
        gt=0,
        description="libpq tcp_user_timeout, seconds: how long sent data may go "
        "unacknowledged before the client drops the link",
    )
    db_keepalives_idle: int = Field(
        default=5, ge=1, description="libpq keepalives_idle: seconds of silence before a probe"
    )
    db_keepalives_interval: int = Field(
        default=2, ge=1, description="libpq keepalives_interval: seconds between probes"
    )
    db_keepalives_count: int = Field(
        default=3,
        ge=1,
        description="libpq keepalives_count: probes lost before the link is dropped",
    )
    db_connect_timeout: int = Field(default=10, ge=2, description="libpq connect_timeout, seconds")
    reconcile_interval: float = Field(
        default=0.5, gt=0, description="seconds between reconciler scans"
    )
    requeue_stale_after: timedelta = Field(
        default=timedelta(minutes=10),
        description="a prepared operation no message reached for this long is queued again",
    )
    reconcile_batch: int = Field(
        default=50, ge=1, le=1000, description="operations one reconciler scan takes"
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

    @field_validator("database_url")
    @classmethod
    def _postgres_scheme(cls, value: SecretStr) -> SecretStr:
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
            raise ValueError(
                f"database URL scheme {scheme!r} is not supported; use postgresql:// "
                "or postgresql+psycopg:// (psycopg 3)"
            )
        return value

    @field_validator("amqp_url")
    @classmethod
    def _amqp_scheme(cls, value: SecretStr) -> SecretStr:
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("amqp", "amqps"):
            raise ValueError(
                f"AMQP URL scheme {scheme!r} is not supported; use amqp:// or amqps://"
            )
        return value

    @property
    def sqlalchemy_url(self) -> str:
        return sqlalchemy_url(self.database_url.get_secret_value())

    @property
    def libpq_url(self) -> str:
        return libpq_url(self.database_url.get_secret_value())


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit values (CLI flags) on top."""
    from pydantic import ValidationError

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(
            f"{ENV_PREFIX}{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise ConfigurationError(f"invalid settings: {problems}") from None


def sqlalchemy_url(url: str) -> str:
    """The URL with the psycopg 3 driver named, as SQLAlchemy wants it."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres"):
        parts = parts._replace(scheme="postgresql+psycopg")
    return urlunsplit(parts)


def libpq_url(url: str) -> str:
    """The URL without a SQLAlchemy driver suffix, as psycopg and libpq want it."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql+psycopg", "postgres"):
        parts = parts._replace(scheme="postgresql")
    return urlunsplit(parts)


def redact_url(url: str) -> str:
    """The URL with any password replaced, fit for a log line or an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def database_name(url: str) -> str:
    name = urlsplit(url).path.lstrip("/")
    if not name:
        raise ConfigurationError("the database URL names no database (add /outbox to it)")
    return name


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
