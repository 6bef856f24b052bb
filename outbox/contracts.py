"""Tool contracts and the registry that refuses the unsafe ones (docs/design.md section 3)."""

from __future__ import annotations

import dataclasses
import random
import re
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

from outbox.backoff import exponential_delay
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
        delay = exponential_delay(
            attempts_made,
            first=self.initial_backoff.total_seconds(),
            longest=self.max_backoff.total_seconds(),
            multiplier=self.multiplier,
            jitter=self.jitter,
            rng=rng,
        )
        return timedelta(seconds=delay)


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


@dataclass(frozen=True)
class ProviderLimits:
    """What a provider allows, shared by every consumer and the reconciler: calls
    (attempts and lookups together) per second, with ``burst`` of them at once after a
    quiet spell, and at most ``concurrent_calls`` out at any moment. A call waits its
    turn and its place in hand, before its claim, so a burst of decisions slows the
    effects instead of meeting the provider's 429s."""

    calls_per_second: float | None = None
    burst: int = 1
    concurrent_calls: int | None = None

    def __post_init__(self) -> None:
        problems = []
        rate = self.calls_per_second
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 100_000
        ):
            problems.append("calls_per_second must be a number above 0 and at most 100000")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            problems.append("burst must be an integer of at least 1")
        at_once = self.concurrent_calls
        if at_once is not None and (
            isinstance(at_once, bool) or not isinstance(at_once, int) or not 1 <= at_once <= 10_000
        ):
            problems.append("concurrent_calls must be an integer from 1 to 10000")
        if rate is None and at_once is None:
            problems.append("declare calls_per_second, concurrent_calls or both")
        if problems:
            raise ContractRefused("provider limits refused: " + "; ".join(problems))

    @property
    def interval(self) -> timedelta | None:
        """The time one call takes of the provider's rate; None without a rate."""
        if self.calls_per_second is None:
            return None
        return timedelta(seconds=1 / self.calls_per_second)


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
    provider: str | None = None
    """Who performs the effect, as the breaker knows it: tools that share a provider
    share one verdict on whether it is reachable. None: the tool is its own provider."""
    outage_tolerance: timedelta = timedelta(hours=1)
    """How long an operation may wait for its provider to come back before a person is
    asked (``provider_unavailable``). Waiting spends no attempt and no lookup: a payment
    may say 15 minutes, an email a day."""
    provider_limits: ProviderLimits | None = None
    """The provider's declared rate, shared by every consumer; every tool that names the
    provider declares the same limits. None: no limit but the provider's own 429s."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)

    @property
    def provider_name(self) -> str:
        """The provider whose health decides whether this tool is called now."""
        return self.provider if self.provider is not None else self.name

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
        # Imported when asked: the card module reads this one's types.
        from outbox.contract_card import contract_card

        return contract_card(self)

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
        if not problems:
            problems.extend(self._limit_clashes(contract))
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

    def _limit_clashes(self, contract: ToolContract[Any]) -> list[str]:
        """One provider, one allowance: every contract that names it declares the same
        limits, or the consumers would share a rate none of them declared."""
        return [
            f"provider {contract.provider_name!r} is declared with other limits by tool "
            f"{other.label}; declare one ProviderLimits for every tool of a provider"
            for other in self
            if other.provider_name == contract.provider_name
            and other.provider_limits != contract.provider_limits
        ]

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
    if contract.provider is not None and (
        not isinstance(contract.provider, str) or not TOOL_NAME.fullmatch(contract.provider)
    ):
        problems.append(
            f"provider must match {TOOL_NAME.pattern} (it becomes a metric label and a key "
            "in the provider health table)"
        )
    if not isinstance(contract.outage_tolerance, timedelta) or contract.outage_tolerance <= (
        timedelta(0)
    ):
        problems.append(
            "outage_tolerance must be a positive timedelta: how long an operation may wait "
            "for its provider before a person is asked"
        )
    if not isinstance(contract.additive_only, bool):
        problems.append("additive_only must be True or False")
    elif contract.additive_only and contract.side_effect is SideEffect.READ_ONLY:
        problems.append(
            "additive_only applies only to writes; a read_only tool changes nothing to add to"
        )
    if contract.provider_limits is not None and not isinstance(
        contract.provider_limits, ProviderLimits
    ):
        problems.append("provider_limits must be a ProviderLimits or None")
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
