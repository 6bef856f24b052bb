"""Tool contracts and the registry that refuses the unsafe ones (docs/design.md section 3)."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import textwrap
import types
import typing
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

import pydantic
import typing_extensions
from pydantic import BaseModel

from outbox.callback_policy import CallbackPolicy, CallbackProvider, policy_problems
from outbox.errors import ContractRefused, ToolNotRegistered
from outbox.outcomes import EffectResult, ExecutionContext, Reconciliation

InputT = TypeVar("InputT", bound=BaseModel)

TOOL_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")


class SideEffect(StrEnum):
    """What repeating the call does to the world; decides what a retry may do."""

    READ_ONLY = "read_only"
    """Another call changes no business state."""
    IDEMPOTENT_WRITE = "idempotent_write"
    """The target guarantees one intended effect for equivalent calls."""
    DEDUPLICATED_WRITE = "deduplicated_write"
    """Safe to repeat only with the same idempotency key, inside the target's window."""
    NON_REPEATABLE_WRITE = "non_repeatable_write"
    """Never repeated unless reconciliation proves the first attempt did not commit."""


class OnUnknown(StrEnum):
    """What to do when an attempt's outcome is unknown."""

    RECONCILE = "reconcile"
    ESCALATE = "escalate"


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how fast the runtime may try again.

    Retry state (attempts, next attempt time, last error) lives in the operation row,
    so it survives any crash; this policy only says what the limits are.
    """

    max_attempts: int = 3
    initial_backoff: timedelta = timedelta(seconds=1)
    max_backoff: timedelta = timedelta(minutes=5)
    multiplier: float = 2.0
    jitter: float = 0.2
    """Fraction of each delay drawn at random, so that workers do not retry in step."""
    retryable_codes: frozenset[str] = frozenset()
    """NotSent codes that may be retried; empty means every NotSent is retryable."""
    reconcile_max_attempts: int = 5
    """Inconclusive lookups allowed before the operation is escalated to a human."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_attempts < 1:
            problems.append("max_attempts must be at least 1")
        if self.reconcile_max_attempts < 1:
            problems.append("reconcile_max_attempts must be at least 1")
        if self.initial_backoff <= timedelta(0):
            problems.append("initial_backoff must be positive")
        if self.max_backoff < self.initial_backoff:
            problems.append("max_backoff must not be shorter than initial_backoff")
        if self.multiplier < 1.0:
            problems.append("multiplier must be at least 1.0")
        if not 0.0 <= self.jitter <= 1.0:
            problems.append("jitter must be between 0.0 and 1.0")
        if problems:
            raise ContractRefused("retry policy refused: " + "; ".join(problems))

    def may_retry(self, attempts_made: int, code: str) -> bool:
        if attempts_made >= self.max_attempts:
            return False
        return not self.retryable_codes or code in self.retryable_codes

    def backoff(self, attempts_made: int, rng: random.Random | None = None) -> timedelta:
        """Delay before the next attempt, after ``attempts_made`` (>= 1) attempts."""
        initial = self.initial_backoff.total_seconds()
        ceiling = self.max_backoff.total_seconds()
        exponent = max(0, attempts_made - 1)
        if self.multiplier > 1.0:
            # Past this exponent the delay is capped anyway; stopping there keeps
            # multiplier ** exponent from overflowing after very many attempts.
            exponent = min(exponent, math.ceil(math.log(ceiling / initial, self.multiplier)))
        capped = min(initial * self.multiplier**exponent, ceiling)
        spread = capped * self.jitter
        draw = (rng or random).uniform(-spread, spread)
        return timedelta(seconds=max(0.0, capped + draw))


