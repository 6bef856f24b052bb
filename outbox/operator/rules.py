"""What an operator may do to an operation, and the writes that do it: one set of rules
and one write path for every front end (``outbox ops``/``outbox approvals`` and the
console), as DBOS's ``_workflow_commands.py`` serves its CLI and its conductor.

The resolution vocabulary is the one stored in ``operation.resolved`` events and spoken
by the CLI's flags: ``committed`` (``--committed``), ``not_committed``
(``--not-committed``: one more attempt under the same idempotency key, the console's
"retry" button) and ``rejected`` (``--rejected``). The console posts these same values.

Each write takes the caller's :class:`~outbox.store.Store`, so it runs in the one
transaction of the command or request (:func:`outbox.connections.command_transaction`):
the checks and the write commit together, and a refusal anywhere changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from uuid import UUID

from outbox import store
from outbox.contracts import Registry, SideEffect
from outbox.errors import IllegalTransition, OperationNotFound, ToolNotRegistered
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import Approval, ApprovalDecision, Operation
from outbox.operator import input as person_input
from outbox.replay import replay_window_passed
from outbox.states import OperationState, legal_targets
from outbox.store import Store

S = OperationState


class Resolution(StrEnum):
    """What a person found out about an escalated operation (the ``decision`` of its
    ``operation.resolved`` event)."""

    COMMITTED = "committed"
    NOT_COMMITTED = "not_committed"
    REJECTED = "rejected"

    @property
    def target(self) -> OperationState:
        """The state the operation moves to."""
        return _TARGETS[self]

    @property
    def label(self) -> str:
        """What the console's choice says."""
        return _LABELS[self]

    @property
    def flag(self) -> str:
        """The ``outbox ops resolve`` flag that chooses it."""
        return "--" + self.value.replace("_", "-")


_TARGETS = {
    Resolution.COMMITTED: S.COMMITTED,
    Resolution.NOT_COMMITTED: S.PREPARED,
    Resolution.REJECTED: S.REJECTED,
}
_LABELS = {
    Resolution.COMMITTED: "It happened: committed",
    Resolution.REJECTED: "It must not happen: rejected",
    Resolution.NOT_COMMITTED: "It provably did not happen: retry once more",
}


def current_operation(runner: Store, operation_id: UUID, change: str) -> Operation:
    """The operation as the hot tables hold it, to ``change`` (resolve, cancel, ...).
    One that moved to history is refused (IllegalTransition), saying so: it settled for
    good, and nothing of it can change."""
    try:
        return runner.run(store.get_operation(operation_id))
    except OperationNotFound:
        archived = runner.run(store.archived_facts(operation_id))
        if archived is None:
            raise
    operation = archived.operation
    raise IllegalTransition(
        f"{operation.display_id} is archived: it settled {operation.state} at "
        f"{_utc(archived.settled_at)} and moved to history at {_utc(archived.archived_at)}, "
        f"where nothing of it changes. It cannot be {change}; nothing was changed "
        f"(outbox ops show {operation.display_id} shows it)"
    )


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def resolvable(operation: Operation, force: bool) -> None:
    """Only a person's escalation is theirs to settle; an unknown outcome is the
    reconciler's until they say otherwise (``force``)."""
    if operation.state is S.ESCALATED:
        return
    if operation.state is S.OUTCOME_UNKNOWN:
        if force:
            return
        raise IllegalTransition(
            f"{operation.display_id} is outcome_unknown: the reconciler is still settling it. "
            "Resolve it yourself only with evidence of the outcome, and --force; nothing "
            "was changed"
        )
    targets = ", ".join(legal_targets(operation.state)) or "nowhere (terminal)"
    raise IllegalTransition(
        f"{operation.display_id} is {operation.state}: only an escalated operation can be "
        f"resolved (or an outcome_unknown one, with --force). From {operation.state} the "
        f"state machine allows: {targets}; nothing was changed"
    )


def retry_refusal(
    registry: Registry | None, operation: Operation, now: datetime | None = None
) -> str | None:
    """Why one more attempt under the same key is not safe, or None when it is.

    Only a deduplicated write has something to fear from a retry the person is wrong
    about: inside its dedupe window the target answers the replayed key with the first
    outcome, past it a mistaken "it did not happen" becomes a second effect. So a retry
    is offered only while :func:`outbox.replay.replay_window_passed` says the window
    holds, with or without a lookup (a person's word is not a lookup's answer), and it
    needs the contract, which alone knows the window and the deadline. Every other class
    is answered from the stored row.
    """
    if operation.side_effect is not SideEffect.DEDUPLICATED_WRITE:
        return None
    tool = f"{operation.tool_name} v{operation.tool_version}"
    if registry is None:
        return (
            f"{tool} is a deduplicated write and no tools are loaded here (--tools or "
            "OUTBOX_TOOLS), so the runtime cannot tell whether a retry is safe: its dedupe "
            "window may have passed"
        )
    try:
        contract = registry.get(operation.tool_name, operation.tool_version)
    except ToolNotRegistered:
        return (
            f"{tool} is not in the loaded tools, so the runtime cannot tell whether a retry "
            "is safe: its dedupe window may have passed"
        )
    if replay_window_passed(operation, contract, now=now or datetime.now(UTC)):
        return (
            "the provider's deduplication window (from the first attempt, less the tool's "
            "deadline) has passed: a retry could be a second effect"
        )
    return None


