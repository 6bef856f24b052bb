"""What a decision intends, computed once for the agent that records it and again for
the consumer that checks the stored row.

One computation, :func:`_intent`, turns a validated input into the form that is stored,
its canonical (RFC 8785) bytes, the fingerprint over them and whether a person must
approve. :func:`prepare_decision` runs it on the agent's input and refuses what cannot
be recorded (:class:`InputRejected`, nothing written); :func:`derive_intent` runs it on
a stored row's input and names the first check the row fails. The consumer's tamper
check holds only because both sides compute the same thing, so they share the code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import BaseModel

from outbox import tracing
from outbox.bounds import (
    MAX_INPUT_BYTES,
    MAX_JSON_DEPTH,
    holds_nul_escape,
    is_unreadable,
    nested_deeper_than,
)
from outbox.contracts import Registry, ToolContract
from outbox.errors import InputRejected
from outbox.fingerprint import canonical_fingerprint, canonical_json
from outbox.models import Operation
from outbox.store import NewDecision

MAX_ID_LENGTH = 200
# Objects and arrays inside one another, the input object itself being level 1 (the
# database refuses the same, outbox/bounds.py).
MAX_INPUT_DEPTH = MAX_JSON_DEPTH


@dataclass(frozen=True)
class Intent:
    """A tool input as it is recorded: what the effect is called with, what is stored,
    and what the stored row must agree with."""

    tool_input: Any
    """Validated by the contract's input model."""
    input_json: dict[str, Any]
    """The model's JSON dump: the form that is stored."""
    canonical: bytes
    """``input_json`` in RFC 8785 form: what is measured and hashed."""
    fingerprint: str
    requires_approval: bool

    @property
    def too_large(self) -> bool:
        return len(self.canonical) > MAX_INPUT_BYTES


def _intent(contract: ToolContract[Any], tool_input: Any, input_json: dict[str, Any]) -> Intent:
    # Canonicalized once: the same bytes are measured, searched for a NUL and hashed.
    canonical = canonical_json(input_json)
    return Intent(
        tool_input=tool_input,
        input_json=input_json,
        canonical=canonical,
        fingerprint=canonical_fingerprint(contract.name, contract.version, canonical),
        requires_approval=contract.approval.applies_to(tool_input),
    )


def prepare_decision(
    registry: Registry,
    tool: str,
    tool_input: Mapping[str, Any] | BaseModel,
    *,
    run_id: str,
    decision_key: str | None = None,
    tool_version: int | None = None,
    traceparent: str | None = None,
) -> NewDecision:
    """Validate and fingerprint a decision without touching the database."""
    contract = registry.get(tool, tool_version)
    _check_identifier("run_id", run_id)
    if decision_key is not None:
        _check_identifier("decision_key", decision_key)
    headers: dict[str, str] = {}
    if traceparent is not None:
        if tracing.valid_traceparent(traceparent) is None:
            raise InputRejected(
                "traceparent is not a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>)",
                problems=["traceparent"],
            )
        headers["traceparent"] = traceparent
    intent = _intent(contract, *_validated_and_stored(contract, tool_input))
    if intent.too_large:
        raise InputRejected(
            f"input for tool {contract.label} is {len(intent.canonical)} bytes in canonical "
            f"JSON; the limit is {MAX_INPUT_BYTES}. Store large payloads elsewhere and pass "
            "a reference",
            problems=["input too large"],
        )
    # Only the agent's input can hold one: Postgres cannot store it, so no row does.
    if holds_nul_escape(intent.canonical):
        raise InputRejected(
            f"input for tool {contract.label} holds a NUL character, which Postgres cannot store",
            problems=["NUL character"],
        )
    return NewDecision(
        run_id=run_id,
        decision_key=decision_key,
        tool_name=contract.name,
        tool_version=contract.version,
        side_effect=str(contract.side_effect),
        input=intent.input_json,
        input_fingerprint=intent.fingerprint,
        requires_approval=intent.requires_approval,
        headers=headers,
    )


# Every check derive_intent can name as failed (the ``check`` label of
# outbox_consumer_tampered_total, and the operation.tampered event's attribute).
TAMPER_CHECKS = (
    "tool_mismatch",
    "side_effect_mismatch",
    "input_invalid",
    "fingerprint_mismatch",
    "input_not_canonical",
    "approval_flag_mismatch",
    "input_unreadable",
    "input_too_large",
)


@dataclass(frozen=True)
class DerivedIntent:
    """What the consumer derives from a stored operation and its contract, trusting
    nothing else the row says. ``disagreement`` names the first check the row failed
    (None when it agrees): such a row is tampering and is never executed."""

    requires_approval: bool
    disagreement: str | None = None
    # The stored input validated by the contract's model: what the effect is called with.
    tool_input: Any = None