@dataclass(frozen=True)
class ApprovalPolicy:
    """Whether a person must approve an operation before its effect is attempted."""

    required: bool = False
    when: Callable[[Any], bool] | None = None
    """Predicate on the validated input; approval is required when it returns True."""
    explanation: str = "no approval required"

    @classmethod
    def never(cls) -> ApprovalPolicy:
        return cls()

    @classmethod
    def always(cls) -> ApprovalPolicy:
        return cls(required=True, explanation="every operation needs an approval")

    @classmethod
    def above(cls, field_name: str, threshold: float) -> ApprovalPolicy:
        """Approval required when ``input.<field_name> > threshold``."""

        def exceeds(model: Any) -> bool:
            return bool(getattr(model, field_name) > threshold)

        return cls(
            required=True,
            when=exceeds,
            explanation=f"approval required when {field_name} > {threshold}",
        )

    def applies_to(self, validated_input: BaseModel) -> bool:
        if not self.required:
            return False
        return self.when is None or self.when(validated_input)


Execute = Callable[[InputT, ExecutionContext], Awaitable[EffectResult]]
Reconcile = Callable[[InputT, ExecutionContext], Awaitable[Reconciliation]]


@dataclass(frozen=True)
class ToolContract(Generic[InputT]):
    """A side-effecting tool and the rules the runtime enforces around it."""

    name: str
    version: int
    input_model: type[InputT]
    side_effect: SideEffect
    execute: Execute[InputT]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    reconcile: Reconcile[InputT] | None = None
    approval: ApprovalPolicy = field(default_factory=ApprovalPolicy.never)
    dedupe_window: timedelta | None = None
    """For deduplicated writes: how long the target keeps idempotency keys."""
    on_unknown: OnUnknown = OnUnknown.RECONCILE
    deadline: timedelta = timedelta(seconds=30)
    """The runtime cancels a call that runs longer; the lease outlives it by a margin."""
    description: str = ""
    """The intended business effect, in a sentence, for the contract card."""
    additive_only: bool = False
    """For writes: the effect only adds (a new record, a new message) and never overwrites
    or deletes anything. Only the tool's author can know this, so it is opt-in; without
    it a write is exported as possibly destructive, MCP's cautious default."""
    callbacks: CallbackPolicy | None = None
    """The provider's signed callbacks about this tool's effects, and how much they may
    settle (docs/design.md section 5, "Callbacks"). None: no callback moves these
    operations."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)

    @property
    def label(self) -> str:
        return f"{self.name!r} v{self.version}"

    def mcp_annotations(self) -> dict[str, bool]:
        """MCP tool annotations derived from this contract (exported, never imported).

        MCP reads ``destructiveHint: false`` as "performs only additive updates", which no
        side-effect class establishes, so only ``additive_only`` claims it. A read-only
        tool says nothing more: the other hints are meaningful only for writes.
        ``idempotentHint`` is true only for an ``idempotent_write``: a deduplicated write
        is safe to repeat only with the same key, and a client retry without it is a new
        decision.
        """
        if self.side_effect is SideEffect.READ_ONLY:
            return {"readOnlyHint": True}
        return {
            "readOnlyHint": False,
            "destructiveHint": not self.additive_only,
            "idempotentHint": self.side_effect is SideEffect.IDEMPOTENT_WRITE,
        }

    def card(self) -> str:
        """The contract card: written answers to the eight questions of docs/design.md
        section 3, derived from the contract's fields so that it cannot drift from them."""
        return _contract_card(self)

    @property
    def refuses_extra_fields(self) -> bool:
        """Whether an input field the model does not declare is refused, at every level
        of the input. It is unless the input model itself sets ``extra`` to ``"allow"``
        or ``"ignore"``: pydantic's default drops such a field silently, so an agent that
        sent ``refund_to`` would hear "committed" for a refund that went elsewhere."""
        return self.input_model.model_config.get("extra") not in ("allow", "ignore")

    def parse_input(self, raw: Any) -> InputT:
        """``raw`` (the agent's input, JSON-like) validated by the input model, with
        :attr:`refuses_extra_fields` applied: raises ``pydantic.ValidationError``. What
        the model stored is read back with the model's own rules instead (its dump may
        hold computed fields, which are no input)."""
        extra: Literal["forbid"] | None = "forbid" if self.refuses_extra_fields else None
        return self.input_model.model_validate(raw, extra=extra)

    def input_schema(self) -> dict[str, Any]:
        """The JSON schema of the input that MCP and pydantic-ai advertise: the model's,
        with ``"additionalProperties": false`` on every object it declares when extra
        fields are refused, so a client learns the rule before it is refused by it."""
        schema = self.input_model.model_json_schema()
        if self.refuses_extra_fields:
            _close_objects(schema)
        return schema


