from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import UTC, datetime
from uuid import UUID

import psycopg
import pytest

from outbox import lifecycle
from outbox.errors import ConfigurationError, connect_failure
from outbox.lifecycle import format_event
from outbox.logs import JsonFormatter, LogfmtFormatter, log_fields
from outbox.settings import Settings, libpq_url, load_settings, redact_url, sqlalchemy_url
from outbox.text import logfmt_value, printable

from support import policy_cases
from support.logs import fields_of

PASSWORD_CANARY = "pw-CANARY-93f1"


@pytest.fixture(autouse=True)
def clean_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read OUTBOX_* variables; a developer's or CI's own values must not leak in.
    for name in list(os.environ):
        if name.upper().startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_defaults_point_at_local_postgres_and_rabbitmq() -> None:
    settings = Settings()

    assert settings.database_url.get_secret_value() == "postgresql+psycopg://localhost:5432/outbox"
    assert settings.amqp_url.get_secret_value() == "amqp://guest:guest@localhost:5672/"
    assert settings.log_format == "logfmt"


def test_environment_overrides_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:secret@db.internal:6543/ops")
    monkeypatch.setenv("OUTBOX_AMQP_URL", "amqps://app:secret@mq.internal:5671/prod")

    settings = load_settings()

    assert (
        settings.database_url.get_secret_value() == "postgresql://app:secret@db.internal:6543/ops"
    )
    assert settings.amqp_url.get_secret_value() == "amqps://app:secret@mq.internal:5671/prod"


def test_explicit_values_beat_the_environment_and_none_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://env-host/ops")
    monkeypatch.setenv("OUTBOX_AMQP_URL", "amqp://env-host/")

    settings = load_settings(database_url="postgresql://flag-host/ops", amqp_url=None)

    assert settings.database_url.get_secret_value() == "postgresql://flag-host/ops"
    assert settings.amqp_url.get_secret_value() == "amqp://env-host/"


def test_unsupported_database_scheme_names_the_variable_not_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"mysql://app:{PASSWORD_CANARY}@db.internal/ops")

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    message = str(info.value)
    assert "OUTBOX_DATABASE_URL" in message
    assert "'mysql' is not supported" in message
    assert "postgresql://" in message
    assert PASSWORD_CANARY not in message


def test_unsupported_amqp_scheme_names_the_variable_not_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", f"http://app:{PASSWORD_CANARY}@mq.internal/")

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    message = str(info.value)
    assert "OUTBOX_AMQP_URL" in message
    assert "amqp://" in message
    assert PASSWORD_CANARY not in message


def test_settings_repr_hides_credentials() -> None:
    settings = Settings(database_url=f"postgresql://app:{PASSWORD_CANARY}@db/ops")

    assert "guest:guest" not in repr(settings)
    assert PASSWORD_CANARY not in repr(settings)
    assert PASSWORD_CANARY not in str(settings)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("postgresql://app:s3cret@db:5432/ops", "postgresql://app:***@db:5432/ops"),
        ("amqp://guest:guest@localhost:5672/", "amqp://guest:***@localhost:5672/"),
        ("postgresql://app:p@ss@db/ops", "postgresql://app:***@db/ops"),
        ("postgresql://db:5432/ops", "postgresql://db:5432/ops"),
        ("postgresql://app@db/ops", "postgresql://app@db/ops"),
    ],
)
def test_redact_url_hides_only_the_password(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://app@db:5432/ops", "postgresql+psycopg://app@db:5432/ops"),
        ("postgres://app@db:5432/ops", "postgresql+psycopg://app@db:5432/ops"),
        ("postgresql+psycopg://app@db:5432/ops", "postgresql+psycopg://app@db:5432/ops"),
    ],
)
def test_sqlalchemy_url_names_the_psycopg_driver(url: str, expected: str) -> None:
    assert sqlalchemy_url(url) == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://app@db:5432/ops", "postgresql://app@db:5432/ops"),
        ("postgres://app@db:5432/ops", "postgresql://app@db:5432/ops"),
        ("postgresql://app@db:5432/ops", "postgresql://app@db:5432/ops"),
    ],
)
def test_libpq_url_drops_the_driver_suffix(url: str, expected: str) -> None:
    assert libpq_url(url) == expected


def test_settings_expose_both_url_forms() -> None:
    settings = Settings(database_url="postgres://app:pw@db/ops")

    assert settings.sqlalchemy_url == "postgresql+psycopg://app:pw@db/ops"
    assert settings.libpq_url == "postgresql://app:pw@db/ops"


