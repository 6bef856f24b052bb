"""What the console's forms may submit, decided without I/O: whether a submitted value is
acceptable, and the resolutions offered (from :mod:`outbox.operator.rules`, the rules
``outbox ops`` uses). Each refusal is a sentence a person can act on."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from outbox.contracts import Registry
from outbox.errors import OperationNotFound
from outbox.models import Operation, parse_operation_id
from outbox.operator.rules import Resolution, refusal
from outbox.states import OperationState
from outbox.store import RESOLUTION_EVIDENCE_LIMIT

S = OperationState

APPROVAL_TTLS: dict[str, timedelta] = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "4h": timedelta(hours=4),
    "1d": timedelta(days=1),
}
DEFAULT_APPROVAL_TTL = "15m"
MAX_PROVIDER_REFERENCE = 200
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class FormRefused(ValueError):
    """A submitted value the console will not act on; its message says why."""


@dataclass(frozen=True)
class Choice:
    value: str
    label: str
    refused: str | None
    """Why this resolution is not offered, or None when it is."""


def operation_id_from(text: str) -> UUID:
    try:
        return parse_operation_id(text.strip())
    except ValueError:
        raise OperationNotFound("not an operation id: expected op_<uuid>") from None


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


def has_controls(text: str, allowed: str = "") -> bool:
    """Whether ``text`` holds a control character (NUL, escapes, C1) other than ``allowed``."""
    return any(unicodedata.category(c) == "Cc" and c not in allowed for c in text)


def reason(value: object) -> str:
    text = value.strip() if isinstance(value, str) else ""
    if not text:
        raise FormRefused("a reason is required: say what the decision rests on")
    if has_controls(text, allowed="\t\n\r"):
        # Lines and tabs are a person's writing; other control characters (NUL, which
        # Postgres cannot store, terminal escapes) are not.
        raise FormRefused("the reason holds control characters: write it as plain text")
    if len(text) > RESOLUTION_EVIDENCE_LIMIT:
        raise FormRefused(
            f"the reason is {len(text)} characters; at most {RESOLUTION_EVIDENCE_LIMIT} are "
            "kept, so shorten it rather than lose its end"
        )
    return text


def provider_reference(value: object, target: OperationState) -> str | None:
    text = value.strip() if isinstance(value, str) else ""
    if target is S.COMMITTED:
        if not text:
            raise FormRefused("committed needs the provider's reference of the effect")
        if len(text) > MAX_PROVIDER_REFERENCE or not text.isprintable():
            raise FormRefused(
                f"a provider reference is 1-{MAX_PROVIDER_REFERENCE} printable characters"
            )
        return text
    if text:
        raise FormRefused("a provider reference goes with committed only")
    return None


def fingerprint(value: object) -> str:
    if not isinstance(value, str) or not _FINGERPRINT.fullmatch(value):
        raise FormRefused("the form does not carry the fingerprint of the intent it showed")
    return value


def approval_ttl(value: object) -> timedelta:
    if not isinstance(value, str) or value not in APPROVAL_TTLS:
        raise FormRefused(f"choose how long the grant lasts: {', '.join(APPROVAL_TTLS)}")
    return APPROVAL_TTLS[value]
