"""The contract card: a contract's answers to the eight questions of docs/design.md
section 3, in English, derived from its fields so that the card cannot drift from them
(``ToolContract.card``, ``outbox contracts``, the console's operation page)."""

from __future__ import annotations

import textwrap
from datetime import timedelta
from typing import Any

from outbox.contracts import OnUnknown, SideEffect, ToolContract

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


def contract_card(contract: ToolContract[Any]) -> str:
    """The written answers to the eight questions of docs/design.md section 3, derived
    from the contract's fields (:meth:`ToolContract.card`)."""
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


def provider_check(contract: ToolContract[Any]) -> str:
    """What a person checks at the provider before resolving an operation of this tool,
    from the same fields as the card's answers 3, 5 and 8: where the effect would be,
    under which key, and what each finding lets them decide."""
    provider = contract.provider_name
    if contract.side_effect is SideEffect.READ_ONLY:
        return (
            f"nothing: a read changes nothing at {provider}, so resolving it prepared (try "
            "again) or rejected cannot duplicate an effect."
        )
    key = (
        f"Ask {provider} for the effect it made with this operation's id as its idempotency "
        "key (execute sends it as ctx.idempotency_key)"
    )
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE and contract.dedupe_window:
        key += (
            f"; it keeps keys {_duration(contract.dedupe_window)}, so past that search for "
            "the intent above instead"
        )
    elif contract.side_effect is SideEffect.NON_REPEATABLE_WRITE:
        key += ", or, where it takes no key, for the intent above made after the first attempt"
    lookups = (
        " The reconciler's lookups asked the same; their answers are in the timeline."
        if contract.reconcile is not None
        else ""
    )
    callbacks = (
        f" Verified callbacks from {contract.callbacks.provider.name} are listed below: "
        "a success there is the provider's own word that the effect happened."
        if contract.callbacks is not None
        else ""
    )
    return (
        f"{key}.{lookups}{callbacks} Found: resolve it committed, with {provider}'s "
        "reference. Proven absent: prepared (another attempt with the same id) or rejected. "
        "Not sure: leave it escalated; a guess can make a second effect or lose one."
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
