"""Lifecycle events in the log, one line per transition, in the form of DESIGN.md section 10:

    operation.outcome_unknown id=op_3f2a... tool=send_refund reason=deadline_exceeded

The same event is written to ``operation_events`` by the statement that makes the
transition. The log line is emitted when that statement succeeds, inside the caller's
transaction: a transaction that later rolls back leaves a line with no row behind it,
which ``outbox ops show`` (the table) settles.

Attributes are built by the runtime from ids, codes and counters only; tool inputs,
secrets and user text never reach them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from outbox.models import Operation, display_operation_id

logger = logging.getLogger("outbox.lifecycle")

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+-]+$")
_OUTCOME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")

Scalar = str | int | float | bool | None

# Quoted values stay on one line: a value must never be able to start a forged line.
_ESCAPES = str.maketrans(
    {
        **{chr(code): f"\\x{code:02x}" for code in [*range(0x20), 0x7F]},
        "\\": "\\\\",
        '"': '\\"',
        "\n": "\\n",
        "\r": "\\r",
        "\t": "\\t",
    }
)


def logfmt_value(value: Scalar) -> str:
    text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if _BARE.fullmatch(text):
        return text
    escaped = text.translate(_ESCAPES)
    return f'"{escaped}"'


def format_event(name: str, attributes: Mapping[str, Scalar]) -> str:
    return " ".join([name, *(f"{key}={logfmt_value(value)}" for key, value in attributes.items())])


def emit(name: str, operation: Operation, attributes: Mapping[str, Scalar]) -> None:
    fields: dict[str, Scalar] = {
        "id": display_operation_id(operation.id),
        "tool": operation.tool_name,
    }
    fields.update((k, v) for k, v in attributes.items() if k not in ("tool", "from", "to"))
    logger.info(
        format_event(name, fields),
        extra={"action": name, "operation_id": str(operation.id), "event_attributes": fields},
    )


def agent_completed(run_id: str, outcome: str) -> str:
    """Log that an agent run finished, in the lifecycle form; returns the line.

    ``outcome`` is a code (``refund_confirmed``), not free text: it lands in logs.
    """
    if not _OUTCOME.fullmatch(outcome):
        raise ValueError(f"outcome must match {_OUTCOME.pattern}")
    line = format_event("agent.completed", {"id": run_id, "outcome": outcome})
    logger.info(line, extra={"action": "agent.completed", "run_id": run_id})
    return line