class Registry:
    """The tools a process knows, by name and version.

    ``register`` refuses contracts that cannot be made safe, with a message that names
    the problem and the fix; nothing about a refused contract is kept.
    """

    def __init__(self) -> None:
        self._contracts: dict[tuple[str, int], ToolContract[Any]] = {}

    def register(self, contract: ToolContract[InputT]) -> ToolContract[InputT]:
        problems = contract_problems(contract)
        if contract.key in self._contracts:
            problems.append(f"tool {contract.label} is already registered")
        problems.extend(self._provider_clashes(contract))
        if problems:
            raise ContractRefused(
                f"tool {contract.label} refused: " + "; ".join(problems), problems=problems
            )
        self._contracts[contract.key] = contract
        return contract

    def get(self, name: str, version: int | None = None) -> ToolContract[Any]:
        """The contract for ``name`` at ``version``, or its latest version if None."""
        if version is None:
            versions = [v for (n, v) in self._contracts if n == name]
            if versions:
                return self._contracts[(name, max(versions))]
        elif (name, version) in self._contracts:
            return self._contracts[(name, version)]
        wanted = f"{name!r}" + ("" if version is None else f" v{version}")
        raise ToolNotRegistered(
            f"tool {wanted} is not registered; registered: {self.describe() or 'none'}"
        )

    def describe(self) -> str:
        return ", ".join(c.label for c in self)

    def callback_providers(self) -> dict[str, CallbackProvider]:
        """Every provider whose callbacks some registered tool declares, by name."""
        return {
            contract.callbacks.provider.name: contract.callbacks.provider
            for contract in self
            if contract.callbacks is not None
        }

    def _provider_clashes(self, contract: ToolContract[Any]) -> list[str]:
        """One route serves a provider, so its payloads can be verified and read one way
        only: every contract that names it must name the same provider."""
        policy = contract.callbacks
        if not isinstance(policy, CallbackPolicy) or not isinstance(
            policy.provider, CallbackProvider
        ):
            return []
        return [
            f"callback provider {policy.provider.name!r} is already declared by tool "
            f"{other.label} with another scheme or reader; one route serves a provider, so "
            "share one CallbackProvider between the tools it reports on"
            for other in self
            if other.callbacks is not None
            and other.callbacks.provider.name == policy.provider.name
            and other.callbacks.provider != policy.provider
        ]

    def __iter__(self) -> Iterator[ToolContract[Any]]:
        return iter(sorted(self._contracts.values(), key=lambda c: c.key))

    def __len__(self) -> int:
        return len(self._contracts)

    def __contains__(self, key: object) -> bool:
        return key in self._contracts


# Where a JSON schema holds other schemas. Only these are walked: a mapping under
# "properties" names fields (one may well be called "properties"), not keywords.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _close_objects(schema: Any) -> None:
    """Set ``additionalProperties: false`` on every object schema that lists properties
    (a model, a TypedDict, a dataclass), in place. A mapping field (``dict[str, X]``)
    lists none: its keys are data, and it stays open."""
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "object" and "properties" in schema:
        schema["additionalProperties"] = False
    for keyword in _SUBSCHEMA:
        _close_objects(schema.get(keyword))
    for keyword in _SUBSCHEMA_LISTS:
        for subschema in schema.get(keyword) or ():
            _close_objects(subschema)
    for keyword in _SUBSCHEMA_MAPS:
        for subschema in (schema.get(keyword) or {}).values():
            _close_objects(subschema)


