"""Log lines as data, shared by every entry point: logfmt (default) or JSON lines on stderr.

A line carries a short text for a person and, as ``extra``, an ``action`` and fields for
machines. Both formats write the same keys: ``ts``, ``level``, ``logger``, ``msg``, then
the record's fields in the order they were given, then ``exc``. Fields hold ids, codes,
counters and class names only; inputs, URLs with passwords and user text never do.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Literal

from outbox.text import Scalar, logfmt_value

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def log_fields(
    logger: logging.Logger, level: int, action: str, text: str, **fields: object
) -> None:
    """Log one line: ``text`` for a person, ``action`` and ``fields`` as data. A field
    named like a LogRecord attribute (``name``, ``module``...) gets a trailing ``_``:
    logging refuses to overwrite those."""
    extra: dict[str, object] = {"action": action}
    extra.update((f"{key}_" if key in _STANDARD else key, value) for key, value in fields.items())
    logger.log(level, text, extra=extra, stacklevel=2)


def _fields(record: logging.LogRecord) -> Iterator[tuple[str, object]]:
    return ((key, value) for key, value in record.__dict__.items() if key not in _STANDARD)


def _scalar(value: object) -> Scalar:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, default=str, separators=(",", ":"))


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={_timestamp(record)}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={logfmt_value(record.getMessage())}",
            *(f"{key}={logfmt_value(_scalar(value))}" for key, value in _fields(record)),
        ]
        if record.exc_info:
            parts.append(f"exc={logfmt_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update(_fields(record))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


# Libraries whose INFO lines carry what must never be logged (httpx logs every request
# URL, which may hold user data or an API key) or whose ERROR tracebacks fill a log
# during an ordinary broker restart that the daemons already report in one line.
THIRD_PARTY_LOGGERS = (
    "httpx",
    "httpcore",
    "aiormq",
    "aio_pika",
    "pamqp",
    "psycopg",
    "sqlalchemy",
    "asyncio",
    "urllib3",
)
OWN_LOGGERS = ("outbox", "dispatcher", "consumer")


class ThirdPartyTracebacks(logging.Filter):
    """A third-party record keeps its message and the exception's type, not the
    traceback: frames and exception messages may quote inputs or connection strings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not record.name.startswith(OWN_LOGGERS):
            error = record.exc_info[1]
            if error is not None:
                record.msg = f"{record.getMessage()} error={type(error).__name__}"
                record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def configure_logging(level: str = "INFO", fmt: Literal["logfmt", "json"] = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    handler.addFilter(ThirdPartyTracebacks())
    # Neither format prints the caller's file and line, the thread or the process, and
    # logging looks each of them up for every record unless told not to: about a third
    # of what a lifecycle line costs, paid several times per operation.
    logging._srcfile = None  # the documented switch for it
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # WARNING at the least, even when the runtime itself logs at DEBUG.
    third_party_level = max(logging.WARNING, logging.getLevelName(level))
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(third_party_level)
