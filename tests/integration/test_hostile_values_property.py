"""A property over every write path a role holds: whatever JSON, text or time an agent,
consumer, operator, dispatcher or callbacks login writes, the database refuses it or
stores a value every reader survives. Then the real dispatcher and consumer run: both stay up, every
decision reaches one of the three endings, every operator view renders every operation,
and `outbox ops verify` finds the evidence as the chain trigger wrote it.

Hypothesis draws the hostile values (nesting past any parser's recursion, sizes past
every bound, NUL, lone surrogates, numbers no float holds, 'infinity' times, keys that
mimic the runtime's); each write runs in its own transaction as a LOGIN user that holds
only its component's group role."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from outbox import OperationState, Registry, Settings, record_decision
from outbox import schema as outbox_schema
from outbox.cli import run_command
from outbox.errors import OutboxError
from outbox.states import TERMINAL_STATES

from support.console_helpers import client, console, console_settings, logged_in
from support.consume_helpers import running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import running_dispatcher
from support.logins import group_logins
from support.waiting import eventually

S = OperationState
AGENT, DISPATCHER, CONSUMER, OPERATOR, CALLBACKS = outbox_schema.ROLES
ENDINGS = {*TERMINAL_STATES, S.ESCALATED}

# Keys and strings chosen to look like the runtime's own, to break a renderer, or to be
# what Postgres cannot store.
ODD_TEXT = st.sampled_from(
    [
        "",
        "=",
        " ",
        "operation.resolved by",
        "outbox.unreadable",
        "agent.",
        "agent.note",
        "from",
        "\x00",
        "a\x00b",
        "\ud800",
        "\u202eevil",
        "\x1b[2J",
        "infinity",
        "x" * 600,
        '"quoted"',
    ]
)
KEYS = ODD_TEXT | st.text(max_size=6)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | ODD_TEXT
    | st.text(max_size=12)
)
PLAIN_JSON = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(KEYS.filter(lambda key: key != "to"), children, max_size=4)
    ),
    max_leaves=25,
)
# JSON as text: some of it is JSON no Python value writes (nesting deeper than any
# parser's recursion, numbers no float holds, integers longer than Python reads).
JSON_TEXT = st.one_of(
    PLAIN_JSON.map(json.dumps),
    st.integers(min_value=1, max_value=3000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(min_value=0, max_value=300_000).map(lambda n: json.dumps({"big": "x" * n})),
    st.sampled_from(["1e400", "-1e400", "1" * 5000, '{"a": 1e400}', '"infinity"', "[]", "{}"]),
)
TIMES = st.sampled_from(
    [
        "infinity",
        "-infinity",
        "294276-12-31 00:00:00+00",
        "0001-01-01 00:00:00+00",
        "1999-12-31 00:00:00+00",
        "2001-01-01 00:00:00+00",
    ]
)


def as_object(text: str) -> str:
    """The hostile value inside the fields of a refund, where an object is expected."""
    return '{"payment_id": "pay_1", "amount_cents": 1, "reason": ' + text + "}"


class Writes:
    """Every write path each role holds, aimed at ``target``; counts what the database
    refused and what it kept."""

    def __init__(self, logins: dict[str, str], registry: Registry) -> None:
        self.logins = logins
        self.registry = registry
        self.refused = 0
        self.kept = 0

    def attempt(self, role: str, statement: str, params: tuple[Any, ...]) -> None:
        try:
            with psycopg.connect(self.logins[role]) as connection:
                connection.execute(statement, params)
        except (psycopg.Error, ValueError):
            # ValueError: what psycopg cannot even send (a NUL in a text parameter).
            self.refused += 1
        else:
            self.kept += 1

    def new_target(self) -> uuid.UUID:
        with psycopg.connect(self.logins[AGENT]) as connection:
            recorded = record_decision(
                connection,
                self.registry,
                "send_refund",
                {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": 1},
                run_id="property",
            )
        return recorded.operation.id

    def all_paths(self, target: uuid.UUID, value: str, text: str, when: str) -> None:
        record = (
            "SELECT id FROM outbox_record_decision(%s, 'property', %s, 'send_refund', 1, "
            "'deduplicated_write', %s::jsonb, %s, false, %s::jsonb)"
        )
        fingerprint = uuid.uuid4().hex * 2
        # The agent: its one write path with hostile input or headers, the library with
        # a hostile free-text field, and its own event.
        self.attempt(AGENT, record, (uuid.uuid4(), text, as_object(value), fingerprint, "{}"))
        self.attempt(AGENT, record, (uuid.uuid4(), None, value, fingerprint, "{}"))
        self.attempt(AGENT, record, (uuid.uuid4(), None, '{"payment_id": "p"}', fingerprint, value))
        try:
            with psycopg.connect(self.logins[AGENT]) as connection:
                record_decision(
                    connection,
                    self.registry,
                    "send_refund",
                    {"payment_id": "pay_1", "amount_cents": 1, "reason": text},
                    run_id="property",
                )
            self.kept += 1
        except OutboxError:
            self.refused += 1
        event = (
            "INSERT INTO operation_events (operation_id, name, attributes) "
            "VALUES (%s, %s, %s::jsonb)"
        )
        # Its report of the operation, as the value itself and inside its own namespace;
        # the reconciler chains what is kept while the daemons run below.
        report = "SELECT outbox_report_agent_completed(%s, %s::jsonb)"
        self.attempt(AGENT, report, (target, value))
        self.attempt(AGENT, report, (target, '{"agent.note": ' + value + "}"))
        # The consumer: an event, a result, a reference, a queued row, a time.
        self.attempt(CONSUMER, event, (target, "operation.requeued", value))
        self.attempt(
            CONSUMER, "UPDATE operations SET result = %s::jsonb WHERE id = %s", (value, target)
        )
        self.attempt(
            CONSUMER, "UPDATE operations SET provider_reference = %s WHERE id = %s", (text, target)
        )
        self.attempt(
            CONSUMER,
            "UPDATE operations SET next_attempt_at = %s::timestamptz WHERE id = %s",
            (when, target),
        )
        self.attempt(
            CONSUMER,
            "INSERT INTO outbox (operation_id, routing_key, available_at) "
            "VALUES (%s, %s, %s::timestamptz)",
            (target, text, when),
        )
        # The callbacks receiver: its one write path with hostile ids and references; the
        # consumer applies (and chains) what is kept while the daemons run below.
        callback = "SELECT * FROM outbox_record_callback(%s, %s, %s, %s, %s, %s)"
        digest = "0" * 64
        self.attempt(CALLBACKS, callback, ("payments", text, "committed", target, text, digest))
        self.attempt(
            CALLBACKS,
            callback,
            ("payments", f"evt_{uuid.uuid4().hex}", "rejected", target, text, digest),
        )
        self.attempt(
            CALLBACKS,
            callback,
            (text, f"evt_{uuid.uuid4().hex}", "pending", None, text, digest),
        )
        # The operator: a hand-typed approval and an event of any name.
        self.attempt(
            OPERATOR,
            "INSERT INTO approvals (id, operation_id, intent_hash, decision, approved_by, "
            "expires_at) SELECT gen_random_uuid(), id, input_fingerprint, 'granted', %s, "
            "%s::timestamptz FROM operations WHERE id = %s",
            (text or "x", when, target),
        )
        self.attempt(OPERATOR, event, (target, "operation.reconcile_deferred", value))
        # The dispatcher: what it may write of an outbox row.
        self.attempt(
            DISPATCHER,
            "UPDATE outbox SET last_error = %s, available_at = %s::timestamptz "
            "WHERE operation_id = %s",
            (text, when, target),
        )


HOSTILE_EXAMPLES = hypothesis_settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@pytest.fixture
def logins(postgres_server_url: str, database_url: str) -> Iterator[dict[str, str]]:
    with group_logins(postgres_server_url, database_url) as make:
        yield {group: make(group) for group in outbox_schema.ROLES}


def settled(database_url: str) -> Callable[[], Any]:
    async def check() -> bool:
        rows = await asyncio.to_thread(
            execute_admin, database_url, "SELECT state FROM operations GROUP BY state"
        )
        # And every agent report and callback kept is in its chain: none stopped the
        # ones behind it.
        waiting = await asyncio.to_thread(
            execute_admin,
            database_url,
            "SELECT (SELECT count(*) FROM agent_reports) "
            "+ (SELECT count(*) FROM callbacks WHERE applied_at IS NULL)",
        )
        return {S(state) for (state,) in rows} <= ENDINGS and waiting == [(0,)]

    return check


def every_view_renders(
    operator: str, operation_ids: list[uuid.UUID], app_settings: Settings
) -> list[str]:
    """Run every operator view as the operator login; returns the problems met (a
    non-zero exit, a page that is not 200)."""
    problems = []
    for argv in (["approvals", "pending"], ["ops", "list", "--limit", "1000"], ["stats"]):
        if run_command(argv) != 0:
            problems.append(" ".join(argv))
    web = logged_in(client(console(console_settings(app_settings, operator))))
    for operation_id in operation_ids:
        if run_command(["ops", "show", str(operation_id)]) != 0:
            problems.append(f"ops show {operation_id}")
        page = web.get(f"/operations/op_{operation_id}")
        if page.status_code != 200:
            problems.append(f"console {operation_id}: {page.status_code}")
    for path in ("/", "/operations", "/escalations", "/approvals"):
        if web.get(path).status_code != 200:
            problems.append(f"console {path}")
    return problems


@pytest.mark.timeout(300)
async def test_every_write_a_role_holds_leaves_every_reader_standing(
    logins: dict[str, str],
    database_url: str,
    registry: Registry,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    writes = Writes(logins, registry)

    @HOSTILE_EXAMPLES
    @given(value=JSON_TEXT, text=ODD_TEXT | st.text(max_size=30), when=TIMES)
    def write_everywhere(value: str, text: str, when: str) -> None:
        writes.all_paths(writes.new_target(), value, text, when)

    write_everywhere()
    # And one callback surely kept, with a reference that reverses the text after it:
    # the views and the chain below must carry at least one applied callback.
    kept = writes.kept
    writes.attempt(
        CALLBACKS,
        "SELECT * FROM outbox_record_callback('payments', 'evt_sure', 'committed', %s, %s, %s)",
        (writes.new_target(), "re_\u202eevil", "0" * 64),
    )
    assert writes.kept == kept + 1
    assert writes.refused > 0
    assert writes.kept > 0

    async with (
        running_dispatcher(settings) as dispatcher,
        running_consumer(settings, registry) as consumer,
    ):
        await eventually(settled(database_url), within=120, what="every decision settled")
        assert dispatcher.healthy()
        assert consumer.healthy()

    operation_ids = [row[0] for row in execute_admin(database_url, "SELECT id FROM operations")]
    monkeypatch.setenv("OUTBOX_DATABASE_URL", logins[OPERATOR])
    problems = await asyncio.to_thread(
        every_view_renders, logins[OPERATOR], operation_ids, settings
    )
    capsys.readouterr()
    verified = run_command(["ops", "verify", "--all", "--json"])
    report = json.loads(capsys.readouterr().out)

    chained = execute_admin(
        database_url,
        "SELECT count(*) FROM operation_events WHERE name = 'operation.callback_received'",
    )
    assert chained[0][0] >= 1
    assert problems == []
    assert verified == 0
    assert report["intact"]
    assert report["operations_checked"] == len(operation_ids)
