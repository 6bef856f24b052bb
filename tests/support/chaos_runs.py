"""A chaos run built by hand with nothing started, for tests that drive one part of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.run import Chaos


def idle_chaos(**parts: Any) -> Chaos:
    """A run that reaches no daemon, database, provider or link unless ``parts`` gives one."""
    nothing_started: dict[str, Any] = {
        "scratch": None,
        "provider": None,
        "links": {},
        "log_dir": Path("."),
        "operations": 1,
        "schedule": [],
        "broker_control": None,
        "drain_timeout": 1.0,
    }
    return Chaos(**(nothing_started | parts))
