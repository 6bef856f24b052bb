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
import time
from collections.abc import Mapping
from typing import Literal, TextIO

from outbox.text import Scalar, logfmt_value

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def log_fields(
    logger: logging.Logger, level: int, action: str, text: str, **fields: object
) -> None:
    """Log one line: ``text`` for a person, ``action`` and ``fields`` as data. A field
    named like a LogRecord attribute (``name``, ``module``...) gets a trailing ``_``:
    logging refuses to overwrite those."""
    log_mapping(logger, level, action, text, fields)


def log_mapping(
    logger: logging.Logger, level: int, action: str, text: str, fields: Mapping[str, object]
) -> None:
    """:func:`log_fields` with the fields already in a mapping, for a caller that built
    them anyway (a lifecycle line) and so need not build them twice."""
    extra: dict[str, object] = {"action": action}
    for key, value in fields.items():
        extra[f"{key}_" if key in _STANDARD else key] = value
    logger.log(level, text, extra=extra, stacklevel=3)


def _fields(record: logging.LogRecord) -> list[tuple[str, object]]:
    return [(key, value) for key, value in record.__dict__.items() if key not in _STANDARD]


def _scalar(value: object) -> Scalar:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, default=str, separators=(",", ":"))


def _logfmt_field(value: object) -> str:
    # An int is always bare (digits and a minus sign): most fields are counters, and
    # skipping the pattern for them is a measurable share of a lifecycle line's cost.
    if type(value) is int:
        return str(value)
    return logfmt_value(_scalar(value))


class _Clock:
    """Timestamps as ``2026-12-04T02:06:08.123+00:00``: the part down to the second
    is the same for every line written in that second, so it is built once per second
    instead of through a datetime for every line."""

    def __init__(self) -> None:
        # One tuple, replaced whole: a reader never pairs one second with another's text.
        self._last: tuple[int, str] = (-1, "")

    def stamp(self, created: float) -> str:
        # Rounded to the microsecond first, then cut to the millisecond, as
        # datetime.fromtimestamp(...).isoformat(timespec="milliseconds") does.
        second = int(created)
        micro = round((created - second) * 1_000_000)
        if micro >= 1_000_000:
            second, micro = second + 1, micro - 1_000_000
        last = self._last
        if last[0] != second:
            last = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._last = last
        return f"{last[1]}.{micro // 1000:03d}+00:00"


# How many rendered heads and messages a formatter keeps: texts the code logs again and
# again are few, and no stream of distinct ones may grow a process's memory.
_CACHED_AT_MOST = 512


class LogfmtFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._clock = _Clock()
        # ``level=info logger=outbox.lifecycle``: the same few pairs on every line.
        self._heads: dict[tuple[str, str], str] = {}
        self._messages: dict[str, str] = {}

    def format(self, record: logging.LogRecord) -> str:
        head = self._heads.get((record.levelname, record.name))
        if head is None:
            head = f"level={record.levelname.lower()} logger={logfmt_value(record.name)}"
            # Bounded like the messages: a program may name loggers after what it serves.
            if len(self._heads) < _CACHED_AT_MOST:
                self._heads[(record.levelname, record.name)] = head
        parts = [f"ts={self._clock.stamp(record.created)}", head, self._message(record)]
        parts.extend(f"{key}={_logfmt_field(value)}" for key, value in _fields(record))
        if record.exc_info:
            parts.append(f"exc={logfmt_value(self.formatException(record.exc_info))}")
        return " ".join(parts)

    def _message(self, record: logging.LogRecord) -> str:
        # A message without arguments is one of the few texts the code logs again and
        # again (``operation attempted``): its escaped form is kept, up to a bound so
        # that no stream of distinct texts can grow the cache.
        if record.args or not isinstance(record.msg, str):
            return f"msg={logfmt_value(record.getMessage())}"
        message = self._messages.get(record.msg)
        if message is None:
            message = f"msg={logfmt_value(record.msg)}"
            if len(self._messages) < _CACHED_AT_MOST:
                self._messages[record.msg] = message
        return message


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._clock = _Clock()

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": self._clock.stamp(record.created),
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


class _CurrentStderr(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is when a line is written, not to the one there
    when logging was configured (as logging's own last-resort handler does). A host that
    swaps stderr, a test runner capturing it or a wrapper that redirects it, would
    otherwise leave every later line aimed at a closed file, each one a traceback."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        # StreamHandler.setStream assigns here; the stream is always sys.stderr.
        pass


def configure_logging(level: str = "INFO", fmt: Literal["logfmt", "json"] = "logfmt") -> None:
    handler = _CurrentStderr()
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
