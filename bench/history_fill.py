"""Fill a database with a settled history, fast: N operations, their events, heads,
approvals, callbacks and (for the newest) published outbox rows, set-based.

What ``python -m bench.history_scale`` measures against (see there). The history is
written as the tables' owner, one batch per transaction, with the tables' own triggers
switched off inside that transaction (``ALTER TABLE ... DISABLE TRIGGER USER``, which
the owner may; foreign keys, system triggers, stay on) and on again before it commits:
no other session ever sees them off. The triggers would refuse it (every operation is
born prepared), and the chain trigger, one UPDATE of a head per event, is most of the
cost of a row-by-row fill. So the fill writes what they would have written: each event's
``seq``, ``prev_hash`` and ``hash``, computed with the schema's own ``outbox_event_hash``
over pre-drawn ids, and each operation's head to match, so ``outbox ops verify`` passes
on every filled operation.

The proportions (per mille of operations; events in order):

====================  ====  ======================================================
profile               share events
====================  ====  ======================================================
committed              550  prepared, attempted, committed
committed, reported    150  ... committed, agent.completed
approved, committed     80  prepared, approval_required, approval_granted,
                            attempted, committed (and its approvals row)
rejected               120  prepared, attempted, rejected
unknown, looked up      50  prepared, attempted, outcome_unknown, reconciled
unknown, callback       40  ... outcome_unknown, callback_received, reconciled
                            (and its callbacks row, settled)
escalated, resolved     10  ... outcome_unknown, escalated, resolved
====================  ====  ======================================================

About 3.5 events an operation; six tools; eight operations a run; created times spread
evenly over ``days`` before the fill, newest last; a published outbox row kept for the
operations of the last ``retention`` (the dispatcher deletes older ones).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

# (profile, share per mille, final state, event names in order)
PROFILES: tuple[tuple[str, int, str, tuple[str, ...]], ...] = (
    (
        "committed",
        550,
        "committed",
        ("operation.prepared", "operation.attempted", "operation.committed"),
    ),
    (
        "committed_reported",
        150,
        "committed",
        (
            "operation.prepared",
            "operation.attempted",
            "operation.committed",
            "agent.completed",
        ),
    ),
    (
        "approved",
        80,
        "committed",
        (
            "operation.prepared",
            "operation.approval_required",
            "operation.approval_granted",
            "operation.attempted",
            "operation.committed",
        ),
    ),
    (
        "rejected",
        120,
        "rejected",
        ("operation.prepared", "operation.attempted", "operation.rejected"),
    ),
    (
        "looked_up",
        50,
        "committed",
        (
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
            "operation.reconciled",
        ),
    ),
    (
        "callback",
        40,
        "committed",
        (
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
            "operation.callback_received",
            "operation.reconciled",
        ),
    ),
    (
        "escalated_resolved",
        10,
        "committed",
        (
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
            "operation.escalated",
            "operation.resolved",
        ),
    ),
)
MAX_EVENTS = 5
TOOLS = (
    ("send_refund", "deduplicated_write"),
    ("send_email", "non_repeatable_write"),
    ("create_invoice", "idempotent_write"),
    ("charge_card", "deduplicated_write"),
    ("post_message", "non_repeatable_write"),
    ("update_crm", "idempotent_write"),
)
RUN_SIZE = 8
FILLED_TABLES = ("operations", "operation_events", "approvals", "callbacks", "outbox")

assert sum(share for _, share, _, _ in PROFILES) == 1000


def expected_states(count: int) -> dict[str, int]:
    """How many of ``count`` filled operations end in each state (the fill picks a
    profile by ``i % 1000`` after a fixed shuffle, so this is exact)."""
    by_state: dict[str, int] = {}
    for index in range(1, count + 1):
        state = PROFILES[profile_of(index)][2]
        by_state[state] = by_state.get(state, 0) + 1
    return by_state


def profile_of(index: int) -> int:
    # The same pick as the SQL: (index * 7919) % 1000 spreads profiles over time.
    slot = (index * 7919) % 1000
    for position, (_, share, _, _) in enumerate(PROFILES):
        if slot < share:
            return position
        slot -= share
    raise AssertionError("shares sum to 1000")


def _profiles_sql() -> str:
    rows = []
    low = 0
    for position, (name, share, state, names) in enumerate(PROFILES):
        padded = ", ".join(f"'{n}'" for n in names)
        rows.append(
            f"({position}, '{name}', {low}, {low + share}, '{state}', ARRAY[{padded}]::text[])"
        )
        low += share
    return "(VALUES " + ", ".join(rows) + ") AS p (position, profile, low, high, state, names)"


def _tools_sql() -> str:
    rows = ", ".join(f"({i}, '{name}', '{effect}')" for i, (name, effect) in enumerate(TOOLS))
    return f"(VALUES {rows}) AS t (position, tool_name, side_effect)"


# One row per operation of the batch, with everything its rows need: the profile, the
# times of its events, their attributes and their chained hashes. Event j (1-based) of
# operation i has id events_base + (i - first) * 5 + j - 1, drawn in advance.
_STAGE = f"""
CREATE TEMPORARY TABLE fill_stage ON COMMIT DROP AS
WITH src AS (
    SELECT s.i, md5(%(tag)s || ':' || s.i)::uuid AS id, p.profile, p.state, p.names,
           cardinality(p.names) AS n, t.tool_name, t.side_effect,
           %(events_base)s::bigint + (s.i - %(first)s) * 5 AS e0,
           %(callbacks_base)s::bigint + (s.i - %(first)s) AS callback_id,
           %(fill_now)s::timestamptz - %(span)s::interval
               + (s.i - 1)::float8 / %(total)s * %(span)s::interval AS t0
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS s (i)
    JOIN {_profiles_sql()} ON (s.i * 7919) %% 1000 >= p.low AND (s.i * 7919) %% 1000 < p.high
    JOIN {_tools_sql()} ON t.position = s.i %% {len(TOOLS)}
), evented AS (
    SELECT src.*, ev.attrs, ev.times
    FROM src
    CROSS JOIN LATERAL (
        SELECT array_agg(
                   CASE e.name
                   WHEN 'operation.prepared' THEN jsonb_build_object(
                       'tool', src.tool_name, 'tool_version', 1,
                       'run_id', 'run_' || %(tag)s || '_' || src.i / {RUN_SIZE})
                   WHEN 'operation.approval_required' THEN jsonb_build_object(
                       'policy', 'amount_above', 'threshold', 50000)
                   WHEN 'operation.approval_granted' THEN jsonb_build_object(
                       'approval_id', md5('approval:' || src.id::text)::uuid,
                       'by', 'ada@example.com', 'expires_at', src.t0 + interval '1 day')
                   WHEN 'operation.attempted' THEN jsonb_build_object(
                       'attempt', 1, 'lease_token', (extract(epoch FROM src.t0) * 1e6)::bigint,
                       'worker', 'consumer-' || src.i %% 4)
                   WHEN 'operation.committed' THEN jsonb_build_object(
                       'from', 'in_flight', 'to', 'committed',
                       'provider_reference', 're_' || left(md5(src.id::text), 16))
                   WHEN 'operation.rejected' THEN jsonb_build_object(
                       'from', 'in_flight', 'to', 'rejected', 'error_class', 'card_declined')
                   WHEN 'operation.outcome_unknown' THEN jsonb_build_object(
                       'from', 'in_flight', 'to', 'outcome_unknown',
                       'reason', 'deadline_exceeded')
                   WHEN 'operation.callback_received' THEN jsonb_build_object(
                       'callback', src.callback_id, 'provider', 'sandbox-email',
                       'status', 'committed',
                       'provider_reference', 're_' || left(md5(src.id::text), 16),
                       'received_at', src.t0 + interval '30 seconds')
                   WHEN 'operation.reconciled' THEN jsonb_build_object(
                       'from', 'outcome_unknown', 'to', 'committed',
                       'method', CASE src.profile WHEN 'callback' THEN 'callback'
                                                  ELSE 'lookup' END,
                       'reconcile_attempt', 1)
                   WHEN 'operation.escalated' THEN jsonb_build_object(
                       'from', 'outcome_unknown', 'to', 'escalated',
                       'reason', 'reconcile_exhausted')
                   WHEN 'operation.resolved' THEN jsonb_build_object(
                       'from', 'escalated', 'to', 'committed', 'resolved_by', 'ada@example.com',
                       'decision', 'committed', 'evidence', 'found in the provider dashboard')
                   WHEN 'agent.completed' THEN jsonb_build_object(
                       'agent.outcome', 'refund_confirmed')
                   END ORDER BY e.k) AS attrs,
               array_agg(src.t0 + (e.k - 1) * interval '1 second' ORDER BY e.k) AS times
        FROM unnest(src.names) WITH ORDINALITY AS e (name, k)
    ) ev
)
SELECT v.*, ARRAY[h1, h2, h3, h4, h5] AS hashes
FROM evented v
CROSS JOIN LATERAL (SELECT outbox_event_hash(v.id, v.e0, 1, v.names[1], v.attrs[1],
                                             v.times[1], NULL) AS h1) c1
