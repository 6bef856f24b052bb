"""``outbox ops show``: one operation as a person on call reads it, as text and as JSON:
its facts, its validated input, one page of its timeline (:mod:`outbox.operator.timeline`)
and the provider callbacks about it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import ApprovalCheck, Callback, Operation
from outbox.operator import timeline
from outbox.operator.render import (
    callback_json,
    callbacks_text,
    event_attributes_text,
    instant,
    intent_text,
    stamp,
)
from outbox.store import EventsPage
from outbox.text import printable


def show_text(
    operation: Operation,
    page: EventsPage,
    approval: str | None,
    key: str,
    callbacks: Sequence[Callback] = (),
    archived: str | None = None,
) -> str:
    """``archived``: when and how an operation only history holds left the hot tables."""
    header = [
        ("operation", operation.display_id),
        ("run", operation.run_id),
        ("tool", f"{operation.tool_name} v{operation.tool_version}"),
        ("side effect", str(operation.side_effect)),
        ("state", str(operation.state)),
        *([("archived", archived)] if archived else []),
        ("fingerprint", keyed_fingerprint(key, operation.input_fingerprint)),
        ("input", intent_text(operation.input)),
        ("attempts", str(operation.attempts)),
        ("reconciles", str(operation.reconcile_attempts)),
        ("provider ref", operation.provider_reference or "-"),
        ("last error", operation.last_error_class or "-"),
        ("approval", approval or "not required"),
        ("created", stamp(operation.created_at)),
        ("updated", stamp(operation.updated_at)),
    ]
    width = max(len(label) for label, _ in header)
    lines = [f"{label.ljust(width)}  {printable(value)}" for label, value in header]
    command = f"outbox ops show {operation.display_id}"
    earlier, later = timeline.earlier_hint(command, page), timeline.later_hint(command, page)
    lines += ["", f"timeline ({timeline.heading(page)})"]
    lines += [f"  {earlier}"] if earlier else []
    names = [printable(event.name) for event in page.events]
    name_width = max(map(len, names), default=0)
    for event, name in zip(page.events, names, strict=True):
        when, name = stamp(event.created_at), name.ljust(name_width)
        text = event_attributes_text(event.name, event.attributes)
        lines.append(f"  {when}  {name}  {text}".rstrip())
    lines += [f"  {later}"] if later else []
    lines += ["", callbacks_text(callbacks)]
    return "\n".join(lines)


def show_json(
    operation: Operation,
    page: EventsPage,
    check: ApprovalCheck | None,
    decided_by: str | None,
    key: str,
    callbacks: Sequence[Callback] = (),
    archived: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``ops show --json``: what the text shows, as JSON (the input and the attributes
    as they are stored, escaped by JSON; an unreadable one as its marker), with the
    cursors of the pages before and after the events shown. ``archived`` is null for an
    operation the hot tables hold, and says when one only history holds moved there."""
    return {
        "id": operation.display_id,
        "run_id": operation.run_id,
        "decision_key": operation.decision_key,
        "tool": operation.tool_name,
        "tool_version": operation.tool_version,
        "side_effect": str(operation.side_effect),
        "state": str(operation.state),
        "fingerprint": keyed_fingerprint(key, operation.input_fingerprint),
        "input": operation.input,
        "attempts": operation.attempts,
        "reconcile_attempts": operation.reconcile_attempts,
        "first_attempt_at": instant(operation.first_attempt_at),
        "provider_reference": operation.provider_reference,
        "last_error_class": operation.last_error_class,
        "effect_possible": operation.effect_possible,
        "requires_approval": operation.requires_approval,
        "approval": None
        if check is None
        else {"status": str(check.status), "reason": check.reason, "decided_by": decided_by},
        "created_at": instant(operation.created_at),
        "updated_at": instant(operation.updated_at),
        **timeline.page_json(
            page,
            lambda event: {
                "id": event.id,
                "at": instant(event.created_at),
                "name": event.name,
                "attributes": event.attributes,
            },
        ),
        "callbacks": [callback_json(c) for c in callbacks],
        "archived": archived,
    }
