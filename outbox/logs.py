"""Log setup shared by every entry point: logfmt (default) or JSON lines on stderr."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

from outbox.lifecycle import logfmt_value

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line = (
            f"ts={stamp} level={record.levelname.lower()} logger={record.name} "
            f"msg={logfmt_value(record.getMessage())}"
        )
        if record.exc_info:
            line += f" exc={logfmt_value(self.formatException(record.exc_info))}"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update(
            (key, value) for key, value in record.__dict__.items() if key not in _STANDARD
        )
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
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # WARNING at the least, even when the runtime itself logs at DEBUG.
    third_party_level = max(logging.WARNING, logging.getLevelName(level))
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(third_party_level)
