"""The operator layer's rules for what a person types, alone (the agreement of the front
ends is tests/integration/console/test_input_agreement.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox.errors import InputRefused
from outbox.models import ApprovalDecision
from outbox.operator import input as person_input


def test_evidence_is_trimmed_and_keeps_lines_and_tabs() -> None:
    assert person_input.evidence("  seen\n\tin the dashboard \r\n") == "seen\n\tin the dashboard"


@pytest.mark.parametrize("blank", [None, "", " \n\t "])
def test_blank_evidence_is_refused(blank: str | None) -> None:
    with pytest.raises(InputRefused, match="the evidence is empty"):
        person_input.evidence(blank)


def test_evidence_is_counted_after_trimming() -> None:
    assert person_input.evidence(" " + "e" * 500 + " ") == "e" * 500


@pytest.mark.parametrize("control", ["\x00", "\x1b", "\x9b", "\x7f"])
def test_evidence_with_any_other_control_character_is_refused(control: str) -> None:
    with pytest.raises(InputRefused, match="control characters"):
        person_input.evidence(f"seen{control}")


def test_a_reference_is_trimmed_and_an_empty_one_is_none() -> None:
    assert person_input.provider_reference(" re_1 ", committed=True) == "re_1"
    assert person_input.provider_reference("", committed=False) is None
    assert person_input.provider_reference(None, committed=False) is None


@pytest.mark.parametrize("reference", ["re\t1", "re\u20281", "re\x001"])
def test_a_reference_off_one_printable_line_is_refused(reference: str) -> None:
    with pytest.raises(InputRefused, match="printable characters, on one line"):
        person_input.provider_reference(reference, committed=True)


def test_a_grant_gets_the_default_lifetime_and_a_denial_its_fixed_expiry() -> None:
    granted, denied = ApprovalDecision.GRANTED, ApprovalDecision.DENIED
    assert person_input.approval_ttl(granted, None) == timedelta(minutes=15)
    assert person_input.approval_ttl(granted, timedelta(days=7)) == timedelta(days=7)
    assert person_input.approval_ttl(denied, None) == person_input.DENIAL_TTL


@pytest.mark.parametrize(
    "lifetime", [timedelta(0), timedelta(seconds=-1), timedelta(days=7, seconds=1)]
)
def test_a_grant_outside_its_bounds_is_refused(lifetime: timedelta) -> None:
    with pytest.raises(InputRefused, match="at most 7d"):
        person_input.approval_ttl(ApprovalDecision.GRANTED, lifetime)
