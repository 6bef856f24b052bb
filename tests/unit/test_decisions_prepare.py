from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, computed_field, field_serializer

from outbox.bounds import MAX_INPUT_BYTES
from outbox.contracts import ApprovalPolicy, Registry, SideEffect, ToolContract
from outbox.errors import InputRejected, ToolNotRegistered
from outbox.fingerprint import intent_fingerprint
from outbox.intent import MAX_INPUT_DEPTH, prepare_decision
from outbox.outcomes import EffectResult, ExecutionContext

CANARY = "CANARY-5b1f0e7a-never-in-messages"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class RefundInput(BaseModel):
    customer_id: str
    amount: float
    currency: str = "EUR"


class NoteInput(BaseModel):
    note: str


class DocumentInput(BaseModel):
    data: Any


class CardMethod(BaseModel):
    kind: Literal["card"]
    last4: str


class BankMethod(BaseModel):
    kind: Literal["bank"]
    iban_suffix: str


class PayoutInput(BaseModel):
    method: Annotated[CardMethod | BankMethod, Field(discriminator="kind")]


class ExclaimedInput(BaseModel):
    """An input model whose dump is not what validation accepted."""

    text: str

    @field_serializer("text")
    def _exclaim(self, value: str) -> str:
        return value + "!"


class ShoutedInput(BaseModel):
    """Dumps differently from what was validated, but the same on every later dump."""

    text: str

    @field_serializer("text")
    def _shout(self, value: str) -> str:
        return value.upper()


class Address(BaseModel):
    street: str


@dataclasses.dataclass
class Parcel:
    kilograms: int


class ShippingInput(BaseModel):
    """Nests a model, a model in a list and a dataclass: extras are refused at every level."""

    to: Address
    stops: list[Address] = []
    parcel: Parcel | None = None


class OpenInput(BaseModel):
    """Opts in: its extra fields are part of the intent."""

    model_config = ConfigDict(extra="allow")

    note: str


class LenientInput(BaseModel):
    """Opts in to the old behaviour: extra fields are dropped, knowingly."""

    model_config = ConfigDict(extra="ignore")

    note: str


class PricedInput(BaseModel):
    cents: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def euros(self) -> float:
        return self.cents / 100


async def succeed(tool_input: BaseModel, ctx: ExecutionContext) -> EffectResult:
    return EffectResult()


def contract(
    name: str,
    input_model: type[BaseModel],
    *,
    version: int = 1,
    side_effect: SideEffect = SideEffect.IDEMPOTENT_WRITE,
    approval: ApprovalPolicy | None = None,
) -> ToolContract[BaseModel]:
    return ToolContract(
        name=name,
        version=version,
        input_model=input_model,
        side_effect=side_effect,
        execute=succeed,
        approval=approval or ApprovalPolicy.never(),
    )


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    for tool in (
        contract("send_refund", RefundInput),
        contract(
            "send_refund", RefundInput, version=2, approval=ApprovalPolicy.above("amount", 100)
        ),
        contract("post_note", NoteInput, side_effect=SideEffect.READ_ONLY),
        contract("send_payout", PayoutInput),
        contract("exclaim", ExclaimedInput, side_effect=SideEffect.READ_ONLY),
        contract("store_document", DocumentInput),
        contract("ship", ShippingInput),
        contract("open_note", OpenInput),
        contract("lenient_note", LenientInput),
        contract("price", PricedInput),
    ):
        registry.register(tool)
    return registry


def refund(amount: float = 10.0) -> dict[str, object]:
    return {"customer_id": "cus_1", "amount": amount, "currency": "EUR"}


def test_valid_decision_is_fingerprinted_for_the_latest_version(registry: Registry) -> None:
    decision = prepare_decision(registry, "send_refund", refund(), run_id="run_1")

    assert decision.tool_name == "send_refund"
    assert decision.tool_version == 2
    assert decision.side_effect == "idempotent_write"
    assert decision.input == refund()
    assert decision.input_fingerprint == intent_fingerprint("send_refund", 2, refund())
    assert decision.headers == {}


def test_invalid_input_names_the_field_but_never_echoes_the_value(registry: Registry) -> None:
    bad = {"customer_id": "cus_1", "amount": CANARY}

    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", bad, run_id="run_1")

    message = str(info.value)
    assert "'send_refund' v2 is invalid" in message
    assert "amount:" in message
    assert CANARY not in message
    assert all(CANARY not in problem for problem in info.value.problems)


def test_missing_field_is_named(registry: Registry) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", {"amount": 5}, run_id="run_1")

    assert "customer_id: Field required" in str(info.value)


def test_invalid_union_tag_is_not_echoed(registry: Registry) -> None:
    bad = {"method": {"kind": CANARY, "last4": "4242"}}

    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_payout", bad, run_id="run_1")

    assert "method" in str(info.value)
    assert CANARY not in str(info.value)


def test_unknown_tool_is_refused(registry: Registry) -> None:
    with pytest.raises(ToolNotRegistered) as info:
        prepare_decision(registry, "wire_money", refund(), run_id="run_1")

    assert "'wire_money' is not registered" in str(info.value)
    assert "'send_refund' v2" in str(info.value)


