"""What `tools/list` offers and what the server refuses to build."""

from __future__ import annotations

from typing import Any

import pytest

from outbox import Outcome, Registry, Settings, SideEffect, ToolContract
from outbox.errors import ConfigurationError
from outbox.mcp.config import ServerOptions
from outbox.mcp.server import build_server
from outbox.mcp.tools import CONTRACT_META, STATUS_TOOL

from support.mcp_cases import LookupInput, connected, never_runs

# --- tools/list ----------------------------------------------------------------------


async def test_each_contract_is_one_tool_at_its_latest_version(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}

    assert list(listed) == ["lookup", "notify", "pay", "set_flag", STATUS_TOOL]
    for name in ("lookup", "notify", "pay", "set_flag"):
        contract = registry.get(name)
        tool = listed[name]
        assert tool.input_schema == {
            **contract.input_model.model_json_schema(),
            "additionalProperties": False,
        }
        assert tool.output_schema == Outcome.model_json_schema(mode="serialization")
        assert tool.annotations is not None
        wire = tool.annotations.model_dump(by_alias=True, exclude_none=True)
        assert wire == contract.mcp_annotations()
        assert tool.meta is not None
        card = tool.meta[CONTRACT_META]
        assert (card["name"], card["version"]) == (name, contract.version)
        assert card["side_effect"] == contract.side_effect.value
        assert card["card"] == contract.card()
    assert listed["lookup"].meta is not None
    assert listed["lookup"].meta[CONTRACT_META]["version"] == 2
    assert "verbose" in listed["lookup"].input_schema["properties"]
    assert listed["lookup"].description == "Look a reference up; changes nothing."


async def test_annotations_and_contract_say_what_the_runtime_enforces(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}

    def hints(name: str) -> dict[str, Any]:
        annotations = listed[name].annotations
        assert annotations is not None
        return annotations.model_dump(by_alias=True, exclude_none=True)

    def contract(name: str) -> dict[str, Any]:
        meta = listed[name].meta
        assert meta is not None
        found: dict[str, Any] = meta[CONTRACT_META]
        return found

    assert hints("lookup") == {"readOnlyHint": True}
    assert hints("set_flag") == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": True,
    }
    assert hints("pay") == {
        "readOnlyHint": False,
        "destructiveHint": False,
        "idempotentHint": False,
    }
    assert hints("notify")["destructiveHint"] is True
    assert hints(STATUS_TOOL) == {"readOnlyHint": True, "openWorldHint": False}
    assert [contract(n)["decision_key"] for n in ("lookup", "set_flag", "pay", "notify")] == [
        "optional",
        "optional",
        "required",
        "required",
    ]
    assert contract("pay")["approval"] == "approval required when amount_cents > 50000"
    assert contract("pay")["dedupe_window_seconds"] == 24 * 3600
    assert contract("notify")["on_unknown"] == "escalate"
    assert contract("lookup")["approval"] is None


async def test_require_key_marks_every_tool_as_needing_one(
    registry: Registry, settings: Settings
) -> None:
    async with connected(registry, settings, require_key=True) as client:
        tools = (await client.list_tools()).tools
    assert {tool.meta[CONTRACT_META]["decision_key"] for tool in tools if tool.meta} == {"required"}


def test_a_tool_named_like_the_status_tool_is_refused(settings: Settings) -> None:
    registry = Registry()
    registry.register(
        ToolContract(
            name=STATUS_TOOL,
            version=1,
            input_model=LookupInput,
            side_effect=SideEffect.READ_ONLY,
            execute=never_runs,
        )
    )
    with pytest.raises(ConfigurationError, match="rename that tool"):
        build_server(registry, settings)


def test_a_negative_wait_is_refused(registry: Registry, settings: Settings) -> None:
    with pytest.raises(ConfigurationError, match="--wait must not be negative"):
        build_server(registry, settings, ServerOptions(wait=-1))


@pytest.mark.parametrize("run_id", ["", "r" * 201, "r\x00"])
def test_an_unusable_default_run_id_is_refused(
    registry: Registry, settings: Settings, run_id: str
) -> None:
    with pytest.raises(ConfigurationError, match="--run-id must be 1 to 200 characters"):
        build_server(registry, settings, ServerOptions(run_id=run_id))
