"""The evidence chain (schema version 5): every lifecycle event is hashed into its
operation's chain in the statement that writes it, and `outbox ops verify` /
``store.verify_chain`` find what a superuser changed, deleted or added around it.

Tampering here is what only a superuser (or the tables' owner) can do: switch the
append-only trigger off, then UPDATE or DELETE. The roles forbid it to everyone else
(tests/integration/roles/)."""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
import threading
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest
from psycopg.types.json import Jsonb

from outbox import Operation, OperationState, Registry
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.models import ApprovalDecision
from outbox.states import EventName
from outbox.store import BrokenLink, ChainReport
from outbox.store import evidence as evidence_module

from support.db_helpers import execute_admin
from support.ops_helpers import Ops
from support.waiting import eventually_sync

S = OperationState


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def verify(ops: Ops, operation_id: UUID | None = None) -> ChainReport:
    report: ChainReport = ops.run(outbox_store.verify_chain(operation_id))
    return report


def event_ids(database_url: str, operation_id: UUID) -> list[int]:
    """The operation's events in chain order."""
    rows = execute_admin(
        database_url,
        "SELECT id FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation_id,),
    )
    return [int(row[0]) for row in rows]


def as_superuser_with_triggers_off(database_url: str, statement: str, params: Any = ()) -> None:
    """What a superuser or the owner can do: switch the user triggers off (the
    append-only one among them), change the evidence, switch them on again."""
    with psycopg.connect(database_url) as connection:
        connection.execute("ALTER TABLE operation_events DISABLE TRIGGER USER")
        connection.execute(statement, params or None)
        connection.execute("ALTER TABLE operation_events ENABLE TRIGGER USER")


