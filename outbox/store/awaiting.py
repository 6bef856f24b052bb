"""The agent's reads while it awaits outcomes (:mod:`outbox.awaiting`): where its
operations stand, and the notifications that say one changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from uuid import UUID

from outbox.store.runner import Plan, Row, Step


def listen_operation_changes() -> Plan[None]:
    """LISTEN on the channel every new operation event notifies (autocommit connection)."""
    yield Step("listen_operation_changes", {})


def operation_outcomes(operation_ids: Sequence[UUID]) -> Plan[list[Row]]:
    """The status rows of many operations in one round trip; ids with no visible
    operation are absent. :mod:`outbox.awaiting` folds each into an ``Outcome``."""
    rows = yield Step("operation_outcomes", {"ids": list(operation_ids)})
    return rows


def operation_outcomes_changed(known: Mapping[UUID, int | None]) -> Plan[list[Row]]:
    """:func:`operation_outcomes` for the operations in ``known`` (id -> the row version
    the caller read last, None if never) that changed since, with their new
    ``row_version``; an unchanged operation is absent, and so is an id with no operation."""
    rows = yield Step(
        "operation_outcomes_changed",
        {"ids": list(known), "row_versions": list(known.values())},
    )
    return rows


def archived_outcomes(wanted: Mapping[UUID, tuple[str, str] | None]) -> Plan[list[Row]]:
    """:func:`operation_outcomes` for operations the hot tables no longer hold (ask only
    for those): ``wanted`` maps each id to its ``(run_id, decision_key)`` when the caller
    knows them (two primary-key probes), else None (history gives them, by id). An
    archived operation recorded without a decision key comes back with ``state`` None:
    its outcome is not kept where an agent may read it. An id found nowhere is absent."""
    ids = list(wanted)
    keys = [wanted[operation_id] for operation_id in ids]
    rows = yield Step(
        "archived_outcomes",
        {
            "ids": ids,
            "run_ids": [key[0] if key else None for key in keys],
            "decision_keys": [key[1] if key else None for key in keys],
        },
    )
    return rows
