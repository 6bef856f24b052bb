from __future__ import annotations

import dataclasses
import random
from datetime import timedelta
from typing import Any, cast

import pytest
from pydantic import BaseModel, ConfigDict, Secret, SecretBytes, SecretStr
from typing_extensions import TypedDict

from outbox.callback_policy import CallbackPolicy, CallbackProvider, CallbackReport, Scheme
from outbox.contracts import (
    ApprovalPolicy,
    OnUnknown,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
)
from outbox.errors import ContractRefused, ToolNotRegistered
from outbox.outcomes import (
    DefinitiveRejection,
    EffectResult,
    ExecutionContext,
    Found,
    NotSent,
    OutcomeUnknown,
    Reconciliation,
    StillUnknown,
)


class RefundInput(BaseModel):
    customer_id: str
    amount: float


async def execute_refund(tool_input: RefundInput, ctx: ExecutionContext) -> EffectResult:
    return EffectResult(provider_reference=f"re_{ctx.idempotency_key}")


async def reconcile_refund(tool_input: RefundInput, ctx: ExecutionContext) -> Reconciliation:
    return Found(provider_reference=f"re_{ctx.idempotency_key}")


def refund_contract(
    *,
    name: str = "send_refund",
    version: int = 1,
    side_effect: SideEffect = SideEffect.IDEMPOTENT_WRITE,
    **options: Any,
) -> ToolContract[RefundInput]:
    return ToolContract(
        name=name,
        version=version,
        input_model=RefundInput,
        side_effect=side_effect,
        execute=execute_refund,
        **options,
    )


def contract_for(input_model: type[BaseModel]) -> ToolContract[Any]:
    return ToolContract(
        name="with_secret",
        version=1,
        input_model=input_model,
        side_effect=SideEffect.READ_ONLY,
        execute=cast(Any, execute_refund),
    )


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    registry.register(refund_contract(name="existing_tool"))
    return registry


def assert_refused(registry: Registry, contract: ToolContract[Any], *key_words: str) -> str:
    """Registering ``contract`` fails with every key word in the message, changing nothing."""
    existing = registry.get("existing_tool")
    size = len(registry)

    with pytest.raises(ContractRefused) as info:
        registry.register(contract)

    message = str(info.value)
    for word in key_words:
        assert word in message
    assert len(registry) == size
    assert registry.get("existing_tool") is existing
    if contract.key != existing.key:
        assert contract.key not in registry
    return message


def test_non_repeatable_write_without_reconcile_or_escalation_is_refused(
    registry: Registry,
) -> None:
    contract = refund_contract(side_effect=SideEffect.NON_REPEATABLE_WRITE)

    assert_refused(registry, contract, "non_repeatable_write", "reconcile=", "OnUnknown.ESCALATE")


def test_non_repeatable_write_with_explicit_escalation_is_accepted(registry: Registry) -> None:
    contract = refund_contract(
        side_effect=SideEffect.NON_REPEATABLE_WRITE, on_unknown=OnUnknown.ESCALATE
    )

    assert registry.register(contract) is contract
    assert registry.get("send_refund") is contract


def test_non_repeatable_write_with_reconcile_is_accepted(registry: Registry) -> None:
    contract = refund_contract(
        side_effect=SideEffect.NON_REPEATABLE_WRITE, reconcile=reconcile_refund
    )

    assert registry.register(contract) is contract
    assert ("send_refund", 1) in registry


class SecretStrInput(BaseModel):
    token: SecretStr


class SecretBytesInput(BaseModel):
    key: SecretBytes


class SecretIntInput(BaseModel):
    pin: Secret[int]


class OptionalSecretInput(BaseModel):
    customer_id: str
    password: SecretStr | None = None


class SecretListInput(BaseModel):
    tokens: list[SecretStr]


class PaymentCredentials(BaseModel):
    account: str
    api_key: SecretStr


class NestedSecretInput(BaseModel):
    amount: float
    payment: PaymentCredentials


