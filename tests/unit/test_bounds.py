"""outbox/bounds.py: the numbers schema.sql enforces are the ones Python enforces, and
stored JSON is decoded into a value or a marker, never an exception."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.adapt import AdaptersMap
from psycopg.pq import Format

from outbox import bounds
from outbox.bounds import (
    MAX_AGENT_ATTRIBUTES_TEXT,
    MAX_APPROVAL_TTL,
    MAX_ATTRIBUTES_TEXT,
    MAX_JSON_DEPTH,
    MAX_PROVIDER_REFERENCE,
    MAX_RESULT_TEXT,
    MAX_STORED_INPUT_TEXT,
    READ_LIMIT_BYTES,
    bounded_reference,
    bounded_result,
    load,
    nested_deeper_than,
    object_or_unreadable,
    unreadable_reason,
)
from outbox.callback_policy import PROVIDER_NAME
from outbox.tracing import TRACEPARENT

SCHEMA = (Path(__file__).resolve().parents[2] / "schema.sql").read_text(encoding="utf-8")


def _function(name: str) -> str:
    """The body of one function of schema.sql, from its CREATE to the next one."""
    start = SCHEMA.index(f"FUNCTION {name}(")
    end = SCHEMA.find("CREATE OR REPLACE FUNCTION", start + 1)
    return SCHEMA[start:end]


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_schemas_numbers_are_the_ones_python_enforces() -> None:
    assert f"$.**{{{MAX_JSON_DEPTH}}}" in _function("outbox_json_too_deep")
    assert f"> {MAX_STORED_INPUT_TEXT}" in _function("outbox_guard_birth")
    assert f"> {MAX_ATTRIBUTES_TEXT}" in _function("outbox_guard_event_names")
    assert f"> {MAX_AGENT_ATTRIBUTES_TEXT}" in _function("outbox_agent_words_refused")
    assert bounds.AGENT_ATTRIBUTE_KEY.pattern.replace("\\", "") in _function(
        "outbox_agent_words_refused"
    ).replace("\\", "")
    assert f"> {MAX_RESULT_TEXT}" in _function("outbox_guard_transition")
    assert f"> {MAX_PROVIDER_REFERENCE}" in _function("outbox_guard_transition")
    assert f"NOT BETWEEN 1 AND {round(bounds.MAX_DECISION_LOCK_TIMEOUT * 1000)}" in _function(
        "outbox_record_decision"
    )
    assert f"DEFAULT {round(bounds.DECISION_LOCK_TIMEOUT * 1000)}" in _function(
        "outbox_record_decision"
    )
    assert f"interval '{MAX_APPROVAL_TTL.days} days'" in _function("outbox_guard_approval")
    # The traceparent the outbox trigger admits is the one tracing accepts.
    assert TRACEPARENT.pattern in _function("outbox_guard_outbox_row")
    # The callbacks inbox (its table's checks) admits what outbox.callbacks admits.
    table = SCHEMA[SCHEMA.index("CREATE TABLE IF NOT EXISTS callbacks") :]
    table = table[: table.index(");")]
    assert f"'{bounds.CALLBACK_EVENT_ID.pattern}'" in table
    assert f"BETWEEN 1 AND {MAX_PROVIDER_REFERENCE}" in table
    assert f"'{PROVIDER_NAME.pattern}'" in table
    # Every bound the database keeps is below what a reader decodes at all.
    assert max(MAX_STORED_INPUT_TEXT, MAX_ATTRIBUTES_TEXT, MAX_RESULT_TEXT) < READ_LIMIT_BYTES


def test_the_claim_admits_the_same_traceparent() -> None:
    queries = (Path(__file__).resolve().parents[2] / "outbox/sql/queries.sql").read_text()
    claim = queries[queries.index("-- name: claim_outbox_batch") :]
    claim = claim[: claim.index("-- name:", 10)]
    assert TRACEPARENT.pattern in claim


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"[" * 5000 + b"]" * 5000, "too_deep"),
        (json.dumps(nested(MAX_JSON_DEPTH + 1)).encode(), "too_deep"),
        (b'{"a": ' + b"1" * 5000 + b"}", "malformed"),
        (b'{"a": ', "malformed"),
        (b" " * (READ_LIMIT_BYTES + 1), "too_large"),
    ],
    ids=["past-the-parser", "past-the-bound", "huge-integer", "truncated", "too-large"],
)
def test_a_value_no_reader_should_parse_becomes_the_marker(data: bytes, reason: str) -> None:
    assert unreadable_reason(load(data)) == reason


def test_a_value_within_the_bounds_is_decoded_as_it_is() -> None:
    value = {"a": nested(MAX_JSON_DEPTH - 1), "b": "x", "c": 1.5, "d": None}
    assert load(json.dumps(value).encode()) == value


def test_a_non_object_where_an_object_belongs_is_the_marker() -> None:
    assert unreadable_reason(object_or_unreadable([1, 2])) == "not_an_object"
    assert unreadable_reason(object_or_unreadable("x")) == "not_an_object"
    assert object_or_unreadable({"a": 1}) == {"a": 1}
    assert object_or_unreadable(None) is None


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ({"receipt": "y" * MAX_RESULT_TEXT}, "too_large"),
        ({"deep": nested(MAX_JSON_DEPTH)}, "too_deep"),
        ({"nul": "a\x00b"}, "malformed"),
        ({"half": "\ud800"}, "malformed"),
        ({"not_json": object()}, "malformed"),
        ({"nan": float("nan")}, "malformed"),
    ],
    ids=["large", "deep", "nul", "lone-surrogate", "not-json", "nan"],
)
def test_a_result_postgres_would_refuse_is_stored_as_the_marker(
    result: dict[str, object], reason: str
) -> None:
    assert unreadable_reason(bounded_result(result)) == reason


def test_a_result_within_the_bounds_is_stored_as_it_is() -> None:
    result = {"receipt": "r_1", "amount": 1250, "nested": {"ok": True}}
    assert bounded_result(result) == result


def test_a_reference_is_cut_to_the_bound_and_keeps_no_nul() -> None:
    long = bounded_reference("re_" + "x" * 1000)
    assert long is not None
    assert len(long) == MAX_PROVIDER_REFERENCE
    assert long.endswith("…")
    assert bounded_reference("re_\x001") == "re_1"
    # Two halves of a pair, as Python holds them apart: each is alone.
    assert bounded_reference("re_\udc80\ud83d\ude00") == "re_???"
    assert bounded_reference("re_\U0001f600") == "re_\U0001f600"
    assert bounded_reference(None) is None
    assert bounded_reference("re_1") == "re_1"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=30,
)


@given(json_values, st.integers(min_value=0, max_value=80))
def test_the_depth_rule_counts_the_outermost_container_as_level_one(
    value: object, wrap: int
) -> None:
    wrapped = value
    for _ in range(wrap):
        wrapped = [wrapped]
    text = json.dumps(wrapped)
    # Depth as the text shows it: the deepest run of open brackets outside strings.
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    assert nested_deeper_than(wrapped, MAX_JSON_DEPTH) == (deepest > MAX_JSON_DEPTH)
    assert (unreadable_reason(load(text.encode())) == "too_deep") == (deepest > MAX_JSON_DEPTH)


def test_no_bound_is_left_only_in_a_comment() -> None:
    # Each number the tests above look for sits in code, not just in prose.
    code = "\n".join(line for line in SCHEMA.splitlines() if not line.lstrip().startswith("--"))
    for number in (MAX_STORED_INPUT_TEXT, MAX_ATTRIBUTES_TEXT, MAX_RESULT_TEXT):
        assert re.search(rf"\b{number}\b", code)


def test_a_connection_bound_once_decodes_through_the_bounds_in_every_cursor() -> None:
    # What a daemon does at connect, so that its statements skip the per-cursor binding.
    connection = SimpleNamespace(adapters=AdaptersMap(psycopg.adapters), connection=None)
    assert not bounds.bound(connection)
    bounds.bind(connection)
    cursor = SimpleNamespace(adapters=AdaptersMap(connection.adapters), connection=None)
    assert bounds.bound(cursor)
    jsonb = psycopg.postgres.types["jsonb"].oid
    loader_class = cursor.adapters.get_loader(jsonb, Format.BINARY)
    assert loader_class is not None
    too_deep = b"\x01" + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert loader_class(jsonb, cursor).load(too_deep) == load(too_deep[1:])
    assert unreadable_reason(loader_class(jsonb, cursor).load(too_deep)) is not None
    # The driver's own map is left alone: other connections decode as before.
    assert not bounds.bound(SimpleNamespace(adapters=psycopg.adapters, connection=None))
