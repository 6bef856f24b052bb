"""A tools module of three refund tools, ``refund_a``, ``refund_b`` and ``refund_c``:
the sandbox's ``send_refund`` under three names, for the test that gives each tool a
queue of its own. Each refund is kept at the sandbox under its operation id, so the
checker counts one effect per operation whichever tool made it."""

from __future__ import annotations

import dataclasses

from outbox import Registry
from outbox.sandbox.tools import build_registry as sandbox_registry

TOOLS = ("refund_a", "refund_b", "refund_c")


def build_registry() -> Registry:
    [refund] = [contract for contract in sandbox_registry() if contract.name == "send_refund"]
    registry = Registry()
    for name in TOOLS:
        registry.register(dataclasses.replace(refund, name=name))
    return registry
