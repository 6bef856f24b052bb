from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from outbox import schema, store
from outbox.sql import QUERIES, QueryFileError, parse_queries

TWO_QUERIES = """\
-- A file comment before the first query is not part of any query.

-- name: get_thing
-- One thing by id.
SELECT * FROM things WHERE id = %(id)s;

-- name: count_things
-- How many things there are.
SELECT count(*)
FROM things
"""


def test_parses_names_descriptions_and_sql() -> None:
    queries = parse_queries(TWO_QUERIES)

    assert list(queries) == ["get_thing", "count_things"]
    assert queries["get_thing"].name == "get_thing"
    assert queries["get_thing"].description == "One thing by id."
    assert queries["get_thing"].sql == "SELECT * FROM things WHERE id = %(id)s"
    assert queries["count_things"].description == "How many things there are."
    assert queries["count_things"].sql == "SELECT count(*)\nFROM things"


def test_a_heading_between_queries_belongs_to_neither() -> None:
    text = (
        "-- ==== reads\n\n-- name: get_thing\n-- One thing.\nSELECT 1;\n\n"
        "-- ==== writes\n--\n\n-- name: put_thing\n-- Put one.\nINSERT INTO things DEFAULT VALUES\n"
    )

    queries = parse_queries(text)

    assert queries["get_thing"].sql == "SELECT 1"
    assert queries["put_thing"].sql == "INSERT INTO things DEFAULT VALUES"


def test_a_query_of_comments_only_has_no_sql() -> None:
    with pytest.raises(QueryFileError, match=r"query 'get_thing' has no SQL"):
        parse_queries("-- name: get_thing\n-- One thing.\n-- SELECT 1\n")


def test_a_file_without_headers_has_no_queries() -> None:
    assert parse_queries("-- just a comment\n") == {}


def test_duplicate_query_name_is_refused() -> None:
    text = TWO_QUERIES + "\n-- name: get_thing\n-- Again.\nSELECT 2\n"

    with pytest.raises(QueryFileError, match=r"query 'get_thing' is defined twice"):
        parse_queries(text)


@pytest.mark.parametrize("header", ["-- name: Get-Thing", "-- name: get thing", "-- name:"])
def test_a_malformed_header_is_refused_not_merged_into_the_previous_query(header: str) -> None:
    text = TWO_QUERIES + f"\n{header}\n-- Something.\nSELECT 3\n"

    with pytest.raises(QueryFileError, match="malformed query header"):
        parse_queries(text)


def test_query_without_description_line_is_refused() -> None:
    text = "-- name: get_thing\nSELECT * FROM things\n"

    with pytest.raises(QueryFileError) as info:
        parse_queries(text)

    assert "query 'get_thing' needs a one-line '-- description'" in str(info.value)


def test_query_with_empty_description_is_refused() -> None:
    text = "-- name: get_thing\n--  \nSELECT 1\n"

    with pytest.raises(QueryFileError, match=r"query 'get_thing' needs a one-line"):
        parse_queries(text)


@pytest.mark.parametrize("body", ["", ";", "\n\n  ;  \n"])
def test_query_without_sql_is_refused(body: str) -> None:
    text = f"-- name: get_thing\n-- One thing.\n{body}\n-- name: other\n-- Other.\nSELECT 1\n"

    with pytest.raises(QueryFileError, match=r"query 'get_thing' has no SQL"):
        parse_queries(text)


# The code that runs SQL: the store package, outbox.schema for the migrations, and the
# chaos harness's diagnostics (outside the wheel, but its statements are named here too).
HARNESS = Path(__file__).resolve().parents[2] / "harness"
SQL_MODULES = [
    *sorted(Path(store.__file__).parent.glob("*.py")),
    Path(schema.__file__),
    *sorted(HARNESS.glob("*.py")),
]


def step_names(source: str) -> tuple[set[str], list[int]]:
    """The query names ``Step("name", ...)`` calls in ``source`` give, and the lines of
    any Step whose name is not a string literal (which this scan could not check)."""
    names: set[str] = set()
    computed: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        if not (isinstance(called, ast.Name) and called.id == "Step") and not (
            isinstance(called, ast.Attribute) and called.attr == "Step"
        ):
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.add(first.value)
        else:
            computed.append(node.lineno)
    return names, computed


def queries_run() -> set[str]:
    run: set[str] = set()
    for path in SQL_MODULES:
        names, computed = step_names(path.read_text(encoding="utf-8"))
        assert computed == [], f"{path.name}: name each Step with a literal (lines {computed})"
        run |= names
    return run


def test_the_scan_sees_multiline_steps_and_flags_computed_names() -> None:
    source = (
        'def plan():\n    rows = yield Step(\n        "get_thing",\n        {"id": 1},\n    )\n'
        '    yield store.Step("count_things", {})\n    yield Step(name, {})\n'
        '    Other("not_a_step")\n'
    )

    assert step_names(source) == ({"get_thing", "count_things"}, [7])


def test_every_query_the_code_runs_is_named_in_queries_sql() -> None:
    run = queries_run()

    assert run, "no Step(...) found: the scan no longer matches how plans name queries"
    assert run - set(QUERIES) == set(), "missing from queries.sql"


def test_every_query_named_in_queries_sql_is_run() -> None:
    assert set(QUERIES) - queries_run() == set(), "dead queries in queries.sql"


def test_every_array_parameter_is_sent_in_binary() -> None:
    # A text array literal escapes each element: a burst's jsonb[] cost three to four
    # times the client CPU as text that it costs in binary (docs/benchmarks.md).
    array_parameter = re.compile(r"%\((\w+)\)([sbt])::\w+\[\]")
    arrays = [
        (name, parameter, placeholder)
        for name, query in QUERIES.items()
        for parameter, placeholder in array_parameter.findall(query.sql)
    ]
    sent_as_text = [
        f"{name}: {parameter}" for name, parameter, placeholder in arrays if placeholder != "b"
    ]

    assert arrays, "queries.sql has no array parameters: the pattern no longer matches"
    assert sent_as_text == []
