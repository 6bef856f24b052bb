from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox import store
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


def store_step_names() -> set[str]:
    source = Path(store.__file__).read_text(encoding="utf-8")
    return set(re.findall(r'Step\(\s*"([a-z_][a-z0-9_]*)"', source))


def test_every_query_the_store_runs_exists() -> None:
    used = store_step_names()

    assert used, "no Step(...) found in outbox/store.py: the pattern no longer matches"
    assert used <= set(QUERIES), f"missing from queries.sql: {sorted(used - set(QUERIES))}"


def test_every_query_in_the_file_is_run_by_the_store() -> None:
    unused = set(QUERIES) - store_step_names()

    assert not unused, f"dead queries in queries.sql: {sorted(unused)}"


def test_every_real_query_has_a_description_and_sql() -> None:
    for query in QUERIES.values():
        assert query.description
        assert query.sql
        assert not query.sql.endswith(";")
