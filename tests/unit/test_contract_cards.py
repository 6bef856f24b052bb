"""Contract cards, loading tools modules, and ``outbox contracts``."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from outbox.callback_policy import CallbackPolicy, CallbackProvider, CallbackReport, Scheme
from outbox.cli import run_command
from outbox.contracts import (
    ApprovalPolicy,
    OnUnknown,
    RetryPolicy,
    SideEffect,
    ToolContract,
)
from outbox.errors import ConfigurationError, ContractRefused
from outbox.loading import load_registry, module_list
from outbox.outcomes import EffectResult, ExecutionContext, NotFound, Reconciliation


class Ping(BaseModel):
    text: str = ""


async def execute(tool_input: Ping, ctx: ExecutionContext) -> EffectResult:
    return EffectResult()


async def reconcile(tool_input: Ping, ctx: ExecutionContext) -> Reconciliation:
    return NotFound()


def read_nothing(payload: Any, delivery: str) -> CallbackReport | None:
    return None


PAYMENTS = CallbackProvider(name="payments", scheme=Scheme.STRIPE, read=read_nothing)


def contract(side_effect: SideEffect, **options: Any) -> ToolContract[Ping]:
    if side_effect is SideEffect.DEDUPLICATED_WRITE:
        options.setdefault("dedupe_window", timedelta(hours=24))
    return ToolContract(
        name="ping",
        version=3,
        input_model=Ping,
        side_effect=side_effect,
        execute=execute,
        **options,
    )


def answers(card: str) -> dict[int, str]:
    """Answer number -> its text with the wrapping undone."""
    found: dict[int, str] = {}
    for block in re.split(r"\n(?=\d\. )", card.split("\n", 1)[1]):
        number, text = block.split(". ", 1)
        if "\nMCP hints" in text:
            text = text.split("\nMCP hints")[0]
        found[int(number)] = " ".join(text.split())
    return found


# --- cards ---------------------------------------------------------------------------


@pytest.mark.parametrize("side_effect", list(SideEffect))
def test_card_header_names_tool_version_and_class(side_effect: SideEffect) -> None:
    first_line = contract(side_effect).card().splitlines()[0]
    assert first_line == f"ping v3 \u2014 {side_effect.value}"


@pytest.mark.parametrize("side_effect", list(SideEffect))
def test_card_answers_the_eight_questions_in_order(side_effect: SideEffect) -> None:
    card = contract(side_effect, on_unknown=OnUnknown.ESCALATE).card()
    numbered = re.findall(r"^(\d)\. ([A-Z][a-z -]+):", card, flags=re.MULTILINE)
    assert numbered == [
        ("1", "Intended effect"),
        ("2", "Side-effect class"),
        ("3", "Operation id"),
        ("4", "Errors"),
        ("5", "Unknown outcome"),
        ("6", "Approval"),
        ("7", "Duplicate messages and callbacks"),
        ("8", "Evidence"),
    ]
    assert all(len(line) <= 100 for line in card.splitlines())


def test_card_ends_with_the_mcp_annotations() -> None:
    tool = contract(SideEffect.NON_REPEATABLE_WRITE, reconcile=reconcile)
    assert tool.card().splitlines()[-1] == (
        "MCP hints (exported, never policy): readOnlyHint=false, destructiveHint=true, "
        "idempotentHint=false"
    )


def test_a_read_only_card_exports_only_the_read_only_hint() -> None:
    assert contract(SideEffect.READ_ONLY).card().splitlines()[-1] == (
        "MCP hints (exported, never policy): readOnlyHint=true"
    )


def test_an_additive_only_write_says_so_and_exports_it() -> None:
    tool = contract(SideEffect.DEDUPLICATED_WRITE, additive_only=True)

    assert answers(tool.card())[2].endswith(
        "Declared additive only: it adds and never overwrites or deletes."
    )
    assert tool.card().splitlines()[-1] == (
        "MCP hints (exported, never policy): readOnlyHint=false, destructiveHint=false, "
        "idempotentHint=false"
    )
    assert "additive" not in contract(SideEffect.DEDUPLICATED_WRITE).card()


def test_card_quotes_the_description_or_asks_for_one() -> None:
    described = contract(SideEffect.READ_ONLY, description="Tell whether the host answers.")
    assert answers(described.card())[1] == "Intended effect: Tell whether the host answers."
    undescribed = answers(contract(SideEffect.READ_ONLY).card())[1]
    assert undescribed == "Intended effect: not described: pass description=... to ToolContract."


def test_read_only_card_retries_unknown_outcomes_and_needs_no_key() -> None:
    card = answers(contract(SideEffect.READ_ONLY, retry=RetryPolicy(max_attempts=4)).card())
    assert "read_only: another call changes no business state" in card[2]
    assert "where the provider accepts one" in card[3]
    assert card[4].endswith("-> outcome_unknown.")
    assert "tried again with the same input and operation id, within 4 attempts" in card[5]


def test_idempotent_write_card_sends_the_key_and_retries_the_same_input() -> None:
    card = answers(contract(SideEffect.IDEMPOTENT_WRITE).card())
    assert "guarantees one effect for equivalent calls" in card[2]
    assert "sends it to the provider as the idempotency key" in card[3]
    assert "the effect may have happened" in card[4]
    assert "repeating is safe for this class" in card[5]


def test_deduplicated_write_without_lookup_replays_the_key_only_inside_the_window() -> None:
    tool = contract(
        SideEffect.DEDUPLICATED_WRITE,
        dedupe_window=timedelta(hours=48),
        deadline=timedelta(seconds=90),
    )
    card = answers(tool.card())
    assert "only while the target still remembers that key (dedupe window 48h)" in card[2]
    assert "sends it to the provider as the idempotency key" in card[3]
    assert "inside the 48h dedupe window" in card[5]
    assert "less the 1m30s deadline" in card[5]
    assert "never replayed" in card[5]
    assert "escalated to a person" in card[5]


def test_deduplicated_write_with_lookup_reconciles_within_its_budget() -> None:
    tool = contract(
        SideEffect.DEDUPLICATED_WRITE,
        reconcile=reconcile,
        retry=RetryPolicy(reconcile_max_attempts=7),
    )
    card = answers(tool.card())
    assert card[5].startswith("Unknown outcome: looked up with reconcile()")
    assert "NotFound (proven absent) -> back to prepared" in card[5]
    assert "up to 7 lookups, then escalated to a person" in card[5]
    assert "operation.reconciled" in card[8]
    assert "execute() or reconcile()" in card[8]


def test_non_repeatable_write_with_escalation_goes_to_a_person_at_once() -> None:
    tool = contract(SideEffect.NON_REPEATABLE_WRITE, on_unknown=OnUnknown.ESCALATE)
    card = answers(tool.card())
    assert "a repeat would be a second effect" in card[2]
    assert "escalated at once to a person" in card[5]
    assert "reconcile" not in card[8]


def test_non_repeatable_write_with_lookup_is_reconciled() -> None:
    tool = contract(SideEffect.NON_REPEATABLE_WRITE, reconcile=reconcile)
    card = answers(tool.card())
    assert "looked up with reconcile()" in card[5]
    assert "up to 5 lookups" in card[5]


def test_errors_answer_spells_out_the_retry_policy() -> None:
    policy = RetryPolicy(
        max_attempts=6,
        initial_backoff=timedelta(milliseconds=250),
        max_backoff=timedelta(seconds=1, milliseconds=500),
        multiplier=3.0,
        jitter=0.1,
        retryable_codes=frozenset({"connect_failed", "rate_limited"}),
    )
    card = answers(contract(SideEffect.IDEMPOTENT_WRITE, retry=policy).card())
    assert "DefinitiveRejection -> rejected, final, never retried" in card[4]
    assert (
        "up to 6 attempts in all, and only for the codes connect_failed, rate_limited" in (card[4])
    )
    assert "backoff of 250ms growing x3 to at most 1.5s (+/-10% jitter)" in card[4]
    assert "with no retry left it ends rejected" in card[4]
    assert "at its 30s deadline (it is cancelled) -> outcome_unknown" in card[4]


def test_approval_answer_explains_policy_and_what_voids_a_grant() -> None:
    tool = contract(SideEffect.IDEMPOTENT_WRITE, approval=ApprovalPolicy.above("amount", 500))
    card = answers(tool.card())
    assert card[6].startswith("Approval: approval required when amount > 500;")
    for voided_by in ("intent changes", "new operation id", "expires", "denies"):
        assert voided_by in card[6]
    assert "approval grant (approver, expiry)" in card[8]
    unapproved = answers(contract(SideEffect.IDEMPOTENT_WRITE).card())
    assert unapproved[6].startswith("Approval: none required.")
    assert "approval grant" not in unapproved[8]


def test_every_card_explains_operation_id_duplicates_and_evidence() -> None:
    card = answers(contract(SideEffect.READ_ONLY).card())
    assert "created by record_decision" in card[3]
    assert "together with the outbox row, before the first attempt" in card[3]
    assert "acked and counted as a duplicate, never executed" in card[7]
    assert "provider reference" in card[8]
    assert "lifecycle events" in card[8]


def test_a_card_without_callbacks_says_none_move_its_operations() -> None:
    card = answers(contract(SideEffect.IDEMPOTENT_WRITE).card())
    assert "No provider callbacks are declared" in card[7]
    assert "callback" not in card[5]
    assert "callback" not in card[8]


def test_a_callback_that_settles_waits_deduplicates_and_is_evidence() -> None:
    tool = contract(
        SideEffect.NON_REPEATABLE_WRITE,
        on_unknown=OnUnknown.ESCALATE,
        callbacks=CallbackPolicy(PAYMENTS, settles_unknown=True, wait=timedelta(minutes=2)),
    )
    card = answers(tool.card())
    assert "after waiting up to 2m for a verified callback from payments" in card[5]
    assert "escalated at once" not in card[5]
    assert "a verified success callback from payments settles it (committed" in card[5]
    assert "a verified failure callback is evidence only" in card[5]
    assert "kept once by their event id" in card[7]
    assert "answered 2xx and changes nothing" in card[7]
    assert "never move an operation backwards" in card[7]
    assert "waits for that attempt's record" in card[7]
    assert "operation.callback_received" in card[8]
    assert "operation.reconciled result=committed method=callback" in card[8]


def test_a_callback_that_may_not_settle_is_evidence_for_a_person() -> None:
    tool = contract(
        SideEffect.DEDUPLICATED_WRITE,
        reconcile=reconcile,
        callbacks=CallbackPolicy(PAYMENTS),
    )
    card = answers(tool.card())
    assert card[5].startswith("Unknown outcome: looked up with reconcile()")
    assert "a verified success callback from payments is evidence for a person" in card[5]
    assert "never settles it" in card[5]
    # A lookup does not wait for a callback.
    assert "waiting" not in card[5]
    assert "method=callback" not in card[8]


def test_a_definitive_failure_callback_authorises_a_retry_like_a_lookups_not_found() -> None:
    tool = contract(
        SideEffect.NON_REPEATABLE_WRITE,
        reconcile=reconcile,
        callbacks=CallbackPolicy(PAYMENTS, settles_unknown=True, failure_definitive=True),
    )
    card = answers(tool.card())
    assert (
        "a verified failure callback proves the effect absent, as a lookup's NotFound does: "
        "back to prepared" in card[5]
    )
    assert "unless a success was reported too (then escalated, contradicted)" in card[5]


# --- loading tools modules -------------------------------------------------------------


TOOLS_MODULE = """
from __future__ import annotations

