"""Reading what was logged as data: a record's action and fields, or the lines exactly
as the default formatter writes them (fields included, which rendered(caplog) leaves out)."""

from __future__ import annotations

import logging
from typing import cast

import pytest

from outbox.lifecycle import format_event
from outbox.logs import LogfmtFormatter
from outbox.text import Scalar


def records_of(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if getattr(record, "action", None) == action]


def logged(caplog: pytest.LogCaptureFixture, action: str, **fields: object) -> bool:
    """Whether a line with this action and at least these field values was logged."""
    return any(
        all(getattr(record, key, None) == value for key, value in fields.items())
        for record in records_of(caplog, action)
    )


def rendered(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record as its logfmt line: what an operator's log would hold."""
    formatter = LogfmtFormatter()
    return "\n".join(formatter.format(record) for record in caplog.records)


_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "action"}


def fields_of(record: logging.LogRecord) -> dict[str, object]:
    """The fields a line carries as data, in the order they were given."""
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


def lifecycle_lines(caplog: pytest.LogCaptureFixture, action: str | None = None) -> list[str]:
    """Lifecycle records in their documented form: ``operation.prepared id=op_... tool=...``."""
    lines = []
    for record in caplog.records:
        name = vars(record).get("action")
        if record.name == "outbox.lifecycle" and action in (None, name):
            fields = cast("dict[str, Scalar]", fields_of(record))
            lines.append(format_event(str(name), fields))
    return lines