CROSS JOIN LATERAL (SELECT CASE WHEN v.n >= 2 THEN outbox_event_hash(
    v.id, v.e0 + 1, 2, v.names[2], v.attrs[2], v.times[2], h1) END AS h2) c2
CROSS JOIN LATERAL (SELECT CASE WHEN v.n >= 3 THEN outbox_event_hash(
    v.id, v.e0 + 2, 3, v.names[3], v.attrs[3], v.times[3], h2) END AS h3) c3
CROSS JOIN LATERAL (SELECT CASE WHEN v.n >= 4 THEN outbox_event_hash(
    v.id, v.e0 + 3, 4, v.names[4], v.attrs[4], v.times[4], h3) END AS h4) c4
CROSS JOIN LATERAL (SELECT CASE WHEN v.n >= 5 THEN outbox_event_hash(
    v.id, v.e0 + 4, 5, v.names[5], v.attrs[5], v.times[5], h4) END AS h5) c5
"""

_OPERATIONS = f"""
INSERT INTO operations (id, run_id, decision_key, tool_name, tool_version, side_effect, input,
                        input_fingerprint, requires_approval, state, attempts,
                        reconcile_attempts, lease_token, next_attempt_at, first_attempt_at,
                        provider_reference, result, last_error_class, effect_possible,
                        created_at, updated_at, recorded_by)
