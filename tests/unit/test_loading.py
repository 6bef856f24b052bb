"""The tools a command runs, read one way (outbox.loading.registry_from): required by the
daemons, the MCP server and the callbacks receiver, optional for the operator's commands
and the console."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigurationError
from outbox.loading import registry_from
from outbox.settings import Settings


def test_required_tools_that_are_not_named_say_how_to_name_them() -> None:
    with pytest.raises(ConfigurationError, match="--tools MODULE"):
        registry_from(Settings(tools=""), required=True)


def test_optional_tools_that_are_not_named_are_none() -> None:
    assert registry_from(Settings(tools=" , "), required=False) is None


@pytest.mark.parametrize("required", [True, False])
def test_named_tools_are_loaded_either_way(required: bool) -> None:
    registry = registry_from(Settings(tools="support.sample_tools"), required=required)
    assert registry is not None
    assert "send_refund" in {contract.name for contract in registry}
