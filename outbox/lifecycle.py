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
import functools
import logging
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

from outbox.logs import log_fields, log_mapping
from outbox.models import Operation, display_operation_id
from outbox.text import Scalar as Scalar  # re-exported: event attributes are typed by it
from outbox.text import logfmt_value

logger = logging.getLogger("outbox.lifecycle")

_OUTCOME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


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


# The tool is already a field; the states moved between are in the event's name.
_NOT_LOGGED = frozenset({"tool", "from", "to"})


def write(name: str, operation: Operation, attributes: Mapping[str, Scalar]) -> None:
    if not logger.isEnabledFor(logging.INFO):
        # logging would drop the line anyway: not building its fields saves most of
        # what an unlogged line costs, on every decision recorded.
        return
    fields: dict[str, Scalar] = {
        "id": display_operation_id(operation.id),
        "tool": operation.tool_name,
    }
    for key, value in attributes.items():
        if key not in _NOT_LOGGED:
            fields[key] = value
    log_mapping(logger, logging.INFO, name, _sentence(name), fields)


@functools.lru_cache(maxsize=128)
def _sentence(name: str) -> str:
    """``operation.outcome_unknown`` -> ``operation outcome unknown``: the line's text."""
    return name.replace(".", " ").replace("_", " ")


def agent_completed(run_id: str, outcome: str) -> str:
    """Log that an agent run finished, in the lifecycle form; returns the line.

    ``outcome`` is a code (``refund_confirmed``), not free text: it lands in logs.
    """
    if not _OUTCOME.fullmatch(outcome):
        raise ValueError(f"outcome must match {_OUTCOME.pattern}")
    fields: dict[str, Scalar] = {"id": run_id, "outcome": outcome}
    log_fields(logger, logging.INFO, "agent.completed", _sentence("agent.completed"), **fields)
    return format_event("agent.completed", fields)