SELECT id, 'run_' || %(tag)s || '_' || i / {RUN_SIZE}, 'call_' || i %% {RUN_SIZE}, tool_name, 1,
       side_effect,
       jsonb_build_object('payment_id', 'pay_' || i, 'amount_cents', 100 + i %% 90000,
                          'currency', 'EUR', 'reason', ''),
       encode(sha256(convert_to(id::text, 'UTF8')), 'hex'), profile = 'approved', state, 1,
       CASE WHEN profile IN ('looked_up', 'callback', 'escalated_resolved') THEN 1 ELSE 0 END,
       (extract(epoch FROM t0) * 1e6)::bigint, times[n], t0,
       CASE WHEN state = 'committed' THEN 're_' || left(md5(id::text), 16) END,
       CASE WHEN state = 'committed' THEN '{{"status": "succeeded"}}'::jsonb END,
       CASE WHEN state = 'rejected' THEN 'card_declined' END,
       profile IN ('looked_up', 'callback', 'escalated_resolved'),
       t0, times[n], current_user
FROM fill_stage
"""

_EVENTS = """
INSERT INTO operation_events (id, operation_id, name, attributes, created_at, seq, prev_hash,
                              hash)
OVERRIDING SYSTEM VALUE
SELECT s.e0 + k - 1, s.id, s.names[k], s.attrs[k], s.times[k], k,
       CASE WHEN k > 1 THEN s.hashes[k - 1] END, s.hashes[k]
FROM fill_stage s CROSS JOIN LATERAL generate_series(1, s.n) AS k
"""

_HEADS = """
INSERT INTO operation_event_heads (operation_id, events, prev_hash, last_hash)
SELECT id, n, hashes[n - 1], hashes[n] FROM fill_stage
"""

_APPROVALS = """
INSERT INTO approvals (id, operation_id, intent_hash, decision, approved_by, expires_at,
                       created_at)