def test_format_event_leaves_plain_values_bare_and_quotes_the_rest() -> None:
    line = format_event(
        "operation.outcome_unknown",
        {
            "id": "op_73",
            "attempt": 2,
            "retry": True,
            "reason": "deadline exceeded",
            "said": 'he said "no"',
            "path": "C:\\tmp x",
            "ref": None,
            "empty": "",
        },
    )

    assert line == (
        "operation.outcome_unknown id=op_73 attempt=2 retry=true "
        'reason="deadline exceeded" said="he said \\"no\\"" path="C:\\\\tmp x" '
        'ref="" empty=""'
    )


@pytest.mark.parametrize("value", ["a=b", "two words", "tab\there", "line\nbreak"])
def test_logfmt_value_quotes_anything_that_would_split_a_pair(value: str) -> None:
    quoted = logfmt_value(value)

    assert quoted.startswith('"')
    assert quoted.endswith('"')
    assert "\n" not in quoted


@pytest.mark.parametrize("value", ["timeout\n", "first\rsecond", "ends with\r\n"])
def test_format_event_is_one_line_whatever_the_value(value: str) -> None:
    line = format_event("operation.rejected", {"id": "op_1", "reason": value})

    assert len(line.splitlines()) == 1
    assert "\n" not in line
    assert "\r" not in line


def make_record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        name="outbox.test",
        level=logging.WARNING,
        pathname=__file__,
        lineno=1,
        msg=msg,
        args=args,
        exc_info=None,
    )
    record.__dict__.update(extra)
    return record


def record_with_traceback() -> logging.LogRecord:
    record = make_record("publish failed")
    try:
        raise RuntimeError("broker gone\nsecond line")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    return record


def test_logfmt_formatter_writes_one_line_with_the_message() -> None:
    line = LogfmtFormatter().format(make_record("claimed %s of %d\nrows", "batch one", 3))

    assert "\n" not in line
    assert " level=warning logger=outbox.test " in line
    assert line.endswith('msg="claimed batch one of 3\\nrows"')


def test_logfmt_formatter_keeps_a_traceback_on_the_same_line() -> None:
    line = LogfmtFormatter().format(record_with_traceback())

    assert "\n" not in line
    assert 'msg="publish failed" exc="Traceback' in line
    assert "RuntimeError: broker gone\\nsecond line" in line


def test_json_formatter_writes_one_json_object_with_message_and_extras() -> None:
    line = JsonFormatter().format(
        make_record("claimed %s", "batch\none", action="operation.attempted", attempt=2)
    )

    assert "\n" not in line
    payload = json.loads(line)
    assert payload["msg"] == "claimed batch\none"
    assert payload["level"] == "warning"
    assert payload["logger"] == "outbox.test"
    assert payload["action"] == "operation.attempted"
    assert payload["attempt"] == 2
    assert "lineno" not in payload


def test_logfmt_formatter_renders_the_fields_after_the_message_in_their_order() -> None:
    record = make_record(
        "lost its session", action="dispatcher.session_lost", peer="broker", retry_in=0.4
    )

    line = LogfmtFormatter().format(record)

    assert line.endswith(
        'msg="lost its session" action=dispatcher.session_lost peer=broker retry_in=0.4'
    )


def test_logfmt_formatter_quotes_a_field_that_would_split_the_line() -> None:
    record = make_record("x", reason='two words\nand a "quote"', flags={"a": [1, 2]})

    line = LogfmtFormatter().format(record)

    assert "\n" not in line
    assert 'reason="two words\\nand a \\"quote\\""' in line
    assert 'flags="{\\"a\\":[1,2]}"' in line


def logfmt_keys(line: str) -> list[str]:
    return re.findall(r'(?:^| )([A-Za-z0-9_.]+)=(?:"(?:[^"\\]|\\.)*"|\S*)', line)


