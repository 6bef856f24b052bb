"""The closed sets of label values each daemon exports at 0 from its start
(consumer/telemetry.py, dispatcher/publisher.py, outbox/intent.py, outbox/daemon.py)
against the literals the code really reports. A value missing from its set would be
born at 1 on its first event, and rate() and increase() would read that event as 0.

The literals are read from the source (ast): the label of a ``.labels(...)`` call on a
metric, a ``Skip`` result and dead-letter reason, the check ``derive_intent`` names,
the reason ``classify`` gives, a lookup's result.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer import telemetry
from consumer.policy import AttemptOutcome
from dispatcher.publisher import PUBLISH_FAILURE_REASONS
from outbox.daemon import PEERS
from outbox.intent import TAMPER_CHECKS
from outbox.models import CallbackOutcome

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = sorted((ROOT / "consumer").glob("*.py"))
DISPATCHER = sorted((ROOT / "dispatcher").glob("*.py"))

# metrics.<attribute>.labels(...): the set each positional label comes from (None: a
# tool name, which the registry decides).
LABELS: dict[str, tuple[tuple[str, ...] | None, ...]] = {
    "deliveries": (telemetry.DELIVERY_RESULTS,),
    "dead_lettered": (telemetry.DEAD_LETTER_REASONS,),
    "effect_attempts": (None, tuple(str(outcome) for outcome in AttemptOutcome)),
    "reconciliations": (None, telemetry.RECONCILIATION_RESULTS),
    "escalations": (None, telemetry.ESCALATION_REASONS),
    "tampered": (None, TAMPER_CHECKS),
    "callbacks_applied": (None, telemetry.CALLBACK_OUTCOMES),
    "callbacks_contradicted": (None,),
    "publish_failures": (PUBLISH_FAILURE_REASONS,),
    "reconnects": (PEERS,),
}


def calls(paths: list[Path]) -> Iterator[tuple[Path, ast.Call]]:
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                yield path, node


def literal(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def labels_calls() -> Iterator[tuple[str, str, list[ast.expr]]]:
    """(where, metric attribute, arguments) of every ``<x>.metrics.<m>.labels(...)``."""
    for path, call in calls(CONSUMER + DISPATCHER):
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "labels"):
            continue
        metric = func.value
        if isinstance(metric, ast.Attribute) and metric.attr in LABELS:
            yield f"{path.name}:{call.lineno}", metric.attr, list(call.args)


def test_the_scan_finds_the_labelled_calls() -> None:
    # Guards the scan itself: were it to match nothing, every check below would pass.
    assert {metric for _, metric, _ in labels_calls()} >= set(LABELS) - {"effect_attempts"}


def test_every_callback_outcome_but_unmatched_is_primed() -> None:
    # The reconciler never meets an unmatched callback: the inbox keeps it, applied.
    assert set(telemetry.CALLBACK_OUTCOMES) == {str(o) for o in CallbackOutcome} - {"unmatched"}


@pytest.mark.parametrize("metric", sorted(LABELS))
def test_every_literal_label_is_in_its_closed_set(metric: str) -> None:
    for where, found, arguments in labels_calls():
        if found != metric:
            continue
        for position, argument in enumerate(arguments):
            value = literal(argument)
            allowed = LABELS[metric][position]
            if value is not None and allowed is not None:
                assert value in allowed, f"{where}: {metric} label {value!r} is not primed"


def test_every_delivery_result_and_dead_letter_reason_is_primed_and_used() -> None:
    results = {"processed", "invalid", "retry_later"} & set(telemetry.DELIVERY_RESULTS)
    reasons: set[str] = set()
    for path, call in calls(CONSUMER):
        name = call.func.id if isinstance(call.func, ast.Name) else None
        attribute = call.func.attr if isinstance(call.func, ast.Attribute) else None
        if name == "Skip":
            result = literal(call.args[0]) if call.args else None
            assert result is not None, f"{path.name}:{call.lineno}: a Skip without a literal"
            results.add(result)
            if len(call.args) > 1 and (reason := literal(call.args[1])) is not None:
                reasons.add(reason)
        if attribute == "dead_letter" and (reason := literal(call.args[-1])) is not None:
            reasons.add(reason)
    results |= {
        value
        for _, metric, arguments in labels_calls()
        if metric == "deliveries" and arguments and (value := literal(arguments[0])) is not None
    }

    assert results == set(telemetry.DELIVERY_RESULTS)
    assert reasons == set(telemetry.DEAD_LETTER_REASONS)


def test_every_check_derive_intent_names_is_primed() -> None:
    source = ast.parse((ROOT / "outbox" / "intent.py").read_text(encoding="utf-8"))
    [function] = [
        node
        for node in ast.walk(source)
        if isinstance(node, ast.FunctionDef) and node.name == "derive_intent"
    ]
    named: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.keyword) and node.arg == "disagreement":
            value = literal(node.value)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not any(isinstance(t, ast.Name) and t.id == "disagreement" for t in targets):
                continue
            value = literal(node.value)
        else:
            continue
        if value is not None:
            named.add(value)

    assert named == set(TAMPER_CHECKS)


def test_every_publish_failure_reason_is_primed() -> None:
    source = ast.parse((ROOT / "dispatcher" / "publisher.py").read_text(encoding="utf-8"))
    given: set[str] = set()
    for node in ast.walk(source):
        # classify()'s (reason, text) returns, and publish()'s (row, reason, text) tuples.
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            reason = literal(node.value.elts[0])
        elif isinstance(node, ast.Tuple) and len(node.elts) == 3:
            reason = literal(node.elts[1])
        else:
            continue
        if reason is not None:
            given.add(reason)

    assert given == set(PUBLISH_FAILURE_REASONS)


def test_every_lookup_result_is_primed() -> None:
    source = ast.parse((ROOT / "consumer" / "reconciler.py").read_text(encoding="utf-8"))
    results = {
        value
        for node in ast.walk(source)
        if isinstance(node, ast.Dict)
        and {k.id for k in node.keys if isinstance(k, ast.Name)}
        == {"Found", "NotFound", "StillUnknown", "Unreachable"}
        for value in (literal(v) for v in node.values)
        if value is not None
    }

    assert results == set(telemetry.RECONCILIATION_RESULTS)