def contract_problems(contract: ToolContract[Any]) -> list[str]:
    """Everything that makes a contract unsafe to run, in words that say the fix."""
    problems: list[str] = []
    if not isinstance(contract.name, str) or not TOOL_NAME.fullmatch(contract.name):
        problems.append(
            f"name must match {TOOL_NAME.pattern} (it becomes a routing key and a metric label)"
        )
    if not isinstance(contract.version, int) or contract.version < 1:
        problems.append("version must be an integer >= 1; a changed contract is a new version")
    if not (isinstance(contract.input_model, type) and issubclass(contract.input_model, BaseModel)):
        problems.append("input_model must be a pydantic BaseModel subclass")
    else:
        problems.extend(
            f"input field {path} is a secret ({kind}); credentials belong to the tool's "
            "runtime configuration, never to the recorded intent"
            for path, kind in secret_fields(contract.input_model)
        )
    if not isinstance(contract.side_effect, SideEffect):
        problems.append(f"side_effect must be one of {[s.value for s in SideEffect]}")
    if not callable(contract.execute):
        problems.append("execute must be callable")
    if contract.reconcile is not None and not callable(contract.reconcile):
        problems.append("reconcile must be callable")
    if (
        contract.side_effect is SideEffect.NON_REPEATABLE_WRITE
        and contract.reconcile is None
        and contract.on_unknown is not OnUnknown.ESCALATE
    ):
        problems.append(
            "a non_repeatable_write needs reconcile= (a lookup that finds the effect) or an "
            "explicit on_unknown=OnUnknown.ESCALATE (a person checks every unknown outcome)"
        )
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE:
        if contract.dedupe_window is None or contract.dedupe_window <= timedelta(0):
            problems.append(
                "a deduplicated_write needs dedupe_window= (how long the target keeps "
                "idempotency keys, e.g. timedelta(hours=24) for Stripe)"
            )
    elif contract.dedupe_window is not None:
        problems.append("dedupe_window applies only to a deduplicated_write")
    if contract.deadline <= timedelta(0):
        problems.append("deadline must be positive")
    if not isinstance(contract.additive_only, bool):
        problems.append("additive_only must be True or False")
    elif contract.additive_only and contract.side_effect is SideEffect.READ_ONLY:
        problems.append(
            "additive_only applies only to writes; a read_only tool changes nothing to add to"
        )
    if contract.callbacks is not None:
        problems.extend(
            policy_problems(
                contract.callbacks, read_only=contract.side_effect is SideEffect.READ_ONLY
            )
        )
    return problems


_SECRET_TYPES: tuple[type, ...] = (pydantic.SecretStr, pydantic.SecretBytes, pydantic.Secret)


def secret_fields(model: type[BaseModel]) -> list[tuple[str, str]]:
    """(dotted path, type name) of every secret-typed field, nested models included."""
    found: list[tuple[str, str]] = []
    _collect_secret_fields(model, model.__name__, found, set())
    return found


def _collect_secret_fields(
    container: type, prefix: str, found: list[tuple[str, str]], seen: set[type]
) -> None:
    if container in seen:
        return
    seen.add(container)
    for name, annotation in _field_annotations(container).items():
        path = f"{prefix}.{name}"
        for nested in _flatten(annotation):
            origin = typing.get_origin(nested) or nested
            if isinstance(origin, type) and issubclass(origin, _SECRET_TYPES):
                found.append((path, origin.__name__))
            elif isinstance(nested, type) and _field_annotations(nested):
                _collect_secret_fields(nested, path, found, seen)


