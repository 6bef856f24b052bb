"""The faults a chaos run injects, one module per category, each kind registered in
:data:`FAULTS` by ``@fault_kind`` where its handler is written: a kind, what it targets
and its handler side by side. :data:`FAULT_CATEGORIES` is derived from it."""

from __future__ import annotations

# Imported for what they register: every kind of every category.
from harness.faults import broker, links, overload, processes, provider, webhooks  # noqa: F401
from harness.faults.registry import FAULTS, Fault, Injector, fault_kind

__all__ = ["CATEGORIES", "FAULTS", "FAULT_CATEGORIES", "Fault", "Injector", "fault_kind"]

# The order ``--faults`` lists the categories in; within one category the kinds keep the
# order their module registers them in, which is the order the schedule draws from.
# A category left out of it would leave its kinds out of every run: a unit test
# (tests/unit/test_chaos_configuration.py) checks that none is.
CATEGORIES = ("process", "broker", "database", "network", "provider", "overload", "callbacks")

# The kinds ``--faults`` enables by category.
FAULT_CATEGORIES: dict[str, tuple[str, ...]] = {
    category: tuple(kind for kind, entry in FAULTS.items() if entry.category == category)
    for category in CATEGORIES
}