from pydantic import BaseModel

from outbox import EffectResult, Registry, SideEffect, ToolContract


class Ping(BaseModel):
    text: str = ""


async def ping(value: Ping, ctx: object) -> EffectResult:
    return EffectResult()


def build_registry() -> Registry:
    registry = Registry()
    for name in NAMES:
        registry.register(
            ToolContract(
                name=name, version=1, input_model=Ping,
                side_effect=SideEffect.READ_ONLY, execute=ping,
            )
        )
    return registry
"""

ToolsModule = Callable[..., str]


@pytest.fixture
def tools_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ToolsModule]:
    """Writes a module under a fresh name and returns that name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(*names: str, expose: str = "registry", source: str | None = None) -> str:
        module = f"tools_{uuid.uuid4().hex[:12]}"
        if source is None:
            source = TOOLS_MODULE + f"\nNAMES = {list(names)!r}\n"
            if expose == "registry":
                source += "registry = build_registry()\n"
            elif expose == "nothing":
                source += "del build_registry\n"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        written.append(module)
        return module

    yield write
    for module in written:
        sys.modules.pop(module, None)


def test_loads_the_registry_attribute(tools_module: ToolsModule) -> None:
    registry = load_registry([tools_module("alpha", "beta")])
    assert [c.name for c in registry] == ["alpha", "beta"]