def test_both_formats_write_the_same_keys_in_the_same_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("dispatcher.daemon")
    with caplog.at_level("INFO", logger="dispatcher.daemon"):
        log_fields(
            logger,
            logging.WARNING,
            "dispatcher.publish_failed",
            "publish failed",
            reason="nacked",
            rows=3,
            module="shadowed",
        )
        try:
            raise RuntimeError("gone")
        except RuntimeError:
            logger.exception("boom", extra={"action": "dispatcher.crashed"})

    for record in caplog.records:
        as_json = list(json.loads(JsonFormatter().format(record)))
        assert logfmt_keys(LogfmtFormatter().format(record)) == as_json
    assert list(json.loads(JsonFormatter().format(caplog.records[0]))) == [
        "ts",
        "level",
        "logger",
        "msg",
        "action",
        "reason",
        "rows",
        "module_",
    ]
    assert list(json.loads(JsonFormatter().format(caplog.records[1])))[-1] == "exc"


def test_log_fields_renames_a_field_logging_reserves_instead_of_failing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="outbox.test"):
        log_fields(logging.getLogger("outbox.test"), logging.INFO, "t.x", "x", name="n", msg="m")

    [record] = caplog.records
    assert record.name == "outbox.test"
    assert record.getMessage() == "x"
    assert fields_of(record) == {"name_": "n", "msg_": "m"}


def test_json_formatter_includes_the_traceback() -> None:
    line = JsonFormatter().format(record_with_traceback())

    assert "\n" not in line
    assert "RuntimeError: broker gone" in json.loads(line)["exc"]


def test_agent_completed_logs_one_lifecycle_line(caplog: pytest.LogCaptureFixture) -> None:
    from outbox import agent_completed

    with caplog.at_level("INFO", logger="outbox.lifecycle"):
        line = agent_completed("run_12", "refund_confirmed")

    assert line == "agent.completed id=run_12 outcome=refund_confirmed"
    [record] = caplog.records
    assert vars(record)["action"] == "agent.completed"
    assert fields_of(record) == {"id": "run_12", "outcome": "refund_confirmed"}
    assert (
        LogfmtFormatter()
        .format(record)
        .endswith('msg="agent completed" action=agent.completed id=run_12 outcome=refund_confirmed')
    )


def test_agent_completed_refuses_free_text_outcomes() -> None:
    from outbox import agent_completed

    with pytest.raises(ValueError, match="outcome must match"):
        agent_completed("run_12", "the customer said: thanks!")


# --- URLs libpq or the broker client cannot read: refused before any connection ------------