def as_replica(database_url: str, statement: str, params: Any = ()) -> None:
    """The other way round the triggers, superusers only: replica mode fires none."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(statement, params or None)


def full_lifecycle(ops: Ops) -> Operation:
    """A decision that waited for an approval, was granted, attempted, left unknown,
    escalated, resolved by a person, and then reported by the agent: most kinds of
    appends (the decision's own, insert_event, insert_approval, claim, transition)."""
    operation = ops.new()
    ops.run(
        outbox_store.append_event(
            operation, EventName.APPROVAL_REQUIRED, {"policy": "approval_required"}
        )
    )
    ops.run(
        outbox_store.decide_approval(
            operation.id,
            decision=ApprovalDecision.GRANTED,
            approved_by="lead@example.com",
            ttl=timedelta(hours=1),
        )
    )
    for target in (S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED):
        operation = ops.move(operation, target)
    ops.run(
        outbox_store.resolve_operation(
            operation.id,
            source=S.ESCALATED,
            target=S.COMMITTED,
            decision="committed",
            resolved_by="oncall@example.com",
            evidence="seen on the provider's dashboard",
            provider_reference="re_1",
        )
    )
    with psycopg.connect(ops.database_url) as connection:
        connection.execute(
            "INSERT INTO operation_events (operation_id, name, attributes) "
            "VALUES (%s, 'agent.completed', %s)",
            (operation.id, Jsonb({"agent.outcome": "refund_confirmed"})),
        )
    return ops.get(operation.id)


# --- an untouched chain ---------------------------------------------------------------


def test_a_real_lifecycle_leaves_an_intact_chain(ops: Ops, database_url: str) -> None:
    operation = full_lifecycle(ops)

    report = verify(ops, operation.id)

    names = ops.event_names(operation.id)
    assert names[0] == "operation.prepared"
    assert names[-1] == "agent.completed"
    assert report == ChainReport(operations_checked=1, events_checked=len(names), broken=())
    assert report.intact
    rows = execute_admin(
        database_url,
        "SELECT seq, prev_hash, hash FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation.id,),
    )
    assert [row[0] for row in rows] == list(range(1, len(names) + 1))
    assert rows[0][1] is None
    assert all(row[1] == before[2] for before, row in itertools.pairwise(rows))
    assert execute_admin(
        database_url,
        "SELECT events, last_hash FROM operation_event_heads WHERE operation_id = %s",
        (operation.id,),
    ) == [(len(names), rows[-1][2])]


def test_the_hash_is_the_documented_canonical_form(ops: Ops, database_url: str) -> None:
    """docs/operating.md describes the form so that anyone can recompute a hash outside
    Postgres; this recomputes every event of a lifecycle from that description."""
    operation = full_lifecycle(ops)
    rows = execute_admin(
        database_url,
        "SELECT operation_id, id, seq, name, attributes::text, created_at, prev_hash, hash "
        "FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation.id,),
    )
    epoch = datetime(2000, 1, 1, tzinfo=UTC)

    for operation_id, event_id, seq, name, attributes, created_at, prev_hash, stored in rows:
        name_bytes, prev = name.encode(), bytes(prev_hash) if prev_hash is not None else None
        form = (
            b"outbox.event.v1"
            + operation_id.bytes
            + struct.pack(">qiq", event_id, seq, (created_at - epoch) // timedelta(microseconds=1))
            + struct.pack(">i", len(prev) if prev is not None else -1)
            + (prev or b"")
            + struct.pack(">i", len(name_bytes))
            + name_bytes
            + attributes.encode()
        )
        assert hashlib.sha256(form).digest() == bytes(stored)


def test_an_insert_cannot_choose_its_own_link(ops: Ops, database_url: str) -> None:
    operation = ops.new()

    execute_admin(
        database_url,
        "INSERT INTO operation_events (operation_id, name, seq, prev_hash, hash) "
        "VALUES (%s, 'agent.completed', 7, '\\x00', '\\x01')",
        (operation.id,),
    )

    assert execute_admin(
        database_url,
        "SELECT seq FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation.id,),
    ) == [(1,), (2,)]
    assert verify(ops, operation.id).intact


def test_a_head_cannot_be_moved_by_hand_even_by_the_owner(ops: Ops, database_url: str) -> None:
    operation = ops.new()

    for statement in (
        "UPDATE operation_event_heads SET events = events + 1",
        "DELETE FROM operation_event_heads",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="chain trigger"):
            execute_admin(database_url, statement)
    assert verify(ops, operation.id).intact


def test_an_unknown_operation_is_not_counted(ops: Ops) -> None:
    ops.new()

    assert verify(ops, uuid4()) == ChainReport(0, 0, ())


# --- what a superuser does is seen -----------------------------------------------------


def test_a_changed_event_is_seen(ops: Ops, database_url: str) -> None:
    operation = ops.at(S.COMMITTED)
    attempted = event_ids(database_url, operation.id)[1]

    as_superuser_with_triggers_off(
        database_url,
        "UPDATE operation_events SET attributes = attributes || '{\"attempt\": 2}' WHERE id = %s",
        (attempted,),
    )

    assert verify(ops, operation.id).broken == (
        BrokenLink(operation.id, attempted, "hash_mismatch"),
    )


def test_a_changed_event_whose_hash_was_recomputed_breaks_the_next_link(
    ops: Ops, database_url: str
) -> None:
    operation = ops.at(S.COMMITTED)
    _prepared, attempted, committed = event_ids(database_url, operation.id)

    as_superuser_with_triggers_off(
        database_url,
        "UPDATE operation_events SET name = 'operation.rejected', "
        "hash = outbox_event_hash(operation_id, id, seq, 'operation.rejected', attributes, "
        "created_at, prev_hash) WHERE id = %s",
        (attempted,),
    )

    assert verify(ops, operation.id).broken == (
        BrokenLink(operation.id, committed, "prev_mismatch"),
    )


def test_a_deleted_event_in_the_middle_is_seen(ops: Ops, database_url: str) -> None:
    operation = ops.at(S.COMMITTED)
    _prepared, attempted, committed = event_ids(database_url, operation.id)

    as_replica(database_url, "DELETE FROM operation_events WHERE id = %s", (attempted,))

    report = verify(ops, operation.id)
    assert report.events_checked == 2
    assert report.broken == (BrokenLink(operation.id, committed, "prev_mismatch"),)


def test_a_deleted_newest_event_is_seen(ops: Ops, database_url: str) -> None:
    operation = ops.at(S.COMMITTED)
    *_, attempted, newest = event_ids(database_url, operation.id)

    as_superuser_with_triggers_off(
        database_url, "DELETE FROM operation_events WHERE id = %s", (newest,)
    )

    # The deleted event was the one that moved it to committed: what is left supports
    # in_flight, which the row is not.
    assert verify(ops, operation.id).broken == (
        BrokenLink(operation.id, attempted, "state_mismatch"),
        BrokenLink(operation.id, None, "missing_tail"),
    )


def test_every_event_deleted_is_seen(ops: Ops, database_url: str) -> None:
    operation = ops.at(S.COMMITTED)

    as_replica(
        database_url, "DELETE FROM operation_events WHERE operation_id = %s", (operation.id,)
    )

    assert verify(ops, operation.id) == ChainReport(
        1,
        0,
        (
            BrokenLink(operation.id, None, "missing_birth"),
            BrokenLink(operation.id, None, "missing_tail"),
        ),
    )


def test_an_event_added_around_the_trigger_is_seen(ops: Ops, database_url: str) -> None:
    """Even one whose link is correct: the head does not know it."""
    operation = ops.at(S.OUTCOME_UNKNOWN)
    newest = event_ids(database_url, operation.id)[-1]

    as_replica(
        database_url,
        "WITH n AS (SELECT nextval(pg_get_serial_sequence('operation_events', 'id')) AS id) "
        "INSERT INTO operation_events "
        "(id, operation_id, name, attributes, created_at, seq, prev_hash, hash) "
        "OVERRIDING SYSTEM VALUE "
        "SELECT n.id, e.operation_id, 'operation.committed', '{}', e.created_at, e.seq + 1, "
        "e.hash, outbox_event_hash(e.operation_id, n.id, e.seq + 1, 'operation.committed', "
        "'{}', e.created_at, e.hash) "
        "FROM operation_events e, n WHERE e.id = %s",
        (newest,),
    )

    forged = event_ids(database_url, operation.id)[-1]
    assert forged != newest
    assert verify(ops, operation.id).broken == (
        BrokenLink(operation.id, forged, "anchor_mismatch"),
    )


def test_all_finds_the_one_broken_operation_among_intact_ones(
    ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages of two, so five operations take three statements and the keyset is used.
    monkeypatch.setattr(evidence_module, "VERIFY_PAGE_SIZE", 2)
    operations = [ops.at(state) for state in (S.COMMITTED, S.REJECTED, S.ESCALATED)]
    operations += [ops.new(), ops.new()]
    tampered = operations[2]
    first = event_ids(database_url, tampered.id)[0]
    as_replica(
        database_url,
        "UPDATE operation_events SET created_at = created_at + interval '1 hour' WHERE id = %s",
        (first,),
    )

    report = verify(ops)

    assert report.operations_checked == 5
    assert report.events_checked == sum(len(ops.events(o.id)) for o in operations)
    assert report.broken == (BrokenLink(tampered.id, first, "hash_mismatch"),)
    assert not report.intact


# --- concurrency -----------------------------------------------------------------------


def test_an_append_that_waited_chains_after_the_one_it_waited_for(
    ops: Ops, database_url: str
) -> None:
    """B draws its event id first and then waits for A's head; A appends again and
    commits. B's event ends up last in the chain though its id is smaller: the chain
    is ordered by seq, and stays intact."""
    operation = ops.new()
    insert = "INSERT INTO operation_events (operation_id, name) VALUES (%s, 'agent.completed')"
    with psycopg.connect(database_url) as a, psycopg.connect(database_url) as b:
        b_pid = b.info.backend_pid
        a.execute(insert, (operation.id,))
        failure: list[BaseException] = []

        def append_from_b() -> None:
            try:
                b.execute(insert, (operation.id,))
                b.commit()
            except BaseException as error:  # reported below, in the test's thread
                failure.append(error)

        waiter = threading.Thread(target=append_from_b)
        waiter.start()
        eventually_sync(
            lambda: (
                execute_admin(
                    database_url,
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                    (b_pid,),
                )
                == [("Lock",)]
            ),
            within=10,
            what="the second append waits for the head the first one holds",
        )
        a.execute(insert, (operation.id,))
        a.commit()
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        assert failure == []

    ids_by_seq = event_ids(database_url, operation.id)
    assert len(ids_by_seq) == 4
    assert ids_by_seq[-1] < ids_by_seq[-2]  # B's id, drawn before A's second one
    assert verify(ops, operation.id) == ChainReport(1, 4, ())


def test_concurrent_appends_to_one_operation_keep_one_chain(ops: Ops, database_url: str) -> None:
    operation = ops.new()
    workers, appends = 4, 20
    failures: list[BaseException] = []
    start = threading.Barrier(workers)

    def append(worker: int) -> None:
        try:
            with psycopg.connect(database_url) as connection:
                start.wait(timeout=10)
                for attempt in range(appends):
                    with connection.transaction():
                        connection.execute(
                            "INSERT INTO operation_events (operation_id, name, attributes) "
                            "VALUES (%s, 'agent.completed', %s)",
                            (
                                operation.id,
                                Jsonb({"agent.worker": worker, "agent.attempt": attempt}),
                            ),
                        )
        except BaseException as error:  # reported below, in the test's thread
            failures.append(error)

    threads = [threading.Thread(target=append, args=(n,)) for n in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert failures == []
    total = 1 + workers * appends
    assert execute_admin(
        database_url,
        "SELECT count(*), count(DISTINCT seq), min(seq), max(seq) FROM operation_events "
        "WHERE operation_id = %s",
        (operation.id,),
    ) == [(total, total, 1, total)]
    assert verify(ops, operation.id) == ChainReport(1, total, ())


# --- migrating a version-4 database ------------------------------------------------------


def as_version_4(database_url: str) -> None:
    """Take this database back to what version 4 had: no chain columns, heads, hash
    function or chain trigger, and no version 5."""
    execute_admin(
        database_url,
        "DROP TRIGGER operation_events_chain ON operation_events;"
        "DROP FUNCTION outbox_chain_event();"
        "DROP TABLE operation_event_heads;"
        "DROP FUNCTION outbox_event_heads_guard();"
        "ALTER TABLE operation_events DROP COLUMN seq, DROP COLUMN prev_hash, DROP COLUMN hash;"
        "DROP FUNCTION outbox_event_hash(uuid, bigint, integer, text, jsonb, timestamptz, bytea);"
        "DELETE FROM outbox_schema_version WHERE version = 5",
    )


def test_migrating_a_version_4_database_chains_its_events_in_id_order(
    ops: Ops, database_url: str
) -> None:
    as_version_4(database_url)
    with psycopg.connect(database_url) as connection:
        assert not outbox_schema.schema_is_current(connection)
    # Events written by version 4, interleaved across operations.
    first, second = ops.new(), ops.new()
    first = ops.move(first, S.IN_FLIGHT)
    second = ops.move(second, S.IN_FLIGHT)
    first = ops.move(first, S.COMMITTED)
    before = execute_admin(
        database_url, "SELECT id, operation_id, name FROM operation_events ORDER BY id"
    )

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.schema_is_current(connection)

    assert (
        execute_admin(
            database_url, "SELECT id, operation_id, name FROM operation_events ORDER BY id"
        )
        == before
    )
    assert execute_admin(
        database_url,
        "SELECT operation_id, array_agg(id ORDER BY seq) = array_agg(id ORDER BY id), "
        "array_agg(seq ORDER BY seq) FROM operation_events GROUP BY operation_id "
        "ORDER BY operation_id",
    ) == sorted([(first.id, True, [1, 2, 3]), (second.id, True, [1, 2])])
    assert verify(ops) == ChainReport(2, 5, ())
    # New events chain onto the backfilled ones, and a second migration changes nothing.
    ops.move(second, S.OUTCOME_UNKNOWN)
    chains = execute_admin(database_url, "SELECT id, seq, prev_hash, hash FROM operation_events")
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    assert (
        execute_admin(database_url, "SELECT id, seq, prev_hash, hash FROM operation_events")
        == chains
    )
    assert verify(ops) == ChainReport(2, 6, ())
    # And the append-only trigger is back on after the backfill.
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        execute_admin(database_url, "DELETE FROM operation_events")


# --- outbox ops verify -------------------------------------------------------------------


@pytest.fixture
def cli_env(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)


def test_verify_one_operation_intact(
    ops: Ops, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    operation = ops.at(S.COMMITTED)

    code = run_command(["ops", "verify", operation.display_id])

    out = capsys.readouterr().out
    assert code == 0
    assert out == f"{operation.display_id} (3 events): evidence chain intact\n"


def test_verify_reports_a_broken_operation_and_exits_1(
    ops: Ops, database_url: str, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    intact, broken = ops.at(S.COMMITTED), ops.at(S.COMMITTED)
    *_, attempted, newest = event_ids(database_url, broken.id)
    as_replica(database_url, "DELETE FROM operation_events WHERE id = %s", (newest,))

    one = run_command(["ops", "verify", broken.display_id])
    one_out = capsys.readouterr().out
    every = run_command(["ops", "verify", "--all"])
    every_out = capsys.readouterr().out
    as_json = run_command(["ops", "verify", "--all", "--json"])
    document = capsys.readouterr().out

    assert (one, every, as_json) == (1, 1, 1)
    assert one_out.splitlines()[0] == (
        f"{broken.display_id} (2 events): BROKEN, 2 broken link(s) in 1 operation(s)"
    )
    assert every_out.splitlines()[0] == (
        "2 operations, 5 events: BROKEN, 2 broken link(s) in 1 operation(s)"
    )
    rows = [line.split() for line in every_out.splitlines()[2:4]]
    assert [row[:4] for row in rows] == [
        [broken.display_id, "event", str(attempted), "state_mismatch"],
        [broken.display_id, "-", "missing_tail", "the"],
    ]
    assert intact.display_id not in every_out
    assert json.loads(document) == {
        "intact": False,
        "operations_checked": 2,
        "events_checked": 5,
        "broken": [
            {"operation_id": broken.display_id, "event_id": attempted, "reason": "state_mismatch"},
            {"operation_id": broken.display_id, "event_id": None, "reason": "missing_tail"},
        ],
    }


def test_verify_all_intact_exits_0(
    ops: Ops, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ops.at(S.COMMITTED)
    ops.at(S.ESCALATED)

    code = run_command(["ops", "verify", "--all"])

    assert code == 0
    assert capsys.readouterr().out == "2 operations, 7 events: every evidence chain intact\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["ops", "verify"],
        ["ops", "verify", "--all", "op_00000000-0000-0000-0000-000000000001"],
    ],
)
def test_verify_refuses_bad_input_with_exit_2(
    cli_env: None, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        run_command(argv)

    assert exited.value.code == 2
    assert "outbox ops verify: error:" in capsys.readouterr().err


def test_verify_names_an_operation_as_ops_show_does(
    ops: Ops, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    operation = ops.at(S.COMMITTED)
    short = f"op_{operation.id.hex[:8]}"

    verified = run_command(["ops", "verify", short])
    verified_out = capsys.readouterr().out
    shown = run_command(["ops", "show", short])
    shown_out = capsys.readouterr().out

    assert (verified, shown) == (0, 0)
    assert verified_out == f"{operation.display_id} (3 events): evidence chain intact\n"
    assert operation.display_id in shown_out


def test_verify_refuses_what_is_not_an_operation_id_with_exit_2(
    ops: Ops, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ops.new()

    code = run_command(["ops", "verify", "not-an-id"])

    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    # The last line: an earlier command's logging may have printed the operation's.
    assert captured.err.splitlines()[-1] == (
        "outbox ops verify: 'not-an-id' is not an operation id: expected op_<uuid>, a bare "
        "uuid, or the start of one (at least 8 hex digits, as the console shows it); "
        "nothing was checked"
    )


def test_verify_an_unknown_operation_exits_2(
    ops: Ops, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ops.new()
    unknown = uuid4()

    code = run_command(["ops", "verify", str(unknown)])

    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert f"op_{unknown} is not an operation of this database" in captured.err