@pytest.mark.parametrize("run_id", ["", "r" * 201])
def test_run_id_outside_1_to_200_characters_is_refused(registry: Registry, run_id: str) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", refund(), run_id=run_id)

    assert "run_id must be a string of 1 to 200 characters" in str(info.value)


def test_run_id_and_decision_key_of_200_characters_are_accepted(registry: Registry) -> None:
    decision = prepare_decision(
        registry, "send_refund", refund(), run_id="r" * 200, decision_key="k" * 200
    )

    assert decision.run_id == "r" * 200
    assert decision.decision_key == "k" * 200


@pytest.mark.parametrize("decision_key", ["", "k" * 201])
def test_decision_key_outside_1_to_200_characters_is_refused(
    registry: Registry, decision_key: str
) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(
            registry, "send_refund", refund(), run_id="run_1", decision_key=decision_key
        )

    assert "decision_key must be a string of 1 to 200 characters" in str(info.value)


def test_nul_in_run_id_is_refused(registry: Registry) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", refund(), run_id="run\x001")

    assert "run_id holds a NUL character" in str(info.value)


@pytest.mark.parametrize(
    "traceparent",
    [
        "not-a-traceparent",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        TRACEPARENT + "\n",
    ],
)
def test_malformed_traceparent_is_refused(registry: Registry, traceparent: str) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", refund(), run_id="run_1", traceparent=traceparent)

    assert "traceparent is not a W3C trace context" in str(info.value)


def test_valid_traceparent_travels_in_the_headers(registry: Registry) -> None:
    decision = prepare_decision(
        registry, "send_refund", refund(), run_id="run_1", traceparent=TRACEPARENT
    )

    assert decision.headers == {"traceparent": TRACEPARENT}


def test_nul_character_in_input_is_refused(registry: Registry) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "post_note", {"note": "before\x00after"}, run_id="run_1")

    assert "holds a NUL character" in str(info.value)
    assert "Postgres cannot store" in str(info.value)


def test_escaped_backslash_before_u0000_text_is_not_a_nul(registry: Registry) -> None:
    # A backslash followed by the letters u0000 is ordinary text, not a NUL.
    note = "C:\\u0000\\logs"

    decision = prepare_decision(registry, "post_note", {"note": note}, run_id="run_1")

    assert decision.input == {"note": note}


# The canonical form of {"note": x} is {"note":"x"}: 11 bytes around an ASCII x.
NOTE_OVERHEAD = len(b'{"note":""}')


def test_input_at_the_size_limit_is_accepted(registry: Registry) -> None:
    note = "a" * (MAX_INPUT_BYTES - NOTE_OVERHEAD)

    decision = prepare_decision(registry, "post_note", {"note": note}, run_id="run_1")

    assert decision.input == {"note": note}


def test_input_over_the_size_limit_is_refused_with_the_fix(registry: Registry) -> None:
    note = "a" * (MAX_INPUT_BYTES - NOTE_OVERHEAD + 1)

    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "post_note", {"note": note}, run_id="run_1")

    message = str(info.value)
    assert f"{MAX_INPUT_BYTES + 1} bytes" in message
    assert f"the limit is {MAX_INPUT_BYTES}" in message
    assert "pass a reference" in message


@pytest.mark.parametrize(
    ("amount", "needs_approval"), [(100.0, False), (99.5, False), (100.5, True)]
)
def test_requires_approval_follows_the_approval_threshold(
    registry: Registry, amount: float, needs_approval: bool
) -> None:
    decision = prepare_decision(registry, "send_refund", refund(amount), run_id="run_1")

    assert decision.requires_approval is needs_approval


def test_tool_without_approval_policy_never_requires_approval(registry: Registry) -> None:
    decision = prepare_decision(
        registry, "send_refund", refund(5000.0), run_id="run_1", tool_version=1
    )

    assert decision.tool_version == 1
    assert decision.requires_approval is False


def test_model_instance_and_equivalent_dict_record_the_same_intent(registry: Registry) -> None:
    as_model = prepare_decision(
        registry,
        "send_refund",
        RefundInput(customer_id="cus_1", amount=12, currency="EUR"),
        run_id="run_1",
    )
    as_dict = prepare_decision(
        registry,
        "send_refund",
        {"currency": "EUR", "amount": 12, "customer_id": "cus_1"},
        run_id="run_1",
    )

    assert as_model.input_fingerprint == as_dict.input_fingerprint
    assert as_model.input == as_dict.input


def test_a_different_amount_is_a_different_fingerprint(registry: Registry) -> None:
    first = prepare_decision(registry, "send_refund", refund(12.0), run_id="run_1")
    second = prepare_decision(registry, "send_refund", refund(12.5), run_id="run_1")

    assert first.input_fingerprint != second.input_fingerprint