SELECT md5('approval:' || id::text)::uuid, id, encode(sha256(convert_to(id::text, 'UTF8')), 'hex'),
       'granted', 'ada@example.com', t0 + interval '1 day', times[3]
FROM fill_stage WHERE profile = 'approved'
"""

_CALLBACKS = """
INSERT INTO callbacks (id, provider, event_id, status, named_operation_id, operation_id,
                       provider_reference, payload_digest, received_at, outcome, applied_at)
OVERRIDING SYSTEM VALUE
SELECT callback_id, 'sandbox-email', 'evt_' || replace(id::text, '-', ''), 'committed', id, id,
       're_' || left(md5(id::text), 16),
       encode(sha256(convert_to('cb' || id::text, 'UTF8')), 'hex'),
       t0 + interval '30 seconds', 'settled', times[4]
FROM fill_stage WHERE profile = 'callback'
"""

_OUTBOX = """
INSERT INTO outbox (operation_id, routing_key, headers, created_at, available_at, published_at)
SELECT id, tool_name || '.v1', '{}'::jsonb, t0, t0, t0 + interval '20 milliseconds'
FROM fill_stage WHERE t0 > %(fill_now)s::timestamptz - %(retention)s::interval
"""


@dataclass(frozen=True)
class FillReport:
    operations: int
    seconds: float
    tag: str


def _reserve(connection: psycopg.Connection[Any], table: str, count: int) -> int:
    """The first of ``count`` ids of ``table``'s identity drawn in advance; the
    sequence moves past them, so nothing else is handed one."""
    row = connection.execute(
        "SELECT nextval(pg_get_serial_sequence(%(table)s, 'id')) AS first",
        {"table": table},
    ).fetchone()
    assert row is not None
    first = int(row[0])
    connection.execute(
        "SELECT setval(pg_get_serial_sequence(%(table)s, 'id'), %(last)s)",
        {"table": table, "last": first + count},
    )
    return first


def fill(
    url: str,
    operations: int,
    *,
    batch: int = 100_000,
    days: int = 90,
    retention: timedelta = timedelta(days=7),
    progress: Callable[[int, float], None] | None = None,
) -> FillReport:
    """Write ``operations`` settled operations into the database at ``url`` (schema
    applied), ``batch`` per transaction; returns how long it took."""
    if operations < 1 or batch < 1:
        raise ValueError("a fill writes at least one operation, at least one per batch")
    tag = uuid.uuid4().hex[:8]
    began = time.monotonic()
    # Autocommit: each batch's transaction() is a transaction, not a savepoint of one.
    with psycopg.connect(url, autocommit=True) as connection:
        fill_now = connection.execute("SELECT now() - interval '1 minute'").fetchone()
        assert fill_now is not None
        for first in range(1, operations + 1, batch):
            last = min(operations, first + batch - 1)
            count = last - first + 1
            with connection.transaction():
                for table in FILLED_TABLES:
                    connection.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
                params = {
                    "tag": tag,
                    "first": first,
                    "last": last,
                    "total": operations,
                    "span": timedelta(days=days),
                    "fill_now": fill_now[0],
                    "retention": retention,
                    "events_base": _reserve(connection, "operation_events", count * MAX_EVENTS),
                    "callbacks_base": _reserve(connection, "callbacks", count),
                }
                connection.execute(_STAGE, params)
                for statement in (_OPERATIONS, _EVENTS, _HEADS, _APPROVALS, _CALLBACKS, _OUTBOX):
                    connection.execute(statement, params)
                for table in FILLED_TABLES:
                    connection.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")
            if progress is not None:
                progress(last, time.monotonic() - began)
    return FillReport(operations=operations, seconds=time.monotonic() - began, tag=tag)


def filled_ids(url: str, tag: str, *, limit: int | None = None) -> list[uuid.UUID]:
    """Ids of operations the fill tagged ``tag`` wrote (its runs are run_<tag>_*)."""
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            "SELECT id FROM operations WHERE run_id LIKE %(runs)s ORDER BY id LIMIT %(limit)s",
            {"runs": f"run_{tag}_%", "limit": limit},
        ).fetchall()
    return [row[0] for row in rows]