def test_calls_build_registry_when_there_is_no_registry(tools_module: ToolsModule) -> None:
    registry = load_registry([tools_module("gamma", expose="build_registry")])
    assert [c.name for c in registry] == ["gamma"]


def test_merges_several_modules(tools_module: ToolsModule) -> None:
    registry = load_registry([tools_module("alpha"), tools_module("beta", expose="build_registry")])
    assert [c.label for c in registry] == ["'alpha' v1", "'beta' v1"]


def test_the_same_module_twice_counts_each_contract_once(tools_module: ToolsModule) -> None:
    module = tools_module("alpha")
    assert len(load_registry([module, module])) == 1


def test_one_name_and_version_in_two_modules_is_refused_naming_both(
    tools_module: ToolsModule,
) -> None:
    first, second = tools_module("alpha", "beta"), tools_module("beta")
    with pytest.raises(ContractRefused) as refused:
        load_registry([first, second])
    assert "'beta' v1" in str(refused.value)
    assert repr(first) in str(refused.value)
    assert repr(second) in str(refused.value)


def test_no_modules_says_how_to_name_them() -> None:
    with pytest.raises(ConfigurationError) as missing:
        load_registry([])
    assert "--tools" in str(missing.value)
    assert "OUTBOX_TOOLS" in str(missing.value)