def _field_annotations(container: type) -> dict[str, Any]:
    """Field name -> annotation for pydantic models, dataclasses and TypedDicts."""
    if issubclass(container, BaseModel):
        return {name: info.annotation for name, info in container.model_fields.items()}
    if dataclasses.is_dataclass(container) or typing_extensions.is_typeddict(container):
        try:
            return typing.get_type_hints(container)
        except (NameError, TypeError):
            # Unresolvable forward references: fall back to the raw annotations, which
            # still name secret types spelled directly.
            return dict(getattr(container, "__annotations__", {}))
    return {}


def _flatten(annotation: Any) -> Iterator[Any]:
    """The annotation and every type nested in it (Optional, list[...], dict[...], ...)."""
    yield annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for argument in typing.get_args(annotation):
            yield from _flatten(argument)


# --- contract cards ------------------------------------------------------------------

_CARD_WIDTH = 88

_CLASS_MEANING = {
    SideEffect.READ_ONLY: "another call changes no business state, so any attempt may be repeated.",
    SideEffect.IDEMPOTENT_WRITE: "the target guarantees one effect for equivalent calls, so "
    "the same input may be sent again.",
    SideEffect.DEDUPLICATED_WRITE: "a repeat is safe only with the same idempotency key, and "
    "only while the target still remembers that key (dedupe window {window}); past the "
    "window a repeat could be a second effect.",
    SideEffect.NON_REPEATABLE_WRITE: "a repeat would be a second effect, so it is attempted "
    "again only after a lookup proves the previous attempt did not commit, or when a person "
    "decides so.",
}


def _contract_card(contract: ToolContract[Any]) -> str:
    answers = [
        (
            "Intended effect",
            contract.description.strip() or "not described: pass description=... to ToolContract.",
        ),
        (
            "Side-effect class",
            f"{contract.side_effect.value}: "
            + _CLASS_MEANING[contract.side_effect].format(
                window=_duration(contract.dedupe_window) if contract.dedupe_window else "unset"
            )
            + (
                " Declared additive only: it adds and never overwrites or deletes."
                if contract.additive_only
                else ""
            ),
        ),
        ("Operation id", _operation_id_answer(contract)),
        ("Errors", _errors_answer(contract)),
        ("Unknown outcome", _unknown_outcome_answer(contract)),
        ("Approval", _approval_answer(contract)),
        (
            "Duplicate messages and callbacks",
            "a consumer claims the operation by its id (prepared -> in_flight, with a lease, "
            "committed before the call). A delivery whose claim fails (a redelivery, a "
            "republished message, a second consumer) is acked and counted as a duplicate, "
            "never executed. Messages carry no input: the consumer loads the operation from "
            "Postgres and checks its fingerprint. " + _callback_duplicates_answer(contract),
        ),
        ("Evidence", _evidence_answer(contract)),
    ]
    hints = ", ".join(
        f"{name}={str(value).lower()}" for name, value in contract.mcp_annotations().items()
    )
    lines = [f"{contract.name} v{contract.version} \u2014 {contract.side_effect.value}"]
    lines.extend(
        _wrapped(f"{number}. {title}: {text}", indent="   ")
        for number, (title, text) in enumerate(answers, start=1)
    )
    lines.append(f"MCP hints (exported, never policy): {hints}")
    return "\n".join(lines)


def _operation_id_answer(contract: ToolContract[Any]) -> str:
    if contract.side_effect in (SideEffect.IDEMPOTENT_WRITE, SideEffect.DEDUPLICATED_WRITE):
        use = (
            "and sends it to the provider as the idempotency key: that is what makes a repeat safe"
        )
    else:
        use = "to send as the provider's idempotency key where the provider accepts one"
    return (
        "a UUID created by record_decision and committed in the caller's transaction "
        "together with the outbox row, before the first attempt. Every attempt, lookup and "
        f"approval of the operation uses it; execute receives it as ctx.idempotency_key {use}."
    )


