"""A tools module whose two tools call one provider, ``payments``: for the operator
views that count waiting operations per provider (``outbox providers --tools``, the
console's overview)."""

from __future__ import annotations

import dataclasses

from outbox import Registry

from support.sample_tools import Ledger, refund_contract, ticket_contract

SHARED_PROVIDER = "payments"


def build_registry(ledger: Ledger | None = None) -> Registry:
    ledger = ledger or Ledger()
    registry = Registry()
    registry.register(dataclasses.replace(refund_contract(ledger), provider=SHARED_PROVIDER))
    registry.register(ticket_contract(ledger, provider=SHARED_PROVIDER))
    return registry