def test_a_missing_module_is_named_with_the_error_class_only() -> None:
    with pytest.raises(ConfigurationError) as missing:
        load_registry(["no_such_tools_module.tools"])
    assert str(missing.value).startswith(
        "cannot import tools module 'no_such_tools_module.tools': ModuleNotFoundError;"
    )
    assert missing.value.__suppress_context__


def test_a_missing_dependency_is_named(tools_module: ToolsModule) -> None:
    module = tools_module(source="from __future__ import annotations\nimport not_installed_dep\n")
    with pytest.raises(ConfigurationError) as missing:
        load_registry([module])
    assert "ModuleNotFoundError (it imports 'not_installed_dep', which is not installed)" in str(
        missing.value
    )


def test_an_import_error_does_not_repeat_the_module_source(tools_module: ToolsModule) -> None:
    module = tools_module(
        source="from __future__ import annotations\n"
        "raise RuntimeError('token sk_live_hunter2 rejected')\n"
    )
    with pytest.raises(ConfigurationError) as failed:
        load_registry([module])
    assert f"cannot import tools module {module!r}: RuntimeError;" in str(failed.value)
    assert "hunter2" not in str(failed.value)


def test_a_contract_refused_at_import_keeps_its_message(tools_module: ToolsModule) -> None:
    with pytest.raises(ContractRefused, match="name must match"):
        load_registry([tools_module("Not A Name")])


def test_a_failing_build_registry_is_named_without_its_message(
    tools_module: ToolsModule,
) -> None:
    module = tools_module(
        source="from __future__ import annotations\n"
        "def build_registry():\n    raise ValueError('password=hunter2')\n"
    )
    with pytest.raises(ConfigurationError) as failed:
        load_registry([module])
    assert str(failed.value) == f"{module}.build_registry() failed: ValueError"


