"""The consumer's log lines and span attributes, shared by the worker and the reconciler."""

from __future__ import annotations

import logging
from typing import Any

from outbox import tracing
from outbox.contracts import ToolContract
from outbox.fingerprint_key import keyed_fingerprint
from outbox.logs import log_fields
from outbox.models import Operation

# One logger for the whole consumer, under the name every one of its lines has carried
# (logger=consumer.worker) since the reconciler lived in the worker: filters match on it.
logger = logging.getLogger("consumer.worker")


def log(level: int, action: str, text: str, **fields: object) -> None:
    """One line as data (see :func:`outbox.logs.log_fields`)."""
    log_fields(logger, level, action, text, **fields)


def span_attributes(
    operation: Operation, contract: ToolContract[Any], fingerprint_key: str | None
) -> dict[str, tracing.AttributeValue]:
    # Ids, counters and the keyed short fingerprint only: never the tool input.
    attributes: dict[str, tracing.AttributeValue] = {
        "outbox.operation_id": str(operation.id),
        "outbox.tool": contract.name,
        "outbox.tool_version": contract.version,
        "outbox.attempt": operation.attempts,
    }
    if fingerprint_key is not None:
        attributes["outbox.fingerprint"] = keyed_fingerprint(
            fingerprint_key, operation.input_fingerprint
        )
    return attributes
