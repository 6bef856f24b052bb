"""Reading what was logged as data: a record's action and fields, or the lines exactly
as the default formatter writes them (fields included, which rendered(caplog) leaves out)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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


class Ran(logging.Handler):
    """Every statement the store ran in this test, from its DEBUG line per statement
    (logger ``outbox.store``: query name and database user, never parameters). The
    runner is the one place SQL runs, so its lines see every statement a component
    sends, and which user sent it. A handler of its own on that logger: the CLI
    replaces the root logger's handlers, caplog's among them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if vars(record).get("action") == "store.statement":
            self.records.append(record)

    def rows(self) -> list[tuple[str, int]]:
        """Each statement's query name and how many rows it returned: what its caller
        held at once."""
        return [(str(vars(r)["query"]), int(vars(r)["rows"])) for r in self.records]

    def by(self, user: str | None) -> set[str]:
        return {str(vars(r)["query"]) for r in self.records if vars(r)["user"] == user}


@contextmanager
def statements_seen() -> Iterator[Ran]:
    """Every statement the store runs meanwhile, whatever the CLI does to the root
    logger."""
    seen = Ran()
    statements = logging.getLogger("outbox.store")
    level = statements.level
    statements.setLevel(logging.DEBUG)
    statements.addHandler(seen)
    try:
        yield seen
    finally:
        statements.removeHandler(seen)
        statements.setLevel(level)