@pytest.mark.parametrize(
    "url",
    [
        # libpq quotes the offending part of the URI in its own message.
        f"postgresql://app:can ary {PASSWORD_CANARY}@127.0.0.1:5432/ops",
        f"postgresql://app:{PASSWORD_CANARY}@[127.0.0.1/ops",
        # libpq reads this password whole; urlsplit stops at the "#" and would redact
        # nothing.
        f"postgresql://app:pw#{PASSWORD_CANARY}@db/ops",
        # libpq takes the first "@", urlsplit the last: they disagree on the password.
        f"postgresql://app:pw@{PASSWORD_CANARY}@db/ops",
    ],
)
def test_a_database_url_libpq_cannot_read_is_refused_without_the_password(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    message = str(info.value)
    assert "OUTBOX_DATABASE_URL" in message
    assert "percent-encode" in message
    assert PASSWORD_CANARY not in message
    assert len(message.splitlines()) == 1


def test_a_percent_encoded_password_with_spaces_is_accepted() -> None:
    settings = load_settings(database_url="postgresql://app:can%20ary%23pw@db:5432/ops")

    assert settings.libpq_url == "postgresql://app:can%20ary%23pw@db:5432/ops"


@pytest.mark.parametrize(
    "url",
    [f"amqp://app:pw#{PASSWORD_CANARY}@mq:5672/", f"amqp://app:{PASSWORD_CANARY}@mq:port/"],
)
def test_an_amqp_url_the_client_cannot_read_is_refused_without_the_password(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", url)

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    assert "OUTBOX_AMQP_URL" in str(info.value)
    assert PASSWORD_CANARY not in str(info.value)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("postgresql://app:s3#cret@db/ops", "postgresql://app:***@db/ops"),
        ("postgresql://app:s3?cret@db/ops", "postgresql://app:***@db/ops"),
        ("postgresql://app:s3/cret@db/ops", "postgresql://app:***@db/ops"),
        (
            "postgresql://app@db/ops?sslmode=require&password=s3cret",
            "postgresql://app@db/ops?sslmode=require&password=***",
        ),
    ],
)
def test_redact_url_hides_passwords_urlsplit_does_not_see(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


# --- terminal-safe text --------------------------------------------------------------------


def test_printable_escapes_every_terminal_control_and_keeps_the_rest() -> None:
    hostile = "run\x1b[2J\x1b]0;owned\x07\rX\x9b31m\x85\u202eY\u2028\tZ\n\x7f"

    shown = printable(hostile)

    assert shown == (
        "run\\u001b[2J\\u001b]0;owned\\u0007\\rX\\u009b31m\\u0085\\u202eY\\u2028\\tZ\\n\\u007f"
    )
    assert all(character.isprintable() for character in shown)


def test_printable_leaves_ordinary_text_alone() -> None:
    text = 'Zoë pays €5 😀 "quoted" C:\\tmp'

    assert printable(text) == text


def test_logfmt_value_escapes_c1_controls_and_bidi_overrides_too() -> None:
    quoted = logfmt_value("a\x9b31mb\u202ec")

    assert quoted == '"a\\u009b31mb\\u202ec"'


@pytest.mark.parametrize(
    ("libpq_says", "cause"),
    [
        (
            'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
            'FATAL:  database "x" does not exist',
            "the database does not exist",
        ),
        ("connection failed: FATAL:  password authentication failed for user", "password"),
        (f'connection is bad: invalid integer value "{PASSWORD_CANARY}" for option', "Error"),
    ],
)
def test_a_connection_failure_is_named_in_our_words_never_libpqs(
    libpq_says: str, cause: str
) -> None:
    named = connect_failure(psycopg.OperationalError(libpq_says))

    assert cause in named
    assert PASSWORD_CANARY not in named
    assert '"' not in named


@pytest.mark.parametrize("formatter", [LogfmtFormatter, JsonFormatter])
def test_each_line_is_stamped_as_datetime_would_stamp_it_to_the_millisecond(
    formatter: type[logging.Formatter],
) -> None:
    # The formatter builds the text up to the second once per second; the stamp must
    # still be what datetime writes, across second boundaries and microsecond rounding.
    stamped = formatter()
    instants = [0.0, 1.9999996, 1.9994996, 1764806768.0009995, 1764806768.9999999]
    instants += [1764806768 + step / 997 for step in range(2500)]
    for created in instants:
        record = make_record("tick")
        record.created = created
        line = stamped.format(record)
        expected = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
        ts = json.loads(line)["ts"] if formatter is JsonFormatter else line.split()[0]
        assert ts in (expected, f"ts={expected}"), created


def test_a_message_is_escaped_alike_the_first_time_and_every_time_after() -> None:
    formatter = LogfmtFormatter()
    records = [make_record('two\nlines "quoted"') for _ in range(3)]
    for record in records:
        # One instant for all three: records made a millisecond apart would differ in
        # their timestamps, which is not what this compares.
        record.created, record.msecs = records[0].created, records[0].msecs

    lines = [formatter.format(record) for record in records]
    with_arguments = [formatter.format(make_record("claimed %s", batch)) for batch in ("a", "b")]

    assert len(set(lines)) == 1
    assert lines[0].endswith('msg="two\\nlines \\"quoted\\""')
    assert with_arguments[0].endswith('msg="claimed a"')
    assert with_arguments[1].endswith('msg="claimed b"')


def test_distinct_messages_and_loggers_never_grow_the_formatters_memory_past_its_bound() -> None:
    formatter = LogfmtFormatter()

    lines = [formatter.format(make_record(f"message {n}")) for n in range(2000)]
    named = []
    for n in range(2000):
        record = make_record("x")
        record.name = f"tenant {n}"
        named.append(formatter.format(record))

    assert lines[-1].endswith('msg="message 1999"')
    assert ' logger="tenant 1999" msg=x' in named[-1]
    assert len(formatter._messages) <= 512
    assert len(formatter._heads) <= 512


def test_a_lifecycle_line_names_the_operation_and_leaves_out_the_states_moved_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    operation = policy_cases.operation(id=UUID(int=7), tool_name="send_refund")

    with caplog.at_level("INFO", logger="outbox.lifecycle"):
        lifecycle.write(
            "operation.attempted",
            operation,
            {"from": "prepared", "to": "in_flight", "tool": "other", "attempt": 2, "name": "n"},
        )

    [record] = caplog.records
    assert (
        LogfmtFormatter()
        .format(record)
        .endswith(
            'msg="operation attempted" action=operation.attempted'
            " id=op_00000000-0000-0000-0000-000000000007 tool=send_refund attempt=2 name_=n"
        )
    )