def test_a_module_without_a_registry_says_what_to_expose(tools_module: ToolsModule) -> None:
    module = tools_module("alpha", expose="nothing")
    with pytest.raises(ConfigurationError) as missing:
        load_registry([module])
    assert "must expose `registry` (an outbox.Registry) or `build_registry()`" in str(missing.value)


def test_a_registry_attribute_of_the_wrong_type_is_refused(tools_module: ToolsModule) -> None:
    module = tools_module(source="from __future__ import annotations\nregistry = {}\n")
    with pytest.raises(ConfigurationError) as wrong:
        load_registry([module])
    assert str(wrong.value) == f"{module}.registry is a dict, not an outbox.Registry"


def test_a_value_that_is_no_module_path_is_not_echoed() -> None:
    with pytest.raises(ConfigurationError) as wrong:
        load_registry(["outbox.sandbox.tools", "postgres://u:hunter2@db/x"])
    assert "tools module #2 is not a dotted module path" in str(wrong.value)
    assert "hunter2" not in str(wrong.value)


def test_module_list_splits_commas_and_drops_blanks() -> None:
    assert module_list(["a.b, c", "", " d ,"]) == ["a.b", "c", "d"]


# --- outbox contracts -------------------------------------------------------------------


@pytest.fixture
def no_tools_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_TOOLS", raising=False)


@pytest.mark.usefixtures("no_tools_env")
def test_contracts_prints_every_card(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(["contracts", "--tools", "outbox.sandbox.tools"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if "\u2014" in line]
    assert headers == [
        "get_refund v1 \u2014 read_only",
        "send_email v1 \u2014 non_repeatable_write",
        "send_refund v1 \u2014 deduplicated_write",
    ]
    assert out.count("8. Evidence:") == 3


@pytest.mark.usefixtures("no_tools_env")
def test_contracts_json_lists_cards_and_annotations(capsys: pytest.CaptureFixture[str]) -> None:
    from outbox.sandbox.tools import registry

    assert run_command(["contracts", "--tools", "outbox.sandbox.tools", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed == [
        {
            "name": c.name,
            "version": c.version,
            "side_effect": c.side_effect.value,
            "card": c.card(),
            "mcp_annotations": c.mcp_annotations(),
        }
        for c in registry
    ]


@pytest.mark.usefixtures("no_tools_env")
def test_contracts_takes_repeated_flags(
    tools_module: ToolsModule, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = tools_module("zeta")
    assert run_command(["contracts", "--tools", "outbox.sandbox.tools", "--tools", extra]) == 0
    assert "zeta v1 \u2014 read_only" in capsys.readouterr().out


def test_contracts_falls_back_to_outbox_tools(
    tools_module: ToolsModule, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_TOOLS", f"outbox.sandbox.tools, {tools_module('zeta')}")
    assert run_command(["contracts", "--json"]) == 0
    names = [entry["name"] for entry in json.loads(capsys.readouterr().out)]
    assert names == ["get_refund", "send_email", "send_refund", "zeta"]


def test_contracts_flags_win_over_outbox_tools(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_TOOLS", "no_such_tools_module")
    assert run_command(["contracts", "--tools", "outbox.sandbox.tools"]) == 0
    assert "send_refund v1" in capsys.readouterr().out


@pytest.mark.usefixtures("no_tools_env")
def test_contracts_without_tools_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_command(["contracts"]) == 2
    err = capsys.readouterr().err
    assert "outbox contracts: configuration error: no tools modules given" in err
    assert "OUTBOX_TOOLS" in err


@pytest.mark.usefixtures("no_tools_env")
def test_contracts_with_a_duplicate_tool_fails(
    tools_module: ToolsModule, capsys: pytest.CaptureFixture[str]
) -> None:
    clash = tools_module("send_refund")
    assert run_command(["contracts", "--tools", f"outbox.sandbox.tools,{clash}"]) == 1
    assert "registered by both tools module 'outbox.sandbox.tools'" in capsys.readouterr().err
