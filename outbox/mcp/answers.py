"""What the model reads: one sentence per outcome that says what to do next, the
structured answer around it, and the refusals of calls of which nothing was recorded."""

from __future__ import annotations

from typing import Any

from mcp.types import CallToolResult, TextContent

from outbox.awaiting import Outcome, OutcomeStatus
from outbox.contracts import ToolContract
from outbox.errors import InputRejected
from outbox.mcp.tools import (
    DECISION_KEY_META,
    KEY_REQUIRED,
    OPERATION_META,
    RECORDED_META,
    STATUS_TOOL,
)


def sentence(outcome: Outcome, *, keyed: bool, approval: str | None = None) -> str:
    """One sentence per status that tells the model what to do next."""
    operation = outcome.display_id
    if outcome.status is OutcomeStatus.COMMITTED:
        evidence = (
            f"provider reference {outcome.provider_reference}"
            if outcome.provider_reference
            else operation
        )
        return f"Done: {outcome.tool} committed ({evidence})."
    if outcome.status is OutcomeStatus.REJECTED:
        return (
            f"Not done: {outcome.tool} was rejected ({outcome.reason or 'no reason recorded'}). "
            "Do not retry with the same key; a changed request is a new decision."
        )
    if outcome.status is OutcomeStatus.AWAITING_APPROVAL:
        return (
            f"Waiting for a person to approve {operation} ({approval or 'approval required'}). "
            "Tell the user; do not retry."
        )
    if outcome.status is OutcomeStatus.ESCALATED:
        return (
            f"The outcome of {operation} is unknown and a person is checking it with the "
            "evidence. Do not retry; tell the user."
        )
    # A keyless call repeated would be a new decision: only the status tool finds this one.
    again = "call again with the same arguments and decision key, or " if keyed else ""
    return (
        f"Accepted as {operation} and not settled yet. To check, {again}call {STATUS_TOOL} "
        f"with operation_id {operation}; do not start a new call."
    )


def answer(
    outcome: Outcome, *, keyed: bool, approval: str | None = None, created: bool | None = None
) -> CallToolResult:
    meta: dict[str, Any] = {OPERATION_META: outcome.display_id}
    if created is not None:
        meta[RECORDED_META] = "new" if created else "existing"
    return CallToolResult(
        content=[TextContent(text=sentence(outcome, keyed=keyed, approval=approval))],
        structured_content=outcome.model_dump(mode="json"),
        is_error=outcome.status is OutcomeStatus.REJECTED,
        meta=meta,
    )


def refusal(text: str) -> CallToolResult:
    """A call the model should correct; nothing of it was recorded."""
    return CallToolResult(content=[TextContent(text=text)], is_error=True)


def missing_key_refusal(contract: ToolContract[Any]) -> CallToolResult:
    why = (
        "this server requires one for every call"
        if contract.side_effect not in KEY_REQUIRED
        else "it changes something that must not happen twice"
    )
    return refusal(
        f"Not done: {contract.name} needs a decision key ({why}), and nothing was recorded. "
        f'Send a value unique to this decision in the request _meta under "{DECISION_KEY_META}" '
        "(for example the tool call id), and send the same value again when you retry."
    )


CONFLICT = (
    "Not done: this decision key was used for a different request (another tool or other "
    "arguments), and nothing was recorded. A retry must send the original arguments; a new "
    "decision needs a new decision key."
)
UNRECORDED = (
    "Not done yet: the runtime could not record this call (its database did not answer). "
    "Call again with the same arguments and decision key; that is safe and will not repeat "
    "an effect."
)


def input_refusal(rejected: InputRejected) -> CallToolResult:
    # InputRejected names fields and rules, never the values sent.
    return refusal(
        f"Not done: {rejected.message}. Nothing was recorded; correct the arguments and call again."
    )
