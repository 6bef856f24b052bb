"""Reading the console's forms, without I/O: which field holds what, and the choices a
form offers. Whether a value is acceptable is the operator layer's judgement
(:mod:`outbox.operator.input`, the rules ``outbox ops`` and ``outbox approvals`` meet);
this module refuses only what no form of the console would submit."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from outbox.contracts import Registry
from outbox.errors import InputRefused
from outbox.models import ApprovalDecision, Operation
from outbox.operator.dlq_discard import Selection
from outbox.operator.input import DEFAULT_APPROVAL_TTL
from outbox.operator.rules import Resolution, refusal

APPROVAL_TTLS: dict[str, timedelta] = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "4h": timedelta(hours=4),
    "1d": timedelta(days=1),
}
# The choice the grant form preselects: the operator layer's default, by its name here.
DEFAULT_TTL_CHOICE = next(
    name for name, ttl in APPROVAL_TTLS.items() if ttl == DEFAULT_APPROVAL_TTL
)
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class FormRefused(InputRefused):
    """A submitted form the console will not act on; its message says why."""


@dataclass(frozen=True)
class Choice:
    value: str
    label: str
    refused: str | None
    """Why this resolution is not offered, or None when it is."""


def resolution_choices(registry: Registry | None, operation: Operation) -> list[Choice]:
    """The three resolutions, each with why it is not offered (the operator rules'
    answer, the one ``outbox ops resolve`` gets)."""
    return [
        Choice(value=str(r), label=r.label, refused=refusal(r, registry, operation))
        for r in Resolution
    ]


def resolution(value: object) -> Resolution:
    """The submitted resolution: one of the values ``outbox ops resolve`` records."""
    if isinstance(value, str) and value in set(Resolution):
        return Resolution(value)
    raise FormRefused(f"choose one of {', '.join(Resolution)}")


def text(value: object) -> str | None:
    """A text field as submitted, for the operator layer to judge; None when absent
    (the form reader refuses files before a field is read)."""
    return value if isinstance(value, str) else None


def decision(value: object) -> ApprovalDecision:
    if value == "grant":
        return ApprovalDecision.GRANTED
    if value == "deny":
        return ApprovalDecision.DENIED
    raise FormRefused("choose grant or deny")


def fingerprint(value: object) -> str:
    if not isinstance(value, str) or not _FINGERPRINT.fullmatch(value):
        raise FormRefused("the form does not carry the fingerprint of the intent it showed")
    return value


def approval_ttl(value: object) -> timedelta | None:
    """The lifetime chosen, None when the form carries none; a value the select does
    not offer is refused."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in APPROVAL_TTLS:
        raise FormRefused(f"choose how long the grant lasts: {', '.join(APPROVAL_TTLS)}")
    return APPROVAL_TTLS[value]


def discard_selection(message_id: object, malformed: object) -> Selection:
    """The dead letters a discard names: one message by id, or every malformed one."""
    one = isinstance(message_id, str) and bool(message_id)
    every = malformed == "yes"
    if one == every:
        raise FormRefused("choose one message, or every malformed one")
    if one:
        return Selection.of(message_ids=[str(message_id)])
    return Selection.of(malformed=True)


def previewed_bodies(value: object) -> list[str]:
    """The digests of the bodies the discard's preview showed: only those go."""
    digests = value.split(",") if isinstance(value, str) and value else []
    if not digests or not all(_FINGERPRINT.fullmatch(d) for d in digests):
        raise FormRefused(
            "the form does not carry the messages its preview showed: open the preview again"
        )
    return digests