def derive_intent(contract: ToolContract[Any], operation: Operation) -> DerivedIntent:
    """Recompute, from the stored input and the contract, what recording the decision
    computed: the fingerprint and whether a person must approve. A row written around
    the library (a forged fingerprint, a cleared approval flag) disagrees."""
    if operation.tool_name != contract.name or operation.tool_version != contract.version:
        return DerivedIntent(requires_approval=True, disagreement="tool_mismatch")
    if operation.side_effect != contract.side_effect:
        return DerivedIntent(requires_approval=True, disagreement="side_effect_mismatch")
    if is_unreadable(operation.input):
        return DerivedIntent(requires_approval=True, disagreement="input_unreadable")
    try:
        # Read with the model's own rules, as the agent's input was read back before it
        # was recorded (_validated_and_stored).
        validated = contract.input_model.model_validate(operation.input)
        intent = _intent(contract, validated, validated.model_dump(mode="json"))
    except (pydantic.ValidationError, InputRejected, ValueError, TypeError, RecursionError):
        return DerivedIntent(requires_approval=True, disagreement="input_invalid")
    if intent.too_large:
        # Only the database's own, larger ceiling let this row in: record_decision would
        # have refused it, so nothing executes it.
        return DerivedIntent(requires_approval=True, disagreement="input_too_large")
    if intent.fingerprint != operation.input_fingerprint:
        disagreement: str | None = "fingerprint_mismatch"
    elif intent.input_json != operation.input:
        # Fields the model drops or rewrites: the fingerprint covers only what it keeps.
        disagreement = "input_not_canonical"
    elif intent.requires_approval != operation.requires_approval:
        disagreement = "approval_flag_mismatch"
    else:
        disagreement = None
    return DerivedIntent(
        requires_approval=intent.requires_approval,
        disagreement=disagreement,
        tool_input=intent.tool_input,
    )


def validate_input(contract: ToolContract[Any], tool_input: Mapping[str, Any] | BaseModel) -> Any:
    """The contract's input model, validated; refuses input that does not survive a
    round trip through JSON, since the consumer will rebuild it from the stored JSON.

    Problems name the field and the rule, never the offending value.
    """
    return _validated_and_stored(contract, tool_input)[0]


def _validated_and_stored(
    contract: ToolContract[Any], tool_input: Mapping[str, Any] | BaseModel
) -> tuple[Any, dict[str, Any]]:
    """:func:`validate_input`, and the JSON the model dumped: the form that is stored,
    the one the round trip was checked on (recording needs it, and need not dump again)."""
    try:
        # A model's computed fields are output, not input: validating them back would
        # refuse them as fields the tool does not take.
        raw = (
            tool_input.model_dump(mode="json", exclude_computed_fields=True)
            if isinstance(tool_input, BaseModel)
            else tool_input
        )
    except (ValueError, RecursionError) as exc:
        raise InputRejected(
            f"input for tool {contract.label} cannot be turned into JSON "
            f"({type(exc).__name__}); inputs nested more than {MAX_INPUT_DEPTH} levels deep "
            "are refused",
            problems=["input not serializable"],
        ) from None
    if nested_deeper_than(raw, MAX_INPUT_DEPTH):
        raise InputRejected(
            f"input for tool {contract.label} is nested more than {MAX_INPUT_DEPTH} levels "
            "deep (objects and arrays inside one another)",
            problems=["input nested too deep"],
        )
    try:
        validated = contract.parse_input(raw)
        stored = validated.model_dump(mode="json")
        # Read back as the consumer reads the stored row (derive_intent): by the model.
        rebuilt = contract.input_model.model_validate(stored)
    except pydantic.ValidationError as exc:
        problems = [_describe_problem(error) for error in exc.errors(include_url=False)]
        raise InputRejected(
            f"input for tool {contract.label} is invalid: {'; '.join(problems)}",
            problems=problems,
        ) from None
    if rebuilt != validated or rebuilt.model_dump(mode="json") != stored:
        raise InputRejected(
            f"input model of tool {contract.label} does not survive a JSON round trip; the "
            "consumer would execute something other than what was recorded",
            problems=["not JSON round-trippable"],
        )
    return validated, stored


# Error types whose pydantic message can quote the input (a union tag, a custom
# validator's text): for these only the type is shown.
_MAY_QUOTE_INPUT = frozenset(
    {"value_error", "assertion_error", "union_tag_invalid", "json_invalid", "json_type"}
)


# A field no model, TypedDict (extra_forbidden) or dataclass (unexpected_keyword_argument)
# of the input declares.
_UNDECLARED = frozenset({"extra_forbidden", "unexpected_keyword_argument"})
# Longer than any field name a model declares: what is longer is no name worth showing.
_MAX_SHOWN_LOCATION = 100


def _describe_problem(error: Any) -> str:
    location = ".".join(map(str, error["loc"])) or "(input)"
    if len(location) > _MAX_SHOWN_LOCATION or not location.isprintable():
        # A key the caller made up (an extra field, a mapping's key) is their text.
        location = f"a field name of {len(location)} characters"
    if error["type"] in _UNDECLARED:
        return f"{location}: not a field of this tool ({error['type']})"
    message = error["msg"]
    bad_value = error.get("input")
    quotes_input = isinstance(bad_value, str | int | float) and str(bad_value) in message
    if error["type"] in _MAY_QUOTE_INPUT or quotes_input:
        message = f"invalid value ({error['type']})"
    return f"{location}: {message}"


def _check_identifier(name: str, value: str) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LENGTH:
        raise InputRejected(
            f"{name} must be a string of 1 to {MAX_ID_LENGTH} characters", problems=[name]
        )
    if "\x00" in value:
        raise InputRejected(f"{name} holds a NUL character", problems=[name])
