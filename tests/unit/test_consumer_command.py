"""``outbox consumer``'s command: what it sets up before the daemon runs."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Coroutine
from typing import Any

import pytest

import consumer.cli
from outbox import Settings
from outbox.sandbox.tools import build_registry


def test_the_command_freezes_the_start_up_heap_before_it_consumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen_when_consuming: list[int] = []

    def fake_run_async(main: Coroutine[Any, Any, Any]) -> None:
        main.close()
        frozen_when_consuming.append(gc.get_freeze_count())

    monkeypatch.setattr(consumer.cli, "run_async", fake_run_async)
    monkeypatch.setattr(consumer.cli, "registry_from", lambda _settings, required: build_registry())
    gc.unfreeze()
    try:
        code = consumer.cli.run(argparse.Namespace(processes=1), Settings(tools="x"))
    finally:
        gc.unfreeze()  # give this test process's heap back to the collector

    assert code == 0
    assert frozen_when_consuming
    assert frozen_when_consuming[0] > 0