@pytest.mark.parametrize(
    ("input_model", "path", "kind"),
    [
        (SecretStrInput, "SecretStrInput.token", "SecretStr"),
        (SecretBytesInput, "SecretBytesInput.key", "SecretBytes"),
        (SecretIntInput, "SecretIntInput.pin", "Secret"),
        (OptionalSecretInput, "OptionalSecretInput.password", "SecretStr"),
        (SecretListInput, "SecretListInput.tokens", "SecretStr"),
        (NestedSecretInput, "NestedSecretInput.payment.api_key", "SecretStr"),
    ],
)
def test_secret_input_fields_are_refused_naming_the_field(
    registry: Registry, input_model: type[BaseModel], path: str, kind: str
) -> None:
    message = assert_refused(
        registry, contract_for(input_model), f"input field {path} is a secret", "runtime config"
    )

    assert f"({kind})" in message


class CredentialsDict(TypedDict):
    account: str
    api_key: SecretStr


@dataclasses.dataclass
class CredentialsRecord:
    account: str
    api_key: SecretStr


class TypedDictSecretInput(BaseModel):
    payment: CredentialsDict


class DataclassSecretInput(BaseModel):
    payment: CredentialsRecord


@pytest.mark.parametrize(
    ("input_model", "path"),
    [
        (TypedDictSecretInput, "TypedDictSecretInput.payment.api_key"),
        (DataclassSecretInput, "DataclassSecretInput.payment.api_key"),
    ],
)
def test_secrets_nested_in_typed_dicts_and_dataclasses_are_refused(
    registry: Registry, input_model: type[BaseModel], path: str
) -> None:
    assert_refused(registry, contract_for(input_model), f"input field {path} is a secret")


def test_same_name_and_version_twice_is_refused_and_keeps_the_first(registry: Registry) -> None:
    first = registry.get("existing_tool")
    again = refund_contract(name="existing_tool", side_effect=SideEffect.READ_ONLY)

    assert_refused(registry, again, "'existing_tool' v1 is already registered")

    assert registry.get("existing_tool", 1) is first


def test_deduplicated_write_without_dedupe_window_is_refused(registry: Registry) -> None:
    contract = refund_contract(side_effect=SideEffect.DEDUPLICATED_WRITE)

    assert_refused(registry, contract, "deduplicated_write needs dedupe_window=")


def test_deduplicated_write_with_dedupe_window_is_accepted(registry: Registry) -> None:
    contract = refund_contract(
        side_effect=SideEffect.DEDUPLICATED_WRITE, dedupe_window=timedelta(hours=24)
    )

    assert registry.register(contract) is contract


def test_dedupe_window_on_another_side_effect_class_is_refused(registry: Registry) -> None:
    contract = refund_contract(
        side_effect=SideEffect.IDEMPOTENT_WRITE, dedupe_window=timedelta(hours=24)
    )

    assert_refused(registry, contract, "dedupe_window applies only to a deduplicated_write")


@pytest.mark.parametrize(
    "name",
    ["Send_refund", "send refund", "x'; drop table", "", "a" * 65, "1refund", "send_refund\n"],
)
def test_unsafe_tool_names_are_refused(registry: Registry, name: str) -> None:
    assert_refused(registry, refund_contract(name=name), "name must match", "routing key")


def test_longest_allowed_tool_name_is_accepted(registry: Registry) -> None:
    contract = refund_contract(name="a" * 64)

    assert registry.register(contract) is contract


@pytest.mark.parametrize("version", [0, -1])
def test_version_below_one_is_refused(registry: Registry, version: int) -> None:
    assert_refused(registry, refund_contract(version=version), "version must be an integer >= 1")


def test_input_model_that_is_not_a_pydantic_model_is_refused(registry: Registry) -> None:
    contract = ToolContract(
        name="untyped_tool",
        version=1,
        input_model=cast(Any, dict),
        side_effect=SideEffect.READ_ONLY,
        execute=cast(Any, execute_refund),
    )

    assert_refused(registry, contract, "input_model must be a pydantic BaseModel subclass")


def test_every_problem_of_a_contract_is_reported_at_once(registry: Registry) -> None:
    contract = refund_contract(
        name="Bad Name", version=0, side_effect=SideEffect.NON_REPEATABLE_WRITE
    )

    assert_refused(registry, contract, "name must match", "version must be", "reconcile=")


def test_get_without_version_returns_the_latest_registered_version() -> None:
    registry = Registry()
    v2 = registry.register(refund_contract(version=2))
    v3 = registry.register(refund_contract(version=3))
    v1 = registry.register(refund_contract(version=1))

    assert registry.get("send_refund") is v3
    assert registry.get("send_refund", 1) is v1
    assert registry.get("send_refund", 2) is v2


