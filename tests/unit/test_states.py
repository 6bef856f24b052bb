from __future__ import annotations

import re

import pytest

from outbox.sql import schema_sql
from outbox.states import (
    LEGAL_TRANSITIONS,
    TERMINAL_STATES,
    OperationState,
    is_legal,
    legal_targets,
)

PAIR = re.compile(r"\('([a-z_]+)', '([a-z_]+)'\)")


def schema_transition_pairs() -> set[tuple[str, str]]:
    schema = schema_sql()
    function = schema[schema.index("FUNCTION outbox_guard_transition()") :]
    match = re.search(
        r"\(OLD\.state, NEW\.state\) IN \((?P<pairs>(?:\s*\([^()]*\),?)+)\s*\)", function
    )
    assert match, "the transition list of outbox_guard_transition was not found in schema.sql"
    return set(PAIR.findall(match["pairs"]))


def schema_state_values() -> list[str]:
    # Version 18: the bound the guards check, named as the CHECK it replaced.
    match = re.search(
        r"WHEN NOT \(p_state IN \((?P<values>[^)]*)\)\)\s+THEN 'operations_state_check'",
        schema_sql(),
    )
    assert match, "the bound on operations.state was not found in schema.sql"
    return re.findall(r"'([a-z_]+)'", match["values"])


def schema_terminal_states() -> set[str]:
    match = re.search(r"IF OLD\.state IN \((?P<values>[^)]*)\) THEN", schema_sql())
    assert match, "the terminal-state guard was not found in schema.sql"
    return set(re.findall(r"'([a-z_]+)'", match["values"]))


def test_python_transitions_equal_the_schema_trigger() -> None:
    python_pairs = {(str(source), str(target)) for source, target in LEGAL_TRANSITIONS}

    assert python_pairs == schema_transition_pairs()


def test_schema_state_check_lists_exactly_the_operation_states() -> None:
    values = schema_state_values()

    assert len(values) == len(set(values))
    assert set(values) == {state.value for state in OperationState}


def test_schema_terminal_guard_matches_the_terminal_states() -> None:
    assert schema_terminal_states() == {str(state) for state in TERMINAL_STATES}


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_terminal_states_have_no_way_out(state: OperationState) -> None:
    assert state.is_terminal
    assert legal_targets(state) == []
    assert not any(is_legal(state, target) for target in OperationState)


@pytest.mark.parametrize("state", sorted(set(OperationState) - TERMINAL_STATES))
def test_non_terminal_states_can_move_on(state: OperationState) -> None:
    assert not state.is_terminal
    assert legal_targets(state)


def test_every_state_is_reachable_from_prepared() -> None:
    reached = {OperationState.PREPARED}
    frontier = [OperationState.PREPARED]
    while frontier:
        for target in legal_targets(frontier.pop()):
            if target not in reached:
                reached.add(target)
                frontier.append(target)

    assert reached == set(OperationState)


def test_an_unknown_outcome_never_goes_straight_back_in_flight() -> None:
    # A retry after an unknown outcome must pass through prepared (reconciled first).
    assert not is_legal(OperationState.OUTCOME_UNKNOWN, OperationState.IN_FLIGHT)
    assert not is_legal(OperationState.ESCALATED, OperationState.IN_FLIGHT)
