"""Test doubles with real HTTP for the effects tools perform.

:mod:`outbox.sandbox.provider` is a payment provider (refunds, emails) that can commit an
effect and lose the response, fail before committing, answer "request in progress",
forget idempotency keys and refuse lookups: the failures docs/design.md section 1 is about.

Nothing is imported here: ``python -m outbox.sandbox.provider`` runs that module as
``__main__``, and a copy already imported by this package would make it run twice.
"""

from __future__ import annotations