def test_get_unknown_tool_lists_what_is_registered() -> None:
    registry = Registry()
    registry.register(refund_contract(name="send_refund", version=1))
    registry.register(refund_contract(name="lookup_order", version=4))

    with pytest.raises(ToolNotRegistered) as info:
        registry.get("send_payout")

    message = str(info.value)
    assert "'send_payout' is not registered" in message
    assert "'send_refund' v1" in message
    assert "'lookup_order' v4" in message


def test_get_unknown_version_names_the_version_asked_for() -> None:
    registry = Registry()
    registry.register(refund_contract(version=1))

    with pytest.raises(ToolNotRegistered) as info:
        registry.get("send_refund", 9)

    assert "'send_refund' v9 is not registered" in str(info.value)
    assert "'send_refund' v1" in str(info.value)


def test_get_on_an_empty_registry_says_nothing_is_registered() -> None:
    with pytest.raises(ToolNotRegistered) as info:
        Registry().get("send_refund")

    assert "registered: none" in str(info.value)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"jitter": -0.1}, "jitter must be between 0.0 and 1.0"),
        ({"jitter": 1.5}, "jitter must be between 0.0 and 1.0"),
        (
            {"initial_backoff": timedelta(seconds=10), "max_backoff": timedelta(seconds=5)},
            "max_backoff must not be shorter than initial_backoff",
        ),
        ({"initial_backoff": timedelta(0)}, "initial_backoff must be positive"),
        ({"multiplier": 0.5}, "multiplier must be at least 1.0"),
        ({"reconcile_max_attempts": 0}, "reconcile_max_attempts must be at least 1"),
    ],
)
def test_retry_policy_refuses_impossible_limits(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ContractRefused) as info:
        RetryPolicy(**options)

    assert "retry policy refused" in str(info.value)
    assert problem in str(info.value)


def exact_policy(max_backoff: timedelta = timedelta(seconds=10)) -> RetryPolicy:
    return RetryPolicy(
        initial_backoff=timedelta(seconds=1), multiplier=2.0, max_backoff=max_backoff, jitter=0.0
    )


@pytest.mark.parametrize(
    ("attempts_made", "seconds"), [(1, 1), (2, 2), (3, 4), (4, 8), (5, 10), (6, 10), (40, 10)]
)
def test_backoff_doubles_then_stays_at_max_backoff(attempts_made: int, seconds: int) -> None:
    assert exact_policy().backoff(attempts_made) == timedelta(seconds=seconds)


def test_backoff_after_very_many_attempts_is_still_max_backoff() -> None:
    assert exact_policy().backoff(5000) == timedelta(seconds=10)


def test_backoff_with_jitter_stays_within_the_jitter_band() -> None:
    policy = RetryPolicy(
        initial_backoff=timedelta(seconds=1),
        multiplier=2.0,
        max_backoff=timedelta(seconds=60),
        jitter=0.25,
    )
    rng = random.Random(20240607)

    for attempts_made in range(1, 10):
        nominal = min(2.0 ** (attempts_made - 1), 60.0)
        delays = [policy.backoff(attempts_made, rng).total_seconds() for _ in range(200)]
        assert all(nominal * 0.75 <= delay <= nominal * 1.25 for delay in delays)
        # Jitter exists so that workers do not retry in step: the draws must differ.
        assert len(set(delays)) > 1


def test_backoff_with_the_same_seed_is_reproducible() -> None:
    policy = RetryPolicy(jitter=0.5)

    first = [policy.backoff(n, random.Random(7)) for n in range(1, 6)]
    second = [policy.backoff(n, random.Random(7)) for n in range(1, 6)]

    assert first == second


def test_may_retry_stops_at_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)

    assert policy.may_retry(1, "connect_refused")
    assert policy.may_retry(2, "connect_refused")
    assert not policy.may_retry(3, "connect_refused")
    assert not policy.may_retry(4, "connect_refused")


def test_may_retry_only_listed_codes_when_codes_are_given() -> None:
    policy = RetryPolicy(max_attempts=3, retryable_codes=frozenset({"connect_refused"}))

    assert policy.may_retry(1, "connect_refused")
    assert not policy.may_retry(1, "dns_failure")
    assert not policy.may_retry(3, "connect_refused")


def test_approval_policy_never_and_always() -> None:
    small = RefundInput(customer_id="cus_1", amount=1)

    assert not ApprovalPolicy.never().applies_to(small)
    assert ApprovalPolicy.always().applies_to(small)


@pytest.mark.parametrize(
    ("amount", "needs_approval"), [(50.0, False), (100.0, False), (100.01, True), (5000.0, True)]
)
def test_approval_policy_above_applies_strictly_above_the_threshold(
    amount: float, needs_approval: bool
) -> None:
    policy = ApprovalPolicy.above("amount", 100)

    assert policy.applies_to(RefundInput(customer_id="cus_1", amount=amount)) is needs_approval
    assert "amount > 100" in policy.explanation


def test_a_read_only_tool_claims_only_that_it_is_read_only() -> None:
    # destructiveHint and idempotentHint are meaningful only for writes (MCP spec).
    assert refund_contract(side_effect=SideEffect.READ_ONLY).mcp_annotations() == {
        "readOnlyHint": True
    }


@pytest.mark.parametrize(
    ("side_effect", "idempotent"),
    [
        (SideEffect.IDEMPOTENT_WRITE, True),
        # Safe to repeat only with the same key: a client retry without it is a new decision.
        (SideEffect.DEDUPLICATED_WRITE, False),
        (SideEffect.NON_REPEATABLE_WRITE, False),
    ],
)
def test_a_write_is_destructive_unless_declared_additive_only(
    side_effect: SideEffect, idempotent: bool
) -> None:
    # destructiveHint=false means "performs only additive updates": no side-effect class
    # establishes that, only the contract's author can.
    default = refund_contract(side_effect=side_effect)
    additive = refund_contract(side_effect=side_effect, additive_only=True)

    assert default.mcp_annotations() == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": idempotent,
    }
    assert additive.mcp_annotations() == {
        "readOnlyHint": False,
        "destructiveHint": False,
        "idempotentHint": idempotent,
    }


def test_additive_only_on_a_read_only_tool_is_refused(registry: Registry) -> None:
    contract = refund_contract(side_effect=SideEffect.READ_ONLY, additive_only=True)

    assert_refused(registry, contract, "additive_only applies only to writes")


def test_additive_only_must_be_a_bool(registry: Registry) -> None:
    # A truthy string would otherwise export destructiveHint=false.
    contract = refund_contract(additive_only=cast(bool, "yes"))

    assert_refused(registry, contract, "additive_only must be True or False")


def test_additive_only_defaults_to_false_and_a_write_may_declare_it(registry: Registry) -> None:
    assert refund_contract().additive_only is False
    contract = refund_contract(name="append_note", additive_only=True)

    assert registry.register(contract) is contract


@pytest.mark.parametrize("signal", [DefinitiveRejection, NotSent, OutcomeUnknown])
def test_outcome_signals_keep_a_well_formed_code(signal: type[DefinitiveRejection]) -> None:
    error = signal("card_declined")

    assert error.code == "card_declined"
    assert "card_declined" in str(error)


@pytest.mark.parametrize(
    "code", ["card declined", "Card_Declined", "", "_leading", "card_declined\n", "x" * 65]
)
def test_outcome_codes_outside_the_label_alphabet_are_refused(code: str) -> None:
    with pytest.raises(ValueError, match="outcome code must match") as info:
        DefinitiveRejection(code)

    assert "metric label" in str(info.value)


def test_still_unknown_checks_its_code_too() -> None:
    assert StillUnknown().code == "lookup_inconclusive"
    with pytest.raises(ValueError, match="outcome code must match"):
        StillUnknown(code="Provider Down")


# --- the input schema a contract advertises ------------------------------------------


class Line(BaseModel):
    sku: str
    # A field named like a JSON Schema keyword must stay a field.
    properties: dict[str, int] = {}


class LooseLine(BaseModel):
    model_config = ConfigDict(extra="allow")

    sku: str


class OrderInput(BaseModel):
    lines: list[Line]
    gift: LooseLine | None = None
    labels: dict[str, str] = {}


class OpenOrderInput(BaseModel):
    model_config = ConfigDict(extra="allow")

    lines: list[Line]


def test_the_advertised_schema_closes_every_object_the_input_model_declares() -> None:
    schema = contract_for(OrderInput).input_schema()

    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Line"]["additionalProperties"] is False
    # Validation refuses what a nested model would allow: the schema says so too.
    assert schema["$defs"]["LooseLine"]["additionalProperties"] is False
    # A mapping's keys are its values, not fields: it stays open to any key.
    assert schema["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert schema["$defs"]["Line"]["properties"]["properties"]["additionalProperties"] == {
        "type": "integer"
    }
    assert "additionalProperties" not in schema["$defs"]["Line"]["properties"]
    assert OrderInput.model_json_schema().get("additionalProperties") is None  # not mutated


def test_a_model_that_sets_extra_itself_is_advertised_as_it_says() -> None:
    contract = contract_for(OpenOrderInput)

    assert contract.input_schema() == OpenOrderInput.model_json_schema()
    assert contract.input_schema()["additionalProperties"] is True


# --- callback policies -------------------------------------------------------------------


def read_nothing(payload: Any, delivery: str) -> CallbackReport | None:
    return None


PAYMENTS = CallbackProvider(name="payments", scheme=Scheme.STRIPE, read=read_nothing)


def test_a_write_may_declare_its_providers_callbacks(registry: Registry) -> None:
    policy = CallbackPolicy(PAYMENTS, settles_unknown=True, wait=timedelta(minutes=1))
    registered = registry.register(refund_contract(callbacks=policy))

    assert registered.callbacks is policy
    assert refund_contract().callbacks is None


def test_callbacks_on_a_read_only_tool_are_refused(registry: Registry) -> None:
    contract = refund_contract(side_effect=SideEffect.READ_ONLY, callbacks=CallbackPolicy(PAYMENTS))
    assert_refused(registry, contract, "callbacks", "read_only")


def test_a_negative_wait_for_a_callback_is_refused(registry: Registry) -> None:
    contract = refund_contract(callbacks=CallbackPolicy(PAYMENTS, wait=timedelta(seconds=-1)))
    assert_refused(registry, contract, "wait", "negative")


@pytest.mark.parametrize("name", ["", "Payments", "pay/ments", "pay.ments", "p" * 65, "1pay"])
def test_a_provider_name_that_is_no_route_segment_is_refused(registry: Registry, name: str) -> None:
    provider = CallbackProvider(name=name, scheme=Scheme.STANDARD_WEBHOOKS, read=read_nothing)
    contract = refund_contract(callbacks=CallbackPolicy(provider))
    assert_refused(registry, contract, "provider name must match")


def test_callbacks_that_are_no_policy_are_refused(registry: Registry) -> None:
    contract = refund_contract(callbacks=cast(Any, {"provider": "payments"}))
    assert_refused(registry, contract, "callbacks must be a CallbackPolicy")


def test_one_provider_read_two_ways_is_refused_naming_both_tools(registry: Registry) -> None:
    registry.register(refund_contract(name="send_refund", callbacks=CallbackPolicy(PAYMENTS)))
    other = CallbackProvider(name="payments", scheme=Scheme.STANDARD_WEBHOOKS, read=read_nothing)

    message = assert_refused(
        registry, refund_contract(name="send_payout", callbacks=CallbackPolicy(other)), "payments"
    )
    assert "send_refund" in message
    assert "one route serves a provider" in message


def test_tools_may_share_one_provider(registry: Registry) -> None:
    registry.register(refund_contract(name="send_refund", callbacks=CallbackPolicy(PAYMENTS)))
    registry.register(
        refund_contract(name="send_payout", callbacks=CallbackPolicy(PAYMENTS, wait=timedelta(1)))
    )

    assert registry.callback_providers() == {"payments": PAYMENTS}


def test_a_report_reads_an_idempotency_key_as_the_operation_it_names() -> None:
    key = "0b6f1ab4-7a52-4e0c-9d59-3a43f3f1c2aa"
    report = CallbackReport.for_key("evt_1", "committed", key, provider_reference="re_1")

    assert str(report.operation_id) == key
    assert report.status == "committed"
    assert CallbackReport.for_key("evt_2", "pending", "not-a-uuid").operation_id is None
