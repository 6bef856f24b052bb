"""OUTBOX_DATABASE_URL in libpq's multi-host form: parsed, checked host by host and named
by place, redacted, and rewritten for SQLAlchemy, which reads one host per URL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from pydantic import SecretStr

from outbox.errors import ConfigurationError
from outbox.settings import Settings, load_settings
from outbox.urls import DatabaseHost, database_hosts, redact_url, sqlalchemy_url

MULTI = "postgresql://app:s3cr%40t@db-a:5432,db-b:6432,[::1]:5433/outbox?target_session_attrs=read-write"


def test_the_hosts_come_in_the_order_libpq_tries_them() -> None:
    assert database_hosts(MULTI) == [
        DatabaseHost("db-a", 5432),
        DatabaseHost("db-b", 6432),
        DatabaseHost("::1", 5433),
    ]
    assert database_hosts("postgresql://u@one/db") == [DatabaseHost("one", None)]


def test_a_multi_host_url_is_accepted_and_redacted() -> None:
    settings = Settings(database_url=SecretStr(MULTI))

    assert settings.libpq_url == MULTI
    assert redact_url(settings.libpq_url) == (
        "postgresql://app:***@db-a:5432,db-b:6432,[::1]:5433/outbox?target_session_attrs=read-write"
    )
    assert "s3cr" not in redact_url(settings.sqlalchemy_url)


def test_sqlalchemy_gets_the_hosts_as_query_parameters() -> None:
    url = sqlalchemy_url(MULTI)

    parsed = sa.make_url(url)
    assert parsed.drivername == "postgresql+psycopg"
    assert parsed.query["host"] == ("db-a:5432", "db-b:6432", "[::1]:5433")
    assert parsed.query["target_session_attrs"] == "read-write"
    assert parsed.password == "s3cr@t"
    assert parsed.database == "outbox"
    # One host stays as it was.
    assert sqlalchemy_url("postgresql://u@h:5432/db") == "postgresql+psycopg://u@h:5432/db"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            "postgresql://u:pw@a:5432,b:99999/db?target_session_attrs=read-write",
            "host 2 of 2: the port is not a number from 1 to 65535",
        ),
        (
            "postgresql://u:pw@a:5432,:5433/db?target_session_attrs=read-write",
            "host 2 of 2 is empty",
        ),
        (
            "postgresql://u:pw@a:5432,b:5432/db",
            "2 hosts without ?target_session_attrs=read-write",
        ),
        (
            "postgresql://u:pw@a:5432,b:5432/db?target_session_attrs=any",
            "2 hosts without ?target_session_attrs=read-write",
        ),
    ],
    ids=["bad-port", "empty-host", "no-session-attrs", "any-host"],
)
def test_a_bad_host_list_is_refused_naming_the_place_never_the_password(
    monkeypatch: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    with pytest.raises(ConfigurationError) as refused:
        load_settings()

    assert problem in str(refused.value)
    assert "pw" not in str(refused.value)


def test_primary_is_as_good_as_read_write() -> None:
    url = "postgresql://u@a,b/db?target_session_attrs=primary"
    assert Settings(database_url=SecretStr(url)).libpq_url == url
