"""What ``tools/list`` offers: one MCP tool per contract (its latest version), with the
enforced contract in its ``_meta``, and the status tool; and the ``_meta`` keys a call
carries."""

from __future__ import annotations

from typing import Any

from mcp.types import Tool, ToolAnnotations

from outbox.awaiting import Outcome
from outbox.contracts import Registry, SideEffect, ToolContract
from outbox.errors import ConfigurationError
from outbox.mcp.config import ServerOptions

# Reverse-DNS prefix for our `_meta` keys; MCP reserves `*.modelcontextprotocol/` and `*.mcp/`.
META_PREFIX = "io.effect-outbox"
DECISION_KEY_META = f"{META_PREFIX}/decision-key"
RUN_ID_META = f"{META_PREFIX}/run-id"
OPERATION_META = f"{META_PREFIX}/operation"
RECORDED_META = f"{META_PREFIX}/recorded"
CONTRACT_META = f"{META_PREFIX}/contract"

STATUS_TOOL = "outbox_operation_status"

# Writes whose repeat would be a second effect unless it carries the same identity.
KEY_REQUIRED = frozenset({SideEffect.DEDUPLICATED_WRITE, SideEffect.NON_REPEATABLE_WRITE})


def outcome_schema() -> dict[str, Any]:
    return Outcome.model_json_schema(mode="serialization")


def key_required(contract: ToolContract[Any], options: ServerOptions) -> bool:
    return options.require_key or contract.side_effect in KEY_REQUIRED


def contract_meta(contract: ToolContract[Any], options: ServerOptions) -> dict[str, Any]:
    """The enforced contract, for hosts and people; the annotations only hint at it."""
    window = contract.dedupe_window
    return {
        "name": contract.name,
        "version": contract.version,
        "side_effect": contract.side_effect.value,
        "additive_only": contract.additive_only,
        "decision_key": "required" if key_required(contract, options) else "optional",
        "approval": contract.approval.explanation if contract.approval.required else None,
        "dedupe_window_seconds": window.total_seconds() if window is not None else None,
        "on_unknown": contract.on_unknown.value,
        "card": contract.card(),
    }


def contract_tool(contract: ToolContract[Any], options: ServerOptions) -> Tool:
    return Tool(
        name=contract.name,
        description=contract.description
        or f"{contract.name} v{contract.version} ({contract.side_effect.value})",
        input_schema=contract.input_schema(),
        output_schema=outcome_schema(),
        annotations=ToolAnnotations.model_validate(contract.mcp_annotations()),
        meta={CONTRACT_META: contract_meta(contract, options)},
    )


def status_tool() -> Tool:
    return Tool(
        name=STATUS_TOOL,
        description="Where an operation an earlier call of this server recorded stands now: "
        "committed, rejected, pending, awaiting_approval or escalated, with the sentence that "
        "says what to do. Changes nothing. Use it when you cannot call the tool again with "
        "the same decision key.",
        input_schema={
            "type": "object",
            "properties": {
                "operation_id": {
                    "type": "string",
                    "description": "the operation id an earlier answer gave (op_<uuid>)",
                }
            },
            "required": ["operation_id"],
            "additionalProperties": False,
        },
        output_schema=outcome_schema(),
        annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
    )


def registry_tools(registry: Registry, options: ServerOptions) -> list[Tool]:
    """One tool per contract name, at its latest version, and the status tool."""
    names = sorted({contract.name for contract in registry})
    if STATUS_TOOL in names:
        raise ConfigurationError(
            f"a tools module registers a tool named {STATUS_TOOL!r}, which `outbox mcp` "
            "serves itself; rename that tool"
        )
    return [contract_tool(registry.get(name), options) for name in names] + [status_tool()]
