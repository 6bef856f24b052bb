"""What a person may type into an operator command, one rule each: evidence, a
provider's reference, an approval's lifetime, why dead letters are discarded. Every
front end (``outbox ops``, ``outbox approvals``, ``outbox dlq discard``, the console's
forms) hands the raw value here and shows the refusal's sentence as it is, so a value
one front end accepts no other refuses.

The operation a person names goes through :func:`outbox.operator.views.operation_id_of`,
the one reading of an id (``op_<uuid>``, a bare uuid, or a short id).

Decided without I/O, before anything is read or written: a refusal leaves the database
as it was.
"""

from __future__ import annotations

import unicodedata
from datetime import timedelta

from outbox.bounds import MAX_APPROVAL_TTL
from outbox.errors import InputRefused
from outbox.models import ApprovalDecision
from outbox.store import RESOLUTION_EVIDENCE_LIMIT

DEFAULT_APPROVAL_TTL = timedelta(minutes=15)
# A denial never lapses in the consumer's eyes (a denied latest decision refuses the
# effect whatever its expiry); the expiry only has to satisfy the approvals table.
DENIAL_TTL = timedelta(minutes=15)
# The console's limit, stricter than the 500 the database's trigger enforces for any
# writer (outbox.bounds.MAX_PROVIDER_REFERENCE): a reference a person types is an id,
# not a paragraph.
MAX_TYPED_REFERENCE = 200
# Lines and tabs are a person's writing; other control characters (NUL, which Postgres
# cannot store, terminal escapes) are not.
_WRITING = "\t\n\r"


def has_controls(text: str, allowed: str = "") -> bool:
    """Whether ``text`` holds a control character (NUL, escapes, C1) other than ``allowed``."""
    return any(unicodedata.category(c) == "Cc" and c not in allowed for c in text)


def evidence(value: str | None) -> str:
    """What a resolution or a cancellation rests on, as it will be kept: 1 to
    ``RESOLUTION_EVIDENCE_LIMIT`` characters once trimmed, lines and tabs allowed, no
    other control character. Never cut: a longer one is refused."""
    return _kept_words(value, "the evidence", "say what the decision rests on")


def discard_reason(value: str | None) -> str:
    """Why a person discards dead letters, as the record keeps it: the rule of
    :func:`evidence`."""
    return _kept_words(value, "the reason", "say why these messages can go")


def _kept_words(value: str | None, what: str, ask: str) -> str:
    text = (value or "").strip()
    if not text:
        raise InputRefused(f"{what} is empty: {ask}")
    if has_controls(text, allowed=_WRITING):
        raise InputRefused(
            f"{what} holds control characters: write it as plain text (lines and tabs are fine)"
        )
    if len(text) > RESOLUTION_EVIDENCE_LIMIT:
        raise InputRefused(
            f"{what} is {len(text)} characters; at most {RESOLUTION_EVIDENCE_LIMIT} "
            "are kept, so shorten it rather than lose its end"
        )
    return text


def provider_reference(value: str | None, *, committed: bool) -> str | None:
    """The provider's id of the effect: required with ``committed`` (1 to
    ``MAX_TYPED_REFERENCE`` printable characters once trimmed, so no line break),
    refused with any other resolution. An empty value is no value."""
    text = (value or "").strip()
    if not committed:
        if text:
            raise InputRefused("a provider reference goes with committed only")
        return None
    if not text:
        raise InputRefused("committed needs the provider's reference of the effect")
    if len(text) > MAX_TYPED_REFERENCE or not text.isprintable():
        raise InputRefused(
            f"a provider reference is 1 to {MAX_TYPED_REFERENCE} printable characters, on one line"
        )
    return text


def approval_ttl(decision: ApprovalDecision, ttl: timedelta | None) -> timedelta:
    """The expiry to store: a grant's chosen lifetime (``DEFAULT_APPROVAL_TTL`` when none
    is given, at most ``MAX_APPROVAL_TTL``); a denial takes none and gets ``DENIAL_TTL``."""
    if decision is ApprovalDecision.DENIED:
        if ttl is not None:
            raise InputRefused(
                "a denial takes no lifetime: it stands until a later grant supersedes it"
            )
        return DENIAL_TTL
    chosen = DEFAULT_APPROVAL_TTL if ttl is None else ttl
    if not timedelta(0) < chosen <= MAX_APPROVAL_TTL:
        raise InputRefused(
            f"a grant lasts more than no time and at most {MAX_APPROVAL_TTL.days}d: grant "
            "again when it runs out"
        )
    return chosen