def test_input_model_that_does_not_round_trip_through_json_is_refused(
    registry: Registry,
) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "exclaim", {"text": "hello"}, run_id="run_1")

    message = str(info.value)
    assert "does not survive a JSON round trip" in message
    assert "'exclaim' v1" in message


def test_a_serializer_that_changes_the_value_once_is_refused_too() -> None:
    # "hello" dumps as "HELLO", which dumps as "HELLO" again: the JSON is stable, but
    # the consumer would run with another value than the one validated here.
    registry = Registry()
    registry.register(contract("shout", ShoutedInput))

    with pytest.raises(InputRejected, match="does not survive a JSON round trip"):
        prepare_decision(registry, "shout", {"text": "hello"}, run_id="run_1")
    assert prepare_decision(registry, "shout", {"text": "HELLO"}, run_id="run_1").input == {
        "text": "HELLO"
    }


def nested(depth: int, *, kind: str) -> Any:
    value: Any = CANARY
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_input_nested_thousands_deep_is_rejected_as_input(registry: Registry, kind: str) -> None:
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "store_document", {"data": nested(5_000, kind=kind)}, run_id="r")

    assert "nested" in str(info.value)
    assert str(MAX_INPUT_DEPTH) in str(info.value)
    assert CANARY not in str(info.value)


def test_a_deep_model_instance_is_rejected_as_input_too(registry: Registry) -> None:
    instance = DocumentInput.model_construct(data=nested(5_000, kind="list"))

    with pytest.raises(InputRejected):
        prepare_decision(registry, "store_document", instance, run_id="r")


def test_input_at_the_depth_limit_is_accepted(registry: Registry) -> None:
    # The model's own level counts: data sits one level below the input object.
    decision = prepare_decision(
        registry, "store_document", {"data": nested(MAX_INPUT_DEPTH - 1, kind="dict")}, run_id="r"
    )

    assert decision.input["data"] == nested(MAX_INPUT_DEPTH - 1, kind="dict")


def test_input_one_level_past_the_depth_limit_is_refused(registry: Registry) -> None:
    with pytest.raises(InputRejected):
        prepare_decision(
            registry, "store_document", {"data": nested(MAX_INPUT_DEPTH, kind="dict")}, run_id="r"
        )


# --- fields the tool does not take -----------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("send_refund", {**refund(), "refund_to": CANARY}, "refund_to"),
        ("ship", {"to": {"street": "Main St 1", "refund_to": CANARY}}, "to.refund_to"),
        (
            "ship",
            {"to": {"street": "x"}, "stops": [{"street": "y", "iban": CANARY}]},
            "stops.0.iban",
        ),
    ],
    ids=["top-level", "nested", "in-a-list"],
)
def test_a_field_the_tool_does_not_take_is_refused_by_name_never_by_value(
    registry: Registry, tool: str, arguments: dict[str, Any], field: str
) -> None:
    """Tried with a real MCP client: send_refund with an extra refund_to was recorded
    without it and answered committed, so the model believed the money went there."""
    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, tool, arguments, run_id="run_1")

    assert f"{field}: not a field of this tool" in str(info.value)
    assert info.value.problems == [f"{field}: not a field of this tool (extra_forbidden)"]
    assert CANARY not in str(info.value)


def test_a_field_a_nested_dataclass_does_not_take_is_refused_too(registry: Registry) -> None:
    arguments = {"to": {"street": "x"}, "parcel": {"kilograms": 2, "insured_for": CANARY}}

    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "ship", arguments, run_id="run_1")

    assert info.value.problems == [
        "parcel.insured_for: not a field of this tool (unexpected_keyword_argument)"
    ]
    assert CANARY not in str(info.value)


def test_a_field_name_that_is_no_name_is_not_echoed(registry: Registry) -> None:
    weird = "x" * 500 + "\x1b[31m"

    with pytest.raises(InputRejected) as info:
        prepare_decision(registry, "send_refund", {**refund(), weird: 1}, run_id="run_1")

    assert weird[:100] not in str(info.value)
    assert "\x1b" not in str(info.value)
    assert "a field name of 505 characters: not a field of this tool" in str(info.value)


def test_a_model_that_opts_in_keeps_its_extra_fields_in_the_intent(registry: Registry) -> None:
    decision = prepare_decision(registry, "open_note", {"note": "n", "tag": "t"}, run_id="run_1")

    assert decision.input == {"note": "n", "tag": "t"}


def test_a_model_that_opts_in_to_ignoring_them_drops_them_knowingly(registry: Registry) -> None:
    decision = prepare_decision(registry, "lenient_note", {"note": "n", "tag": "t"}, run_id="r")

    assert decision.input == {"note": "n"}


def test_a_model_instance_with_computed_fields_is_still_accepted(registry: Registry) -> None:
    from_model = prepare_decision(registry, "price", PricedInput(cents=250), run_id="run_1")
    from_mapping = prepare_decision(registry, "price", {"cents": 250}, run_id="run_1")

    assert from_model.input == from_mapping.input == {"cents": 250, "euros": 2.5}
    assert from_model.input_fingerprint == from_mapping.input_fingerprint
