"""The SQL effect-outbox runs, loaded by name from ``queries.sql``, and the DDL.

A query starts with ``-- name: <name>`` followed by a one-line ``-- <description>``;
its text runs to the next header, less the comment lines at its end: a heading that
groups the queries below it belongs to no query. Parsed once, at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

_HEADER = re.compile(r"^-- name: *(?P<name>[a-z_][a-z0-9_]*) *$", re.MULTILINE)


@dataclass(frozen=True)
class Query:
    name: str
    description: str
    sql: str


class QueryFileError(ValueError):
    pass


def parse_queries(text: str) -> dict[str, Query]:
    for line in text.splitlines():
        if line.startswith("-- name:") and not _HEADER.fullmatch(line):
            raise QueryFileError(f"malformed query header {line!r}: use '-- name: snake_case'")
    headers = list(_HEADER.finditer(text))
    queries: dict[str, Query] = {}
    for index, header in enumerate(headers):
        name = header["name"]
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body = text[header.end() : end].strip("\n")
        first_line, _, rest = body.partition("\n")
        if not first_line.startswith("-- ") or not first_line[3:].strip():
            raise QueryFileError(f"query {name!r} needs a one-line '-- description' under its name")
        sql = _without_trailing_comments(rest).strip().rstrip(";").strip()
        if not sql:
            raise QueryFileError(f"query {name!r} has no SQL")
        if name in queries:
            raise QueryFileError(f"query {name!r} is defined twice")
        queries[name] = Query(name=name, description=first_line[3:].strip(), sql=sql)
    return queries


def _without_trailing_comments(text: str) -> str:
    lines = text.strip().splitlines()
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        lines.pop()
    return "\n".join(lines)


def schema_sql() -> str:
    """The DDL: the copy packaged in a wheel, else ``schema.sql`` at the repository root.
    As written, with ``@schema@`` where :func:`outbox.schema.apply_schema` puts the
    migrated schema's name."""
    return _root_sql("schema.sql")


def roles_sql() -> str:
    """The group roles and their grants: the copy packaged in a wheel, else ``roles.sql``
    at the repository root."""
    return _root_sql("roles.sql")


def _root_sql(name: str) -> str:
    # The files live at the repository root, where operators and DBAs read them; a
    # wheel carries copies inside the package (pyproject.toml's force-include).
    packaged = resources.files("outbox").joinpath(name)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parents[2] / name
    return checkout.read_text(encoding="utf-8")


QUERIES = parse_queries(resources.files(__name__).joinpath("queries.sql").read_text("utf-8"))