def refusal(
    resolution: Resolution,
    registry: Registry | None,
    operation: Operation,
    now: datetime | None = None,
) -> str | None:
    """Why this resolution is not offered for this operation, or None when it is."""
    if resolution is Resolution.COMMITTED and operation.attempts == 0:
        # Escalated at its first claim (tampered, unreadable, undeliverable): the
        # runtime never called the provider, so nothing it did can have happened.
        return "it was never attempted: no call was made, so the effect cannot have happened"
    if resolution is Resolution.NOT_COMMITTED:
        return retry_refusal(registry, operation, now)
    return None


@dataclass(frozen=True)
class Resolved:
    before: Operation
    after: Operation


def resolve(
    runner: Store,
    operation_id: UUID,
    resolution: Resolution,
    *,
    by: str,
    evidence: str | None,
    provider_reference: str | None,
    force: bool,
    registry: Registry | None,
    batch_id: UUID | None = None,
) -> Resolved:
    """Settle an escalated operation (an unknown outcome only with ``force``) as the
    person found it, with their name and evidence in its ``operation.resolved`` event.

    ``evidence`` and ``provider_reference`` are what the person typed, judged here by
    :mod:`outbox.operator.input` before anything is read. ``batch_id`` names the batch
    (:mod:`outbox.operator.batch`) this resolution is one of: the same rules, one more
    attribute on the event."""
    kept = person_input.evidence(evidence)
    reference = person_input.provider_reference(
        provider_reference, committed=resolution is Resolution.COMMITTED
    )
    current = current_operation(runner, operation_id, "resolved")
    resolvable(current, force)
    refused = refusal(resolution, registry, current)
    if refused is not None:
        raise IllegalTransition(
            f"{current.display_id}: {resolution} is not offered: {refused}; nothing was changed"
        )
    # The transition is fenced on the state just read: if anything moved the operation
    # since, the statement matches no row and nothing is written.
    after = runner.run(
        store.resolve_operation(
            operation_id,
            source=current.state,
            target=resolution.target,
            decision=str(resolution),
            resolved_by=by,
            evidence=kept,
            provider_reference=reference,
            batch_id=batch_id,
        )
    )
    return Resolved(before=current, after=after)


def cancel(runner: Store, operation_id: UUID, *, by: str, reason: str) -> Operation:
    """End a prepared operation as rejected before any worker attempts it; ``reason`` is
    judged as evidence (:func:`outbox.operator.input.evidence`)."""
    kept = person_input.evidence(reason)
    current = current_operation(runner, operation_id, "cancelled")
    if current.state is not S.PREPARED:
        raise IllegalTransition(
            f"{current.display_id} is {current.state}: only a prepared operation, which "
            "no worker holds, can be cancelled (an escalated one is resolved with "
            "`outbox ops resolve --rejected`); nothing was changed"
        )
    return runner.run(
        store.resolve_operation(
            operation_id,
            source=S.PREPARED,
            target=S.REJECTED,
            decision="cancel",
            resolved_by=by,
            evidence=kept,
        )
    )


def approvable(operation: Operation) -> None:
    if operation.state.is_terminal:
        raise IllegalTransition(
            f"{operation.display_id} is {operation.state}: there is nothing left to decide"
        )


@dataclass(frozen=True)
class ApprovalDecided:
    operation: Operation
    """The operation as read in the deciding transaction (its state before the grant)."""
    approval: Approval
    by: str
    intent: str
    """The keyed short fingerprint of the intent the decision is bound to."""


def decide_approval(
    runner: Store,
    operation_id: UUID,
    decision: ApprovalDecision,
    *,
    by: str,
    ttl: timedelta | None,
    shown: str | None,
) -> ApprovalDecided:
    """Grant or deny one operation's intent: the one path every front end writes an
    approval decision through.

    ``shown`` is the fingerprint of the intent the person judged: the full one (the
    console's form carries the one its page showed) or the keyed short one that
    ``outbox approvals pending`` and ``outbox ops show`` print. A decision is refused,
    with nothing written, unless the operation's intent is still that one. With None
    (``outbox approvals grant`` without ``--intent``) the person judged no particular
    printout, and the decision binds the intent read here, in the same transaction, and
    the confirmation prints it. Either way the approval row carries the fingerprint
    read and checked here: if the row changed after this read, the consumer refuses a
    grant for another intent.

    ``ttl`` is the lifetime the person chose, or None: a grant without one gets the
    default, a denial must not have one (:func:`outbox.operator.input.approval_ttl`).
    """
    lifetime = person_input.approval_ttl(decision, ttl)
    current = current_operation(runner, operation_id, f"{decision} approval")
    approvable(current)
    key = runner.run(store.fingerprint_key())
    now_short = keyed_fingerprint(key, current.input_fingerprint)
    if shown is not None and shown.strip() not in (current.input_fingerprint, now_short):
        given = shown.strip()
        was = (
            keyed_fingerprint(key, given) if len(given) == len(current.input_fingerprint) else given
        )
        raise IllegalTransition(
            f"{current.display_id}: the intent changed since it was shown (shown {was}, now "
            f"{now_short}); read the current intent and decide again. Nothing was granted "
            "or denied"
        )
    approval = runner.run(
        store.decide_approval(
            operation_id,
            decision=decision,
            approved_by=by,
            ttl=lifetime,
            intent_hash=current.input_fingerprint,
        )
    )
    return ApprovalDecided(operation=current, approval=approval, by=by, intent=now_short)