def _errors_answer(contract: ToolContract[Any]) -> str:
    retry = contract.retry
    codes = (
        f", and only for the codes {', '.join(sorted(retry.retryable_codes))}"
        if retry.retryable_codes
        else ""
    )
    return (
        "DefinitiveRejection -> rejected, final, never retried. NotSent (the request "
        "provably never left) -> back to prepared and tried again with the same operation "
        f"id, up to {retry.max_attempts} attempts in all{codes}, after a backoff of "
        f"{_duration(retry.initial_backoff)} growing x{retry.multiplier:g} to at most "
        f"{_duration(retry.max_backoff)} (+/-{retry.jitter:.0%} jitter); with no retry "
        "left it ends rejected, since that attempt provably never reached the provider"
        + _after_unknown(contract)
        + ". OutcomeUnknown, any "
        f"other exception, and a call still running at its {_duration(contract.deadline)} "
        "deadline (it is cancelled) -> outcome_unknown"
        + (
            "."
            if contract.side_effect is SideEffect.READ_ONLY
            else ": the effect may have happened."
        )
    )


def _after_unknown(contract: ToolContract[Any]) -> str:
    """What changes once an earlier attempt's outcome was unknown (consumer/policy.py
    after_attempt): "rejected" must still mean the effect did not happen."""
    if contract.side_effect is SideEffect.READ_ONLY:
        return ""
    refusal = (
        "" if contract.side_effect is SideEffect.DEDUPLICATED_WRITE else "a DefinitiveRejection or "
    )
    then = (
        "looked up with reconcile() at once"
        if contract.reconcile is not None
        else "escalated to a person (reason effect_possible)"
    )
    return (
        f" - unless an earlier attempt's outcome was unknown and no lookup has proved its "
        f"effect absent since: then {refusal}NotSent with no retry left goes to "
        f"outcome_unknown and is {then}, never rejected"
    )


def _unknown_outcome_answer(contract: ToolContract[Any]) -> str:
    answer = _unknown_outcome_without_callbacks(contract)
    policy = contract.callbacks
    if policy is None:
        return answer
    provider = policy.provider.name
    success = (
        f"a verified success callback from {provider} settles it (committed, with the "
        "provider's reference, at any time before a person or a retry has it)"
        if policy.settles_unknown
        else f"a verified success callback from {provider} is evidence for a person, shown "
        "in the timeline, and never settles it (a later lookup's NotFound then goes to a "
        "person instead of a retry)"
    )
    failure = (
        "a verified failure callback proves the effect absent, as a lookup's NotFound does: "
        "back to prepared for another attempt with the same operation id, unless a success "
        "was reported too (then escalated, contradicted)"
        if policy.failure_definitive
        else "a verified failure callback is evidence only"
    )
    return f"{answer} Callbacks: {success}; {failure}."


def _waits_for_a_callback(contract: ToolContract[Any]) -> str:
    """How an answer about an unknown outcome without a lookup starts, given the wait."""
    policy = contract.callbacks
    if policy is None or contract.reconcile is not None or policy.wait <= timedelta(0):
        return ""
    return (
        f"after waiting up to {_duration(policy.wait)} for a verified callback from "
        f"{policy.provider.name}, "
    )


def _unknown_outcome_without_callbacks(contract: ToolContract[Any]) -> str:
    retry = contract.retry
    escalate = "escalated to a person with the evidence"
    waited = _waits_for_a_callback(contract)
    if contract.on_unknown is OnUnknown.ESCALATE:
        when = waited or "at once "
        return (
            f"escalated {when}to a person, with the evidence (on_unknown=escalate): nothing "
            "is retried or looked up automatically."
        )
    if contract.reconcile is not None:
        return (
            "looked up with reconcile(), under the same operation id: Found -> committed with "
            "the provider reference; NotFound (proven absent) -> back to prepared for a new "
            "attempt with the same operation id and so the same key; StillUnknown, an error, "
            "or a lookup past the deadline -> looked up again after backoff, up to "
            f"{retry.reconcile_max_attempts} lookups, then {escalate}."
        )
    budget = f"{retry.max_attempts} attempts in all"
    if contract.side_effect in (SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE):
        return (
            f"no reconcile(); {waited}repeating is safe for this class, so it goes back to "
            f"prepared and is tried again with the same input and operation id, within {budget}; "
            f"past that, {escalate}."
        )
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE and contract.dedupe_window:
        return (
            f"no reconcile(); {waited}tried again with the same idempotency key while the key "
            f"is inside the {_duration(contract.dedupe_window)} dedupe window (counted from the "
            f"first attempt, less the {_duration(contract.deadline)} deadline), within "
            f"{budget}. Past the window or the budget the key may be pruned and is never "
            f"replayed: {escalate}."
        )
    return f"no reconcile(): {waited}{escalate}."


