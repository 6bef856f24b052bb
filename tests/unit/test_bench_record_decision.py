"""bench/record_decision.py's bare statement sends what record_decision sends: every
parameter insert_decision names, so a parameter added to the query cannot leave the
bare mode failing in every thread (as lock_timeout_ms once did)."""

from __future__ import annotations

import re

from bench.record_decision import bare_params
from outbox.sql import QUERIES


def test_the_bare_statement_has_every_parameter_of_insert_decision() -> None:
    named = set(re.findall(r"%\((\w+)\)s", QUERIES["insert_decision"].sql))

    assert set(bare_params(0, 0)) == named
