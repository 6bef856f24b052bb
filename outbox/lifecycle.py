"""Lifecycle events in the log, one line per transition, in the form of docs/design.md section 10:

    operation.outcome_unknown id=op_3f2a... tool=send_refund reason=deadline_exceeded

The same event is written to ``operation_events`` by the statement that makes the
transition. The log line is emitted when that statement succeeds, inside the caller's
transaction: a transaction that later rolls back leaves a line with no row behind it,
which ``outbox ops show`` (the table) settles.

Attributes are built by the runtime from ids, codes and counters only; tool inputs,
secrets and user text never reach them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

from outbox.models import Operation, display_operation_id

logger = logging.getLogger("outbox.lifecycle")

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+-]+$")
_OUTCOME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")

Scalar = str | int | float | bool | None

# What a terminal acts on rather than shows: C0 and C1 controls (ESC starts a sequence
# that can move the cursor, clear the screen or retitle the window; C1 0x9b is a
# one-byte CSI), DEL, the bidirectional overrides that reorder what is displayed, and
# the Unicode line and paragraph separators. Escaped as JSON would escape them, so
# escaped JSON text stays valid JSON.
_CONTROLS = {
    **{chr(code): f"\\u{code:04x}" for code in [*range(0x20), *range(0x7F, 0xA0)]},
    **{
        chr(code): f"\\u{code:04x}"
        for code in [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    },
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
_PRINTABLE = str.maketrans(_CONTROLS)
# Quoted values stay on one line: a value must never be able to start a forged line.
_ESCAPES = str.maketrans({**_CONTROLS, "\\": "\\\\", '"': '\\"'})


def printable(value: object) -> str:
    """``value`` as text safe to print on an operator's terminal: every control
    character escaped, everything else (accents, emoji, quotes) as it is.

    For human-readable output of anything a user, an agent or a provider chose (run
    ids, names, reasons, error text, inputs); JSON output needs no more than JSON's own
    escaping. Backslashes are left alone so that escaped JSON stays JSON: the output
    cannot act on the terminal, though a literal ``\\u001b`` reads like an escaped one.
    """
    return str(value).translate(_PRINTABLE)


def logfmt_value(value: Scalar) -> str:
    text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if _BARE.fullmatch(text):
        return text
    escaped = text.translate(_ESCAPES)
    return f'"{escaped}"'


def format_event(name: str, attributes: Mapping[str, Scalar]) -> str:
    return " ".join([name, *(f"{key}={logfmt_value(value)}" for key, value in attributes.items())])


Line = tuple[str, Operation, dict[str, Scalar]]
# Set while a store plan runs on a connection whose commit can be observed: lines wait
# there for the commit (see outbox.store.runner), so a rolled-back decision leaves no line.
_waiting_for_commit: ContextVar[list[Line] | None] = ContextVar(
    "outbox_lifecycle_waiting_for_commit", default=None
)


def emit(name: str, operation: Operation, attributes: Mapping[str, Scalar]) -> None:
    """Log one lifecycle line, or hold it for the transaction's commit when the store
    runs the plan on a connection whose commit it can observe."""
    waiting = _waiting_for_commit.get()
    if waiting is not None:
        waiting.append((name, operation, dict(attributes)))
        return
    write(name, operation, attributes)


@contextlib.contextmanager
def held() -> Iterator[list[Line]]:
    """Collect the lines emitted in this block instead of writing them."""
    lines: list[Line] = []
    token = _waiting_for_commit.set(lines)
    try:
        yield lines
    finally:
        _waiting_for_commit.reset(token)


def write_all(lines: list[Line]) -> None:
    for name, operation, attributes in lines:
        write(name, operation, attributes)


def write(name: str, operation: Operation, attributes: Mapping[str, Scalar]) -> None:
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