def _approval_answer(contract: ToolContract[Any]) -> str:
    policy = contract.approval
    if not policy.required:
        return (
            "none required. A changed intent is a new fingerprint and a new operation "
            "anyway, never an edit of this one."
        )
    return (
        f"{policy.explanation}; decided from the validated input when the decision is "
        "recorded. A grant binds the operation id, the intent fingerprint, the approver "
        "and an expiry; retries of this operation with unchanged intent reuse it. It no "
        "longer counts when the intent changes (amount, recipient or destination: a new "
        "fingerprint), for a new operation id, after it expires, or once an approver denies "
        "the operation. Without a valid grant the effect is not attempted."
    )


def _evidence_answer(contract: ToolContract[Any]) -> str:
    found_by = "execute() or reconcile()" if contract.reconcile is not None else "execute()"
    lookup = (
        " For an unknown outcome, the lookup's result and method "
        "(operation.reconciled result=committed|not_found method=lookup)."
        if contract.reconcile is not None and contract.on_unknown is OnUnknown.RECONCILE
        else ""
    )
    approval = " The approval grant (approver, expiry)." if contract.approval.required else ""
    callbacks = ""
    if contract.callbacks is not None:
        settled = (
            ", and operation.reconciled result=committed method=callback when one settled "
            "an unknown outcome"
            if contract.callbacks.settles_unknown
            else ""
        )
        callbacks = (
            f" Verified callbacks from {contract.callbacks.provider.name}: each an "
            "operation.callback_received event (its inbox id, status and provider reference) "
            f"and a row of the callbacks inbox (event id, payload digest){settled}; one that "
            "disagrees with the recorded ending is operation.contradicted."
        )
    return (
        f"the provider reference and result returned by {found_by}, stored on the "
        "operation, and its append-only lifecycle events (operation.prepared, "
        "operation.attempted, then committed / rejected / outcome_unknown / escalated), "
        f"each with attempt, policy and reason codes.{lookup}{callbacks}{approval} A person "
        "who resolves an escalation records their name and evidence."
    )


def _callback_duplicates_answer(contract: ToolContract[Any]) -> str:
    if contract.callbacks is None:
        return (
            "No provider callbacks are declared: a callback naming one of these operations "
            "is kept as evidence, never a move."
        )
    return (
        f"Verified callbacks from {contract.callbacks.provider.name} are kept once by their "
        "event id in the callbacks inbox: a redelivered one is answered 2xx and changes "
        "nothing, and callbacks never move an operation backwards; one that arrives while "
        "an attempt is in flight waits for that attempt's record."
    )


def _duration(value: timedelta) -> str:
    """24h, 5s, 200ms, 1m30s: short enough for a card line."""
    milliseconds = round(value.total_seconds() * 1000)
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    if milliseconds % 1000:
        return f"{milliseconds / 1000:g}s"
    seconds = milliseconds // 1000
    parts = []
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def _wrapped(text: str, *, indent: str) -> str:
    # Identifiers such as ctx.idempotency_key and in_flight must stay whole.
    return textwrap.fill(
        text,
        width=_CARD_WIDTH,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )
