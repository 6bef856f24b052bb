-- Every statement effect-outbox runs, by name. Parsed once by outbox.sql; only the
-- runner in outbox.store executes them. Parameters use psycopg's %(name)s style; arrays
-- go as %(name)b, in binary: a text array literal escapes every element (a jsonb[] of a
-- burst of 16 cost 283 µs to dump as text, 72 in binary: docs/benchmarks.md, "array
-- parameters in binary").
-- Grouped by the module whose plans run them. Two kinds of SQL live elsewhere: the DDL
-- (schema.sql and roles.sql at the repository root) and CREATE/DROP DATABASE, which
-- outbox.schema composes because a database name is an identifier, not a parameter.

-- ==== outbox.store.operations: what every component shares (record, read, claim, commit, move)

-- name: insert_decision
-- Write the operation (prepared), its outbox row and its operation.prepared event through the agent's one write path (outbox_record_decision in schema.sql), waiting at most lock_timeout_ms for a lock; no row back when (run_id, decision_key) is taken. A new operation comes back as its id and time only: every other column is the decision's own or what outbox_guard_birth makes every new row (store.operations builds the rest). An operation answered from history (its id is not the one given) comes whole in archived, without its input.
SELECT r.id, r.created_at,
       CASE WHEN r.id = %(id)s THEN NULL ELSE to_jsonb(r) - 'input' END AS archived
FROM outbox_record_decision(
    %(id)s, %(run_id)s, %(decision_key)s, %(tool_name)s, %(tool_version)s, %(side_effect)s,
    %(input)s, %(input_fingerprint)s, %(requires_approval)s, %(headers)s,
    %(lock_timeout_ms)s
) AS r

-- name: fingerprint_key
-- The deployment's key for short fingerprints (outbox_deployment, created by the first migration); the runner caches it per database.
SELECT fingerprint_key FROM outbox_deployment

-- name: get_operation
-- One operation by id.
SELECT * FROM operations WHERE id = %(id)s

-- name: get_operation_by_decision_key
-- The operation an agent already recorded under (run_id, decision_key), from the operation_status view: every column but the input, which the agent role may not read (the caller holds the input it recorded).
SELECT id, run_id, decision_key, tool_name, tool_version, side_effect, input_fingerprint,
       requires_approval, state, attempts, reconcile_attempts, lease_token, lease_owner,
       lease_expires_at, next_attempt_at, first_attempt_at, provider_reference, result,
       last_error_class, effect_possible, created_at, updated_at
FROM operation_status
WHERE run_id = %(run_id)s AND decision_key = %(decision_key)s

-- name: get_operations
-- Many operations by id, for a consumer checking a burst of deliveries at once.
SELECT * FROM operations WHERE id = ANY(%(ids)b::uuid[])

-- name: claim_operations
-- prepared -> in_flight for one worker, for one or many operations in one statement: each one that is due gets its own lease, bumped attempts and a new fencing token, and its operation.attempted event. The token is the clock in microseconds when that is higher than the last one plus one: a standby promoted after an asynchronous failover may not have the newest token a worker holds, and must not hand out the same value again.
WITH claimed AS (
    UPDATE operations
    SET state = 'in_flight',
        attempts = attempts + 1,
        lease_token = greatest(lease_token + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint),
        lease_owner = %(owner)s,
        lease_expires_at = now() + c.lease,
        first_attempt_at = COALESCE(first_attempt_at, now())
    FROM unnest(%(ids)b::uuid[], %(leases)b::interval[]) AS c (id, lease)
    WHERE operations.id = c.id AND state = 'prepared' AND next_attempt_at <= clock_timestamp()
    RETURNING operations.*
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, 'operation.attempted',
           jsonb_build_object('attempt', attempts, 'lease_token', lease_token, 'worker', lease_owner)
    FROM claimed
)
SELECT * FROM claimed

-- name: claim_deliveries
-- claim_operations for a consumer's burst without reading the operations first: claims each delivered operation that is prepared, due, matches its message (tool, version, fingerprint) and needs no approval, with its operation.attempted event, and returns what the consumer's checks read (the row as claimed, and first_attempt_at as it was before); the rest are left untouched for the checks that read them.
WITH delivered AS (
    SELECT *
    FROM unnest(%(ids)b::uuid[], %(leases)b::interval[], %(tool_names)b::text[],
                %(tool_versions)b::integer[], %(input_fingerprints)b::text[])
        AS d (id, lease, tool_name, tool_version, input_fingerprint)
), claimed AS (
    UPDATE operations o
    SET state = 'in_flight',
        attempts = o.attempts + 1,
        lease_token = greatest(o.lease_token + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint),
        lease_owner = %(owner)s,
        lease_expires_at = now() + d.lease,
        first_attempt_at = COALESCE(o.first_attempt_at, now())
    FROM delivered d
    WHERE o.id = d.id AND o.state = 'prepared' AND o.next_attempt_at <= clock_timestamp()
      -- An approval is checked against the approvals table before a claim: those go the
      -- way of a read, a check and claim_operations.
      AND NOT o.requires_approval
      AND o.tool_name = d.tool_name AND o.tool_version = d.tool_version
      AND o.input_fingerprint = d.input_fingerprint
    RETURNING o.id, o.run_id, o.decision_key, o.tool_name, o.tool_version, o.side_effect,
              o.input, o.input_fingerprint, o.requires_approval, o.state, o.attempts,
              o.reconcile_attempts, o.lease_token, o.lease_owner, o.lease_expires_at,
              o.next_attempt_at, o.first_attempt_at, o.provider_reference, o.result,
              o.last_error_class, o.effect_possible, o.created_at, o.updated_at,
              o.waiting_since,
              -- As the statement's snapshot has it, before the claim: the replay check
              -- counts from the first attempt. The claims set first_attempt_at only from
              -- NULL, so a row claimed and released since the snapshot reads the same
              -- value or NULL, which counts from the decision, earlier: never later.
              (SELECT p.first_attempt_at FROM operations p WHERE p.id = o.id)
                  AS first_attempt_before
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, 'operation.attempted',
           jsonb_build_object('attempt', attempts, 'lease_token', lease_token, 'worker', lease_owner)
    FROM claimed
)
SELECT * FROM claimed

-- name: commit_operations
-- in_flight -> committed for many operations in one statement, each only under its own fencing token; appends each one's operation.committed event. Returns only the columns it writes: under the token the rest are as the claim returned them.
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)b::uuid[], %(lease_tokens)b::bigint[], %(provider_references)b::text[],
                %(results)b::jsonb[], %(event_attributes)b::jsonb[])
        AS i (id, lease_token, provider_reference, result, event_attributes)
), moved AS (
    UPDATE operations o
    SET state = 'committed',
        lease_owner = NULL,
        lease_expires_at = NULL,
        waiting_since = NULL,
        provider_reference = COALESCE(i.provider_reference, o.provider_reference),
        result = COALESCE(i.result, o.result)
    FROM outcome i
    WHERE o.id = i.id AND o.state = 'in_flight' AND o.lease_token = i.lease_token
    RETURNING o.id, o.state, o.lease_owner, o.lease_expires_at, o.provider_reference,
              o.result, o.updated_at
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT m.id, 'operation.committed', i.event_attributes
    FROM moved m JOIN outcome i ON i.id = m.id
)
SELECT * FROM moved

-- name: transition_operation
-- Guarded move source -> target (state and, when given, fencing token must match); appends the event and, when asked, a fresh outbox row. A move to outcome_unknown marks the effect possible; only a lookup that proved it absent (effect_disproved) clears the mark. waiting: 'start' begins (or continues) a wait for the provider, 'end' clears it (the provider answered), anything else keeps it; attempt_refund gives back the attempt of a call the provider could not take.
WITH moved AS (
    UPDATE operations
    SET state = %(target)s,
        effect_possible = CASE
            WHEN %(target)s::text = 'outcome_unknown' THEN true
            WHEN %(effect_disproved)s::boolean THEN false
            ELSE effect_possible
        END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        provider_reference = COALESCE(%(provider_reference)s, provider_reference),
        result = COALESCE(%(result)s, result),
        last_error_class = COALESCE(%(error_class)s, last_error_class),
        next_attempt_at = COALESCE(now() + %(delay)s::interval, next_attempt_at),
        reconcile_attempts = reconcile_attempts + %(reconcile_increment)s::integer,
        attempts = attempts - %(attempt_refund)s::integer,
        waiting_since = CASE %(waiting)s::text
            WHEN 'start' THEN COALESCE(waiting_since, clock_timestamp())
            WHEN 'end' THEN NULL
            ELSE waiting_since
        END
    WHERE id = %(id)s
      AND state = %(source)s
      AND (%(lease_token)s::bigint IS NULL OR lease_token = %(lease_token)s::bigint)
    RETURNING *
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, %(event_name)s, %(event_attributes)s FROM moved
), queued AS (
    INSERT INTO outbox (operation_id, routing_key, available_at)
    SELECT id, tool_name || '.v' || tool_version, next_attempt_at FROM moved
    WHERE %(requeue)s
)
SELECT * FROM moved

-- name: list_events
-- The lifecycle events of one operation, oldest first.
SELECT id, operation_id, name, attributes, created_at
FROM operation_events
WHERE operation_id = %(operation_id)s
ORDER BY id

-- name: list_events_page
-- One page of an operation's timeline: at most `limit` events after event `after`, oldest first, or (when not `forward`) the `limit` events just before event `before`; each a range scan of the (operation_id, id) index, and a count of the events on either side of the page, in one snapshot.
WITH page AS (
    (SELECT id, operation_id, name, attributes, created_at
     FROM operation_events
     WHERE %(forward)s::boolean AND operation_id = %(operation_id)s
       AND id > %(after)s::bigint
     ORDER BY id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT id, operation_id, name, attributes, created_at
     FROM operation_events
     WHERE NOT %(forward)s::boolean AND operation_id = %(operation_id)s
       AND id < %(before)s::bigint
     ORDER BY id DESC
     LIMIT %(limit)s)
), bounds AS MATERIALIZED (
    -- An empty page still splits the timeline at its cursor.
    SELECT coalesce(min(id), CASE WHEN %(forward)s::boolean THEN %(after)s::bigint + 1
                                  ELSE %(before)s::bigint END) AS lo,
           coalesce(max(id), CASE WHEN %(forward)s::boolean THEN %(after)s::bigint
                                  ELSE %(before)s::bigint - 1 END) AS hi
    FROM page
), counts AS MATERIALIZED (
    SELECT b.lo, b.hi,
           (SELECT count(*) FROM operation_events e
            WHERE e.operation_id = %(operation_id)s AND e.id < b.lo) AS earlier,
           (SELECT count(*) FROM operation_events e
            WHERE e.operation_id = %(operation_id)s AND e.id > b.hi) AS later
    FROM bounds b
)
SELECT c.lo, c.hi, c.earlier, c.later,
       p.id, p.operation_id, p.name, p.attributes, p.created_at
FROM counts c
LEFT JOIN page p ON true
ORDER BY p.id

-- name: last_reasons
-- The newest event of this name of each of these operations, with its reason and time: one backward index scan per operation that stops at the first, whatever the timeline's length.
SELECT o.id AS operation_id, last.reason, last.created_at
FROM unnest(%(ids)b::uuid[]) AS o (id)
CROSS JOIN LATERAL (
    SELECT e.attributes->>'reason' AS reason, e.created_at
    FROM operation_events e
    WHERE e.operation_id = o.id AND e.name = %(name)s
    ORDER BY e.id DESC
    LIMIT 1
) AS last

-- name: list_outbox_rows
-- The outbox rows of one operation, oldest first.
SELECT id, operation_id, routing_key, headers, created_at, available_at, published_at,
       publish_attempts, last_error
FROM outbox
WHERE operation_id = %(operation_id)s
ORDER BY id

-- name: insert_event
-- Append one lifecycle event that moves no state (an approval wait, a deferred lookup).
INSERT INTO operation_events (operation_id, name, attributes)
VALUES (%(operation_id)s, %(name)s, %(attributes)s)

-- ==== outbox.store.approvals: a person's grant or denial, and the check before an effect

-- name: insert_approval
-- Record a person's grant or denial bound to the operation's intent (the approvals trigger appends its event); a grant for a waiting operation also queues a fresh outbox row.
WITH decided AS (
    INSERT INTO approvals (id, operation_id, intent_hash, decision, approved_by, expires_at)
    SELECT %(id)s, id, COALESCE(%(intent_hash)s, input_fingerprint), %(decision)s,
           %(approved_by)s, clock_timestamp() + %(ttl)s::interval
    FROM operations
    WHERE id = %(operation_id)s
    RETURNING *
), queued AS (
    INSERT INTO outbox (operation_id, routing_key)
    SELECT o.id, o.tool_name || '.v' || o.tool_version
    FROM decided d JOIN operations o ON o.id = d.operation_id
    WHERE d.decision = 'granted' AND o.state = 'prepared'
)
SELECT * FROM decided

-- name: latest_approval
-- The operation's fingerprint, the database's clock and its most recent approval decision, if any; not who decided (the agent role may not read people's names).
SELECT o.input_fingerprint AS operation_fingerprint,
       now() AS checked_at,
       a.id, a.operation_id, a.intent_hash, a.decision, a.expires_at, a.created_at
FROM operations o
LEFT JOIN LATERAL (
    SELECT id, operation_id, intent_hash, decision, expires_at, created_at FROM approvals
    WHERE operation_id = o.id
    ORDER BY created_at DESC
    LIMIT 1
) a ON true
WHERE o.id = %(operation_id)s

-- ==== outbox.store.awaiting: the agent's reads while it awaits outcomes

-- name: listen_operation_changes
-- Subscribe this session to the notifications every new operation event sends (an outcome watcher).
LISTEN outbox_operation_changed

-- name: operation_outcomes
-- Where each of these operations stands, with the latest approval decision of one that waits for approval: what an awaiting agent reads. No input, no approver.
SELECT o.id, o.run_id, o.decision_key, o.tool_name, o.tool_version, o.state,
       o.requires_approval, o.input_fingerprint, o.attempts, o.provider_reference, o.result,
       o.last_error_class, o.updated_at, now() AS checked_at,
       a.decision AS approval_decision, a.intent_hash AS approval_intent_hash,
       a.expires_at AS approval_expires_at
FROM operation_status o
LEFT JOIN LATERAL (
    SELECT decision, intent_hash, expires_at FROM approvals
    WHERE operation_id = o.id
    ORDER BY created_at DESC
    LIMIT 1
) a ON o.requires_approval AND o.state = 'prepared'
WHERE o.id = ANY(%(ids)b::uuid[])

-- name: operation_outcomes_changed
-- operation_outcomes for a watcher, without what it has already read: only operations whose row version (xmin, new with every update) differs from the one it holds, or that it has not read yet, or that wait for an approval (a grant changes no operation row).
SELECT o.row_version,
       o.id, o.run_id, o.decision_key, o.tool_name, o.tool_version, o.state,
       o.requires_approval, o.input_fingerprint, o.attempts, o.provider_reference, o.result,
       o.last_error_class, o.updated_at, now() AS checked_at,
       a.decision AS approval_decision, a.intent_hash AS approval_intent_hash,
       a.expires_at AS approval_expires_at
FROM unnest(%(ids)b::uuid[], %(row_versions)b::bigint[]) AS known (id, row_version)
JOIN operation_status o ON o.id = known.id
LEFT JOIN LATERAL (
    SELECT decision, intent_hash, expires_at FROM approvals
    WHERE operation_id = o.id
    ORDER BY created_at DESC
    LIMIT 1
) a ON o.requires_approval AND o.state = 'prepared'
WHERE known.row_version IS NULL
   OR o.row_version <> known.row_version
   OR (o.requires_approval AND o.state = 'prepared')

-- name: archived_outcomes
-- operation_outcomes of operations the hot tables no longer hold (asked only for those): each one's row as the archive kept it with its decision key, without the input (history_keys_0 and _1, one primary-key probe each; outbox_history_key_operation reads a row of either version 17's columns or an older row's jsonb). The key is the caller's when it holds one; otherwise history gives it, by id (a primary-key probe per day). An archived operation whose key is not kept (recorded without one) comes back with no state; an id found nowhere is absent.
SELECT w.id, o.run_id, o.decision_key, o.tool_name, o.tool_version, o.state,
       o.requires_approval, o.input_fingerprint, o.attempts, o.provider_reference, o.result,
       o.last_error_class, o.updated_at, now() AS checked_at,
       NULL::text AS approval_decision, NULL::text AS approval_intent_hash,
       NULL::timestamptz AS approval_expires_at
FROM unnest(%(ids)b::uuid[], %(run_ids)b::text[], %(decision_keys)b::text[])
     AS w (id, run_id, decision_key)
LEFT JOIN LATERAL (
    SELECT h.run_id, h.decision_key FROM history h
    WHERE w.decision_key IS NULL AND h.operation_id = w.id
    LIMIT 1
) h ON true
LEFT JOIN LATERAL (
    SELECT outbox_history_key_operation(g) AS operation FROM history_keys_0 g
    WHERE g.run_id = coalesce(w.run_id, h.run_id)
      AND g.decision_key = coalesce(w.decision_key, h.decision_key) AND g.operation_id = w.id
    UNION ALL
    SELECT outbox_history_key_operation(g) AS operation FROM history_keys_1 g
    WHERE g.run_id = coalesce(w.run_id, h.run_id)
      AND g.decision_key = coalesce(w.decision_key, h.decision_key) AND g.operation_id = w.id
    LIMIT 1
) k ON true
LEFT JOIN LATERAL jsonb_populate_record(NULL::operations, k.operation) AS o ON true
WHERE k.operation IS NOT NULL OR h.run_id IS NOT NULL

-- ==== outbox.store.dispatch: the dispatcher's outbox rows and gauges

-- name: claim_outbox_batch
-- Lock up to batch_size available, unpublished rows in id order (skipping rows another dispatcher holds), with what the message needs: its trace context only when it is a valid W3C traceparent (the headers are never parsed outside the database).
WITH claimed AS (
    SELECT id, operation_id, routing_key, headers, created_at, available_at, publish_attempts
    FROM outbox
    WHERE published_at IS NULL AND available_at <= clock_timestamp()
      -- Only a lower bound from this statement's own snapshot (no row it could claim lies
      -- below it), not a high-water mark: it lets the scan start past published rows.
      -- The planner otherwise walks the primary key from the first id and reads every
      -- published row's heap tuple to filter it out, a cost that grows with each batch of
      -- a backlog's drain; the min() is an index-only probe of outbox_pending.
      AND id >= (SELECT min(id) FROM outbox WHERE published_at IS NULL)
    ORDER BY id
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
)
SELECT c.id, c.operation_id, c.routing_key,
       CASE WHEN jsonb_typeof(c.headers -> 'traceparent') = 'string'
                 AND c.headers ->> 'traceparent' ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            THEN c.headers ->> 'traceparent' END AS traceparent,
       c.publish_attempts,
       EXTRACT(EPOCH FROM clock_timestamp() - c.created_at)::float8 AS waited_seconds,
       o.tool_name, o.tool_version, o.input_fingerprint
FROM claimed c
-- One primary-key probe per claimed row: the LIMIT keeps the planner from flattening
-- this into a hash join, which read every operation (a sequential scan per batch, most
-- of a claim's server time with tens of thousands of operations).
CROSS JOIN LATERAL (
    SELECT op.tool_name, op.tool_version, op.input_fingerprint
    FROM operations op
    WHERE op.id = c.operation_id
    LIMIT 1
) o
ORDER BY c.id

-- name: mark_outbox_published
-- Mark confirmed rows published, in the transaction that claimed them.
UPDATE outbox
SET published_at = clock_timestamp(), publish_attempts = publish_attempts + 1
WHERE id = ANY(%(ids)b::bigint[])

-- name: mark_outbox_failed
-- Count a failed publish on each row, keep its last error and push it back by its own delay.
UPDATE outbox AS o
SET publish_attempts = o.publish_attempts + 1,
    last_error = f.error,
    available_at = clock_timestamp() + f.delay
FROM unnest(%(ids)b::bigint[], %(errors)b::text[], %(delays)b::interval[]) AS f (id, error, delay)
WHERE o.id = f.id

-- name: outbox_backlog
-- Unpublished rows and the age of the oldest, for the backlog metrics.
SELECT count(*) AS pending,
       COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8
           AS oldest_age_seconds
FROM outbox
WHERE published_at IS NULL

-- name: count_operations_by_state
-- How many operations are in each state, exactly, for the outbox_operations gauge while the table is small (operations_analyzed_rows below the dispatcher's threshold); states with no rows are absent. It reads every row, so past the threshold it is operations_by_state.
SELECT state, count(*)::bigint AS operations
FROM operations
GROUP BY state

-- name: operations_by_state
-- How many operations are in each state on a large table, for the outbox_operations gauge; states with no rows are absent. The open states are counted exactly from the partial index that holds only them (operations_state_next_attempt), so a pass costs what is open, not the history; committed and rejected only grow, and are the planner's estimate: the table's rows times each state's frequency as the last ANALYZE saw them (autovacuum keeps both close). Counting them read every row of the table on every pass (608 ms at 2,000,000 operations, every 5 s in every dispatcher). Chosen by the caller from operations_analyzed_rows, not by a condition in the statement: a branch the statement skips still started its parallel workers on every pass (16.116 ms against 3.82 ms at 300,000 operations). The table's name is also given to pg_stats as a constant, not only through the join: the view then finds its row by the catalogs' indexes, where through the join it read the whole of pg_class or pg_attribute on every pass (docs/benchmarks.md, "Cost as the history grows", 2,000,000 operations).
SELECT state, count(*)::bigint AS operations
FROM operations
WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated')
GROUP BY state
UNION ALL
SELECT v.state, round(greatest(c.reltuples, 0) * v.frequency)::bigint AS operations
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_stats st ON st.schemaname = n.nspname AND st.tablename = c.relname
                AND st.tablename = 'operations' AND st.attname = 'state'
CROSS JOIN LATERAL unnest(st.most_common_vals::text::text[], st.most_common_freqs)
    AS v (state, frequency)
WHERE c.oid = 'operations'::regclass AND v.state IN ('committed', 'rejected')

-- name: delete_published_outbox_rows
-- Delete one small batch of rows published before the cutoff; rows locked elsewhere wait for the next pass.
WITH deleted AS (
    DELETE FROM outbox
    WHERE id IN (
        SELECT id FROM outbox
        WHERE published_at < clock_timestamp() - %(retention)s::interval
        ORDER BY published_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*) AS deleted FROM deleted

-- name: listen_outbox_pending
-- Subscribe this session to the notifications the outbox insert trigger sends.
LISTEN outbox_pending

-- ==== outbox.store.reconcile: the reconciler's leases, lookups and endings

-- name: claim_reconciliation_batch
-- Lock unknown outcomes due for a lookup and in-flight operations whose lease expired, skipping rows others hold and, for their first 10 s due, operations whose callback is being recorded (another session holds their callback lock: outbox_record_callback in schema.sql). The callback lock is taken here, exclusively, to the transaction's end.
WITH due AS MATERIALIZED (
    SELECT *
    FROM operations
    WHERE id IN (
        -- Each state its own ordered scan of operations_state_next_attempt, not one
        -- bitmap scan of both: a bitmap scan visits the heap page of every entry the
        -- index holds, and between two vacuums the index holds a dead in_flight entry
        -- for every operation settled since the last (docs/benchmarks.md, "Cost as the
        -- history grows"), where an index scan marks each dead entry once and passes
        -- over it from then on. Twice the limit each, so rows another reconciler holds
        -- (skipped below) still leave a full batch.
        (SELECT u.id FROM operations u
         WHERE u.state = 'outcome_unknown' AND u.next_attempt_at <= clock_timestamp()
           AND (u.lease_expires_at IS NULL OR u.lease_expires_at < clock_timestamp())
         ORDER BY u.next_attempt_at
         LIMIT 2 * %(limit)s)
        UNION ALL
        (SELECT f.id FROM operations f
         WHERE f.state = 'in_flight' AND f.lease_expires_at < clock_timestamp()
         ORDER BY f.next_attempt_at
         LIMIT 2 * %(limit)s)
    )
      AND ((state = 'outcome_unknown'
            AND next_attempt_at <= clock_timestamp()
            AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp()))
           OR (state = 'in_flight' AND lease_expires_at < clock_timestamp()))
    ORDER BY next_attempt_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
)
SELECT * FROM due
WHERE pg_try_advisory_xact_lock(outbox_callback_lock_key(id))
   OR greatest(next_attempt_at, coalesce(lease_expires_at, next_attempt_at))
      < clock_timestamp() - interval '10 seconds'
ORDER BY next_attempt_at

-- name: lease_for_reconciliation
-- Take a reconciler's lease on an unknown outcome: a new fencing token, so a slower reconciler's late write fails; rising with the clock as claim_operations' does, so a failover cannot hand it out twice.
UPDATE operations
SET lease_token = greatest(lease_token + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint),
    lease_owner = %(owner)s,
    lease_expires_at = clock_timestamp() + %(lease)s::interval
WHERE id = %(id)s AND state = 'outcome_unknown' AND lease_token = %(lease_token)s
RETURNING *

-- name: defer_reconciliation
-- An inconclusive lookup: count it, release the lease, look again after the delay, and say so in an event.
WITH deferred AS (
    UPDATE operations
    SET reconcile_attempts = reconcile_attempts + 1,
        lease_owner = NULL,
        lease_expires_at = NULL,
        next_attempt_at = clock_timestamp() + %(delay)s::interval,
        last_error_class = %(reason)s,
        waiting_since = NULL
    WHERE id = %(id)s AND state = 'outcome_unknown' AND lease_token = %(lease_token)s
    RETURNING *
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, 'operation.reconcile_deferred',
           jsonb_build_object('reason', %(reason)s, 'reconcile_attempt', reconcile_attempts,
                              'method', 'lookup')
    FROM deferred
)
SELECT * FROM deferred

-- name: requeue_stale_prepared
-- Queue a fresh outbox row for prepared operations that no message has reached for a long time, except those waiting for an approval, and only where the message is gone rather than waiting in a slow queue: consumers have since taken up an operation whose first message went out at least half the stale period after this one's latest, or a consumer refused that latest message, or it went out three stale periods ago.
WITH frontier AS (
    -- How far the consumers have read: the newest first message of an operation that a
    -- consumer has taken up. Never a requeue's message: the operation may have been
    -- taken up through its first while that one still waits in the queue.
    SELECT b.published_at
    FROM outbox b
    JOIN operations t ON t.id = b.operation_id
    WHERE b.published_at IS NOT NULL
      AND t.attempts > 0
      AND NOT EXISTS (SELECT 1 FROM outbox f WHERE f.operation_id = b.operation_id AND f.id < b.id)
    ORDER BY b.published_at DESC
    LIMIT 1
), stale AS (
    SELECT o.id, o.tool_name, o.tool_version
    FROM operations o
    CROSS JOIN LATERAL (
        SELECT coalesce(max(b.published_at), '-infinity') AS published_at
        FROM outbox b WHERE b.operation_id = o.id
    ) latest
    WHERE o.state = 'prepared'
      AND o.next_attempt_at < clock_timestamp() - %(stale_after)s::interval
      AND NOT EXISTS (
          SELECT 1 FROM outbox b
          WHERE b.operation_id = o.id
            AND (b.published_at IS NULL
                 OR b.published_at > clock_timestamp() - %(stale_after)s::interval)
      )
      AND NOT EXISTS (
          SELECT 1 FROM operation_events e
          WHERE e.id = (SELECT max(x.id) FROM operation_events x WHERE x.operation_id = o.id)
            AND e.name = 'operation.approval_required'
      )
      AND (
          latest.published_at < (SELECT published_at FROM frontier) - %(stale_after)s::interval / 2
          OR EXISTS (
              SELECT 1 FROM operation_events r
              WHERE r.operation_id = o.id AND r.name = 'operation.dead_lettered'
                AND r.created_at >= latest.published_at
          )
          OR latest.published_at < clock_timestamp() - 3 * %(stale_after)s::interval
      )
    ORDER BY o.next_attempt_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE OF o SKIP LOCKED
), queued AS (
    INSERT INTO outbox (operation_id, routing_key)
    SELECT id, tool_name || '.v' || tool_version FROM stale
    RETURNING operation_id
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT operation_id, 'operation.requeued', jsonb_build_object('reason', 'no_delivery')
    FROM queued
)
SELECT operation_id FROM queued

-- name: escalate_undeliverable
-- prepared -> escalated for stale operations that consumers positively refused: queued again `cycles` times, refused (an operation.dead_lettered event, written by a consumer that cannot run it) at least `cycles` times, the latest message refused too. A requeue whose message only met timeouts or an unavailable database carries no refusal and never counts. The third ending, with the requeues, refusals and the last refusal's reason as evidence.
WITH stale AS (
    SELECT o.id, evidence.requeues, evidence.refusals, evidence.last_dead_letter
    FROM operations o
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE e.name = 'operation.requeued'
                                  AND e.attributes ->> 'reason' = 'no_delivery') AS requeues,
               count(*) FILTER (WHERE e.name = 'operation.dead_lettered') AS refusals,
               max(e.id) FILTER (WHERE e.name = 'operation.requeued') AS last_requeue,
               max(e.id) FILTER (WHERE e.name = 'operation.dead_lettered') AS last_refusal,
               (array_agg(e.attributes ->> 'reason' ORDER BY e.id DESC)
                    FILTER (WHERE e.name = 'operation.dead_lettered'))[1] AS last_dead_letter
        FROM operation_events e
        WHERE e.operation_id = o.id
    ) evidence
    WHERE o.state = 'prepared'
      AND o.next_attempt_at < clock_timestamp() - %(stale_after)s::interval
      AND NOT EXISTS (
          SELECT 1 FROM outbox b
          WHERE b.operation_id = o.id
            AND (b.published_at IS NULL
                 OR b.published_at > clock_timestamp() - %(stale_after)s::interval)
      )
      AND evidence.requeues >= %(cycles)s
      AND evidence.refusals >= %(cycles)s
      AND evidence.last_refusal > evidence.last_requeue
    ORDER BY o.next_attempt_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE OF o SKIP LOCKED
), moved AS (
    UPDATE operations o
    SET state = 'escalated', last_error_class = 'undeliverable'
    FROM stale s
    WHERE o.id = s.id AND o.state = 'prepared'
    RETURNING o.id, o.tool_name
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT m.id, 'operation.escalated',
           jsonb_build_object('from', 'prepared', 'to', 'escalated', 'reason', 'undeliverable',
                              'requeues', s.requeues, 'refusals', s.refusals,
                              'last_dead_letter', coalesce(s.last_dead_letter, 'unknown'))
    FROM moved m JOIN stale s ON s.id = m.id
)
SELECT id AS operation_id, tool_name FROM moved

-- name: reject_denied_operations
-- prepared -> rejected (policy approval_denied) for operations whose latest approval decision is a denial older than the grace window: no grant followed, so the decision ends.
WITH denied AS (
    SELECT o.id
    FROM operations o
    JOIN LATERAL (
        SELECT a.decision, a.created_at FROM approvals a
        WHERE a.operation_id = o.id
        ORDER BY a.created_at DESC
        LIMIT 1
    ) latest ON true
    WHERE o.state = 'prepared'
      AND latest.decision = 'denied'
      AND latest.created_at < clock_timestamp() - %(grace)s::interval
    ORDER BY latest.created_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE OF o SKIP LOCKED
), moved AS (
    UPDATE operations o
    SET state = 'rejected', last_error_class = 'approval_denied'
    FROM denied d
    WHERE o.id = d.id AND o.state = 'prepared'
    RETURNING o.id
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, 'operation.rejected',
           jsonb_build_object('from', 'prepared', 'to', 'rejected', 'policy', 'approval_denied')
    FROM moved
)
SELECT id AS operation_id FROM moved

-- ==== outbox.store.providers: the provider breaker's row, its events, and the operations that wait for a provider

-- name: ensure_provider_health
-- A closed breaker row for the provider if it has none, so that the row can be locked.
INSERT INTO provider_health (provider) VALUES (%(provider)s) ON CONFLICT (provider) DO NOTHING

-- name: lock_provider_health
-- The provider's breaker row, locked until the transaction ends, with the database's clock: every decision on it is made under this lock.
SELECT *, clock_timestamp() AS now FROM provider_health WHERE provider = %(provider)s FOR UPDATE

-- name: write_provider_health
-- The breaker row as outbox/breaker.py decided it under lock_provider_health.
UPDATE provider_health
SET state = %(state)s,
    failing_operations = %(failing_operations)b::uuid[],
    failing_since = %(failing_since)s,
    last_failure = %(last_failure)s,
    outage_started_at = %(outage_started_at)s,
    opened_at = %(opened_at)s,
    probes = %(probes)s,
    next_probe_at = %(next_probe_at)s,
    probe_owner = %(probe_owner)s,
    probe_expires_at = %(probe_expires_at)s,
    not_before = %(not_before)s,
    updated_at = clock_timestamp()
WHERE provider = %(provider)s

-- name: book_provider_call
-- A call's turn under the provider's declared rate (GCRA): books one interval past the later of the theoretical arrival time and now, and returns how long the call waits for its turn (0 within the burst), unless the turns booked already reach past the horizon (then nothing is booked and no row returns).
UPDATE provider_health
SET rate_tat = greatest(coalesce(rate_tat, clock_timestamp()), clock_timestamp())
               + %(interval)s::interval
WHERE provider = %(provider)s
  AND greatest(coalesce(rate_tat, clock_timestamp()), clock_timestamp())
      <= clock_timestamp() + %(horizon)s::interval
RETURNING greatest(
    extract(epoch FROM rate_tat - %(interval)s::interval - %(tolerance)s::interval
                      - clock_timestamp()),
    0
)::float8 AS wait_seconds

-- name: take_provider_call
-- A call out to a provider with a declared limit on calls at once, taken under the breaker row's lock (lock_provider_health): the calls whose holders' time ran out are forgotten first; granted (a row, until it expires) only while fewer than the limit are out. Returns whether it was granted and when the soonest call out expires.
WITH expired AS (
    DELETE FROM provider_calls
    WHERE provider = %(provider)s AND expires_at <= clock_timestamp()
      AND operation_id <> %(operation_id)s
    RETURNING operation_id
), out AS (
    SELECT count(*) AS calls, min(expires_at) AS soonest
    FROM provider_calls c
    WHERE c.provider = %(provider)s AND c.expires_at > clock_timestamp()
      AND c.operation_id <> %(operation_id)s
), taken AS (
    INSERT INTO provider_calls (provider, operation_id, expires_at)
    SELECT %(provider)s, %(operation_id)s, clock_timestamp() + %(hold)s::interval
    FROM out WHERE out.calls < %(limit)s
    ON CONFLICT (provider, operation_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
    RETURNING operation_id
)
SELECT EXISTS (SELECT 1 FROM taken) AS granted, (SELECT soonest FROM out) AS soonest,
       (SELECT count(*) FROM expired) AS expired

-- name: give_back_provider_call
-- The call is over: its place goes to the next one.
DELETE FROM provider_calls WHERE provider = %(provider)s AND operation_id = %(operation_id)s

-- name: insert_provider_event
-- Append provider.unavailable or provider.available.
INSERT INTO provider_events (provider, name, attributes)
VALUES (%(provider)s, %(name)s, %(attributes)s)

-- name: share_provider_health
-- The provider's breaker state, share-locked until the transaction ends: a wait written in this transaction and the answer that closes the breaker (which locks the row for update, then releases the waiting operations) cannot pass each other.
SELECT state FROM provider_health WHERE provider = %(provider)s FOR SHARE

-- name: provider_health_rows
-- The breaker rows of these providers with the database's clock (a consumer's cached view); one row with a NULL provider when none has a row, for the clock.
SELECT c.now, h.*
FROM (SELECT clock_timestamp() AS now) c
LEFT JOIN provider_health h ON h.provider = ANY(%(providers)b::text[])

-- name: all_provider_health
-- Every breaker row with the database's clock and how many operations of each wait, for `outbox providers` and the console.
SELECT h.*, clock_timestamp() AS now,
       (SELECT e.created_at FROM provider_events e
        WHERE e.provider = h.provider ORDER BY e.id DESC LIMIT 1) AS last_event_at
FROM provider_health h
ORDER BY h.provider

-- name: waiting_operations_by_tool
-- How many operations of each tool wait for their provider (prepared or unknown, waiting_since set), from the partial index operations_waiting.
SELECT tool_name, count(*) AS waiting
FROM operations
WHERE waiting_since IS NOT NULL AND state IN ('prepared', 'outcome_unknown')
GROUP BY tool_name

-- name: count_waited_operations
-- How many operations of these tools waited for their provider since the outage began: for provider.available's evidence.
SELECT count(*) AS waited
FROM operations
WHERE waiting_since IS NOT NULL AND tool_name = ANY(%(tools)b::text[])
  AND state IN ('prepared', 'outcome_unknown', 'in_flight')

-- name: release_waiting_operations
-- The provider is back: every waiting operation of these tools stops waiting (the provider answered, so a later failure starts a wait of its own, and the outage tolerance counts from there) and is due again within the spread (drawn at random, so the provider is not met by all of them at once), the prepared ones with a fresh outbox row; one due sooner keeps its time. Held leases are left alone; their holders are calling already. Returns how many were made due.
WITH waiting AS (
    SELECT id, next_attempt_at > clock_timestamp() + %(spread)s::interval AS later
    FROM operations
    WHERE waiting_since IS NOT NULL
      AND tool_name = ANY(%(tools)b::text[])
      AND state IN ('prepared', 'outcome_unknown')
      AND lease_owner IS NULL
    FOR NO KEY UPDATE
), released AS (
    UPDATE operations o
    SET next_attempt_at = CASE WHEN w.later
                               THEN clock_timestamp() + random() * %(spread)s::interval
                               ELSE o.next_attempt_at END,
        waiting_since = NULL
    FROM waiting w
    WHERE o.id = w.id
    RETURNING o.id, o.state, o.tool_name, o.tool_version, o.next_attempt_at, w.later
), queued AS (
    INSERT INTO outbox (operation_id, routing_key, available_at)
    SELECT id, tool_name || '.v' || tool_version, next_attempt_at
    FROM released WHERE state = 'prepared' AND later
)
SELECT count(*) FILTER (WHERE later) AS released FROM released

-- name: nominate_probe
-- A provider's probe is due: the waiting operation of these tools due soonest becomes due now (a prepared one with a fresh outbox row), so that a call goes out to find the provider back, unless one of them is due within a second already. Returns the operation it nominated.
WITH nominated AS (
    UPDATE operations
    SET next_attempt_at = clock_timestamp()
    WHERE id = (
        SELECT id FROM operations
        WHERE waiting_since IS NOT NULL
          AND tool_name = ANY(%(tools)b::text[])
          AND state IN ('prepared', 'outcome_unknown')
          AND lease_owner IS NULL
        ORDER BY next_attempt_at
        LIMIT 1
        FOR NO KEY UPDATE SKIP LOCKED
    )
      AND next_attempt_at > clock_timestamp() + interval '1 second'
    RETURNING id, state, tool_name, tool_version, next_attempt_at
), queued AS (
    INSERT INTO outbox (operation_id, routing_key, available_at)
    SELECT id, tool_name || '.v' || tool_version, next_attempt_at
    FROM nominated WHERE state = 'prepared'
)
SELECT id FROM nominated

-- name: wait_prepared_for_provider
-- Prepared, due operations whose provider holds calls back: due again after each one's delay, with a fresh outbox row then, and waiting since now unless they already were (an operation.waiting event when the wait begins). No attempt is counted. Returns the ids it moved.
WITH wanted AS (
    SELECT w.id, w.delay, p.waiting_since AS waiting_before
    FROM unnest(%(ids)b::uuid[], %(delays)b::interval[]) AS w (id, delay)
    JOIN operations p ON p.id = w.id
), waiting AS (
    UPDATE operations o
    SET next_attempt_at = clock_timestamp() + w.delay,
        waiting_since = COALESCE(o.waiting_since, clock_timestamp())
    FROM wanted w
    WHERE o.id = w.id AND o.state = 'prepared' AND o.next_attempt_at <= clock_timestamp()
    RETURNING o.id, o.tool_name, o.tool_version, o.next_attempt_at, w.waiting_before
), queued AS (
    INSERT INTO outbox (operation_id, routing_key, available_at)
    SELECT id, tool_name || '.v' || tool_version, next_attempt_at FROM waiting
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT id, 'operation.waiting',
           jsonb_build_object('provider', %(provider)s::text, 'reason', %(reason)s::text,
                              'state', 'prepared')
    FROM waiting WHERE waiting_before IS NULL
)
SELECT id, waiting_before IS NULL AS began FROM waiting

-- name: wait_unknown_for_provider
-- An unknown outcome whose provider could not be asked now: its lease released, looked up again after the delay, no lookup counted; when the provider is why (waiting), waiting since now unless it already was (an operation.waiting event when the wait begins), otherwise (its turn under a declared rate) no wait begins.
WITH before AS (
    SELECT waiting_since FROM operations WHERE id = %(id)s
), waiting AS (
    UPDATE operations
    SET next_attempt_at = clock_timestamp() + %(delay)s::interval,
        waiting_since = CASE WHEN %(waiting)s::boolean
                             THEN COALESCE(waiting_since, clock_timestamp())
                             ELSE waiting_since END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        last_error_class = CASE WHEN %(waiting)s::boolean
                                THEN COALESCE(%(reason)s::text, last_error_class)
                                ELSE last_error_class END
    WHERE id = %(id)s AND state = 'outcome_unknown' AND lease_token = %(lease_token)s
    RETURNING *
), event AS (
    INSERT INTO operation_events (operation_id, name, attributes)
    SELECT w.id, 'operation.waiting',
           jsonb_build_object('provider', %(provider)s::text, 'reason', %(reason)s::text,
                              'state', 'outcome_unknown')
    FROM waiting w, before b WHERE b.waiting_since IS NULL AND %(waiting)s::boolean
)
SELECT * FROM waiting

-- name: list_provider_events
-- A provider's outages, newest first.
SELECT id, provider, name, attributes, created_at
FROM provider_events
WHERE provider = %(provider)s
ORDER BY id DESC
LIMIT %(limit)s

-- ==== outbox.store.callbacks: the provider callbacks inbox (written by outbox_callbacks, applied by the consumer, read by operators)

-- name: report_agent_completed
-- What an agent says of an operation its login recorded (agent.completed), through the agent's write path (outbox_report_agent_completed in schema.sql): a report waiting to be chained, which locks no chain head.
SELECT outbox_report_agent_completed(%(operation_id)s, %(attributes)s) AS report_id

-- name: chain_agent_reports
-- Move up to this many committed agent reports into their operations' chains as agent.completed events (outbox_chain_agent_reports in schema.sql); how many.
SELECT outbox_chain_agent_reports(%(limit)s) AS chained

-- name: record_callback
-- Record one verified callback through the callbacks role's one write path (outbox_record_callback in schema.sql): recorded, duplicate (with whether the body was the same) or unmatched, and the operation it names.
SELECT callback_id, result, matched_operation_id AS operation_id, same_payload
FROM outbox_record_callback(%(provider)s, %(event_id)s, %(status)s, %(operation_id)s,
                            %(provider_reference)s, %(payload_digest)s)

-- name: claim_callback_batch
-- Lock callbacks not yet applied whose operation is not in flight and whose tool this consumer runs, with their operations (skipping rows another transaction holds: an operation being decided, or a callback being recorded), oldest first.
SELECT c.id, c.provider, c.event_id, c.status, c.named_operation_id, c.operation_id,
       c.provider_reference, c.payload_digest, c.received_at, c.outcome, c.applied_at
FROM callbacks c
JOIN operations o ON o.id = c.operation_id
WHERE c.applied_at IS NULL
  AND o.state <> 'in_flight'
  AND o.tool_name || '.v' || o.tool_version = ANY(%(tools)b::text[])
ORDER BY c.id
LIMIT %(limit)s
FOR NO KEY UPDATE OF c, o SKIP LOCKED

-- name: operation_callbacks
-- Every callback recorded for these operations, in the order they came: what the reconciler consults before it decides, and what `ops show` lists.
SELECT id, provider, event_id, status, named_operation_id, operation_id, provider_reference,
       payload_digest, received_at, outcome, applied_at
FROM callbacks
WHERE operation_id = ANY(%(ids)b::uuid[])
ORDER BY operation_id, id

-- name: apply_callback
-- Record what the consumer did with a callback (the trigger stamps applied_at, and refuses a second outcome).
UPDATE callbacks SET outcome = %(outcome)s
WHERE id = %(id)s AND outcome IS NULL
RETURNING id

-- name: lock_operation
-- Lock one operation's row until the transaction ends, and read it, for a decision that must see every callback committed before it (the next statement's snapshot). Waits for no callback being recorded (a callback's row references the operation, which locks its key only, not the row against this lock): one committed after this read is applied to what the decision writes, as a later one would be.
SELECT * FROM operations WHERE id = %(id)s FOR NO KEY UPDATE

-- name: list_callbacks
-- Callbacks for `outbox callbacks list`, newest first: all, or only those unmatched, not yet applied or contradicted, of one provider.
SELECT id, provider, event_id, status, named_operation_id, operation_id, provider_reference,
       payload_digest, received_at, outcome, applied_at
FROM callbacks
WHERE (%(outcome)s::text IS NULL OR outcome = %(outcome)s::text)
  AND (NOT %(pending)s::boolean OR applied_at IS NULL)
  AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
ORDER BY id DESC
LIMIT %(limit)s

-- ==== outbox.store.gauges: what waits to be executed, for the consumer's gauges

-- name: backend_activity
-- The liveness probe: this login's other backends, each one's state and how long it has been in it (a statement being worked on is active; one idle in its transaction for long waits for a client that went silent).
SELECT pid, coalesce(state, 'unknown') AS state,
       coalesce(extract(epoch FROM clock_timestamp() - state_change), 0)::float8 AS idle_for
FROM pg_stat_activity
WHERE usename = current_user AND pid <> pg_backend_pid()

-- name: lock_blockers
-- Whom a backend waits for, if it waits for a lock: each blocking session's pid and role, with its state and how long its transaction has been open where this login may read them (NULL otherwise), longest open first. Empty when it waits for nothing.
SELECT b.pid, b.usename AS role, b.state,
       floor(extract(epoch FROM clock_timestamp() - b.xact_start))::bigint AS seconds
FROM pg_stat_activity b
WHERE b.pid = ANY(pg_blocking_pids(%(pid)s))
ORDER BY b.xact_start NULLS LAST, b.pid
LIMIT 5

-- name: execution_gauges
-- The age of the oldest operation ready to execute (prepared, due, its message published, its latest event not an approval wait or denial) and how many wait for an approval.
SELECT
    COALESCE((
        SELECT EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)
        FROM operations o
        WHERE o.state = 'prepared'
          AND o.next_attempt_at <= clock_timestamp()
          -- Still to be published is the dispatcher's backlog, not the consumers'.
          AND NOT EXISTS (
              SELECT 1 FROM outbox b WHERE b.operation_id = o.id AND b.published_at IS NULL
          )
          AND NOT EXISTS (
              SELECT 1 FROM operation_events e
              WHERE e.id = (SELECT max(x.id) FROM operation_events x WHERE x.operation_id = o.id)
                AND e.name IN ('operation.approval_required', 'operation.approval_denied')
          )
        ORDER BY o.next_attempt_at
        LIMIT 1
    ), 0)::float8 AS oldest_ready_age_seconds,
    (
        SELECT count(*)
        FROM operations o
        WHERE o.state = 'prepared' AND o.requires_approval
          AND EXISTS (
              SELECT 1 FROM operation_events e
              WHERE e.id = (SELECT max(x.id) FROM operation_events x WHERE x.operation_id = o.id)
                AND e.name IN ('operation.approval_required', 'operation.approval_denied')
          )
    )::bigint AS awaiting_approval

-- ==== outbox.store.operator: `outbox ops`, `outbox approvals`, `outbox stats`

-- name: list_operation_summaries
-- Operations for `outbox ops list`, newest change first, filtered by state, tool and age; never the input.
SELECT id, run_id, tool_name, tool_version, side_effect, input_fingerprint, requires_approval,
       state, attempts, reconcile_attempts, provider_reference, last_error_class,
       created_at, updated_at
FROM operations
WHERE (%(states)b::text[] IS NULL OR state = ANY(%(states)b::text[]))
  AND (%(tool)s::text IS NULL OR tool_name = %(tool)s::text)
  AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s::timestamptz)
  AND (%(ago)s::interval IS NULL OR updated_at >= now() - %(ago)s::interval)
ORDER BY updated_at DESC, id
LIMIT %(limit)s

-- name: list_tool_operation_summaries
-- list_operation_summaries filtered by a tool (`outbox ops list --tool T`), read in branches as console_tool_operations_page is, so a tool with few operations costs what one with many does. Never the input.
WITH listed AS NOT MATERIALIZED (
    SELECT id, run_id, tool_name, tool_version, side_effect, input_fingerprint,
           requires_approval, state, attempts, reconcile_attempts, provider_reference,
           last_error_class, created_at, updated_at
    FROM operations
    WHERE tool_name = %(tool)s::text
      AND (%(states)b::text[] IS NULL OR state = ANY(%(states)b::text[]))
      AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s::timestamptz)
      AND (%(ago)s::interval IS NULL OR updated_at >= now() - %(ago)s::interval)
)
SELECT * FROM (
    (SELECT * FROM listed WHERE state = 'committed'
     ORDER BY updated_at DESC, id LIMIT %(committed_limit)s)
    UNION ALL
    (SELECT * FROM listed WHERE state = 'rejected'
     ORDER BY updated_at DESC, id LIMIT %(rejected_limit)s)
    UNION ALL
    (SELECT * FROM listed WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated')
     ORDER BY updated_at DESC, id LIMIT %(open_limit)s)
) AS listing
ORDER BY updated_at DESC, id
LIMIT %(limit)s

-- name: escalations_matching
-- Escalated operations whose latest escalation matches a filter (tool, reason, run, escalated-at range), oldest escalation first, at most `limit`: what `outbox ops resolve` over a filter and the console's batch preview select, each with its reason and time; beside them, how many match in all and the database's clock at the selection (one row even when none match). Never the input.
WITH matching AS (
    SELECT o.id, o.run_id, o.tool_name, o.tool_version, o.side_effect, o.input_fingerprint,
           o.requires_approval, o.state, o.attempts, o.reconcile_attempts,
           o.provider_reference, o.last_error_class, o.created_at, o.updated_at,
           last.reason, last.created_at AS escalated_at
    FROM operations o
    CROSS JOIN LATERAL (
        SELECT e.attributes->>'reason' AS reason, e.created_at
        FROM operation_events e
        WHERE e.operation_id = o.id AND e.name = 'operation.escalated'
        ORDER BY e.id DESC
        LIMIT 1
    ) AS last
    WHERE o.state = 'escalated'
      AND (%(tool)s::text IS NULL OR o.tool_name = %(tool)s::text)
      AND (%(run_id)s::text IS NULL OR o.run_id = %(run_id)s::text)
      AND (%(reason)s::text IS NULL OR last.reason = %(reason)s::text)
      AND (%(since)s::timestamptz IS NULL OR last.created_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR last.created_at < %(until)s::timestamptz)
      AND (%(since_ago)s::interval IS NULL
           OR last.created_at >= clock_timestamp() - %(since_ago)s::interval)
      AND (%(until_ago)s::interval IS NULL
           OR last.created_at < clock_timestamp() - %(until_ago)s::interval)
), chosen AS (
    SELECT * FROM matching ORDER BY escalated_at, id LIMIT %(limit)s
)
SELECT clock_timestamp() AS selected_at, (SELECT count(*) FROM matching)::bigint AS matched,
       c.*
FROM (SELECT 1) AS one
LEFT JOIN chosen c ON true
ORDER BY c.escalated_at, c.id

-- name: operation_ids_in_range
-- Up to two operation ids between two bounds, lowest first: the operations a short id (a uuid prefix) names; two mean it is ambiguous.
SELECT id
FROM operations
WHERE id BETWEEN %(lowest)s AND %(highest)s
ORDER BY id
LIMIT 2

-- name: list_approval_candidates
-- Prepared operations that need an approval, oldest first, each with the database's clock and its most recent approval decision as latest_approval reads it (and who decided), so that each is checked like the consumer checks it in one statement. Never the input.
SELECT o.id, o.run_id, o.tool_name, o.tool_version, o.side_effect, o.input_fingerprint,
       o.requires_approval, o.state, o.attempts, o.reconcile_attempts, o.provider_reference,
       o.last_error_class, o.created_at, o.updated_at, now() AS checked_at,
       a.id AS approval_id, a.intent_hash AS approval_intent_hash,
       a.decision AS approval_decision, a.expires_at AS approval_expires_at,
       a.created_at AS approval_created_at, a.approved_by AS approval_approved_by
FROM operations o
LEFT JOIN LATERAL (
    SELECT id, intent_hash, decision, expires_at, created_at, approved_by FROM approvals
    WHERE operation_id = o.id
    ORDER BY created_at DESC
    LIMIT 1
) a ON true
WHERE o.state = 'prepared' AND o.requires_approval
ORDER BY o.created_at, o.id

-- name: operations_analyzed_rows
-- How many rows operations holds as the statistics have them (the last ANALYZE's or VACUUM's figure; never analyzed counts as empty): a catalog read, which decides whether the outbox_operations gauge, `outbox stats` and the console's overview count every operation or estimate the settled ones.
SELECT greatest(c.reltuples, 0)::float8 AS analyzed_rows
FROM pg_class c
WHERE c.oid = 'operations'::regclass

-- name: count_operations_by_tool_and_state
-- How many operations each tool has in each state, exactly, for `outbox stats` and the console's overview while the table is small (operations_analyzed_rows): it reads every row (765.689 ms at 2,000,000 operations), so past that it is estimate_operations_by_tool_and_state.
SELECT tool_name, state, count(*)::bigint AS operations
FROM operations
GROUP BY tool_name, state
ORDER BY tool_name, state

-- name: transaction_without_jit
-- No JIT for the rest of this transaction (set_config's local form): for a statement the planner costs past jit_above_cost only because it cannot know how little of a large table it reads (estimate_operations_by_tool_and_state's TABLESAMPLE, whose percentage is a subquery), and which would then spend longer compiling than running (19.750 ms of JIT beside 31.2 ms of work at 10,000,000 operations).
SELECT set_config('jit', 'off', true) AS jit

-- name: estimate_operations_by_tool_and_state
-- How many operations each tool has in each state, for `outbox stats` and the console's overview on a large table, at a cost that does not grow with the history: the open states exactly, from the partial index that holds only them (operations_state_next_attempt); committed and rejected, which only grow, estimated (estimated true) from a sample of about sample_pages of the table's pages (TABLESAMPLE SYSTEM, REPEATABLE: the same pages from one refresh to the next while the table keeps its size), as each tool's share of the rows sampled times the table's rows now, as the planner reckons them (the rows per page the last ANALYZE saw times the pages the table has now). A tool whose settled operations are too few to be met in the sample has no settled row here.
WITH size AS (
    SELECT greatest(c.reltuples, 0) / greatest(c.relpages, 1) * p.pages AS rows, p.pages
    FROM pg_class c
    CROSS JOIN LATERAL (
        SELECT pg_relation_size(c.oid) / current_setting('block_size')::bigint AS pages
    ) p
    WHERE c.oid = 'operations'::regclass
), sampled AS (
    SELECT o.tool_name, o.state, count(*) AS operations, sum(count(*)) OVER () AS sample_rows
    FROM operations o TABLESAMPLE SYSTEM ((
        SELECT least(100, 100.0 * %(sample_pages)s / greatest(pages, 1)) FROM size
    )) REPEATABLE (0)
    GROUP BY o.tool_name, o.state
)
SELECT tool_name, state, count(*)::bigint AS operations, false AS estimated
FROM operations
WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated')
GROUP BY tool_name, state
UNION ALL
SELECT s.tool_name, s.state, round(s.operations * size.rows / s.sample_rows)::bigint, true
FROM sampled s CROSS JOIN size
WHERE s.state IN ('committed', 'rejected')
ORDER BY tool_name, state

-- name: record_discarded_dead_letter
-- Record one dead letter an operator is about to discard (its digest and size, never its body); the database stamps the login and the time.
INSERT INTO discarded_dead_letters (message_id, operation_ids, tools, body_sha256, body_bytes,
                                    death_reason, died_at, reason, discarded_by)
VALUES (%(message_id)s, %(operation_ids)b::uuid[], %(tools)b::text[], %(body_sha256)s,
        %(body_bytes)s, %(death_reason)s, %(died_at)s, %(reason)s, %(discarded_by)s)
RETURNING id, recorded_as, discarded_at

-- name: list_discarded_dead_letters
-- The record of discarded dead letters for `outbox dlq discarded`, newest first.
SELECT id, message_id, operation_ids, tools, body_sha256, body_bytes, death_reason, died_at,
       reason, discarded_by, recorded_as, discarded_at
FROM discarded_dead_letters
ORDER BY id DESC
LIMIT %(limit)s

-- ==== outbox.store.console: `outbox console`, the operator's web pages

-- name: console_operations_page
-- One page of operations, newest change first, strictly after a (updated_at, id) keyset cursor; filtered by state, tool, run and change time; never the input.
SELECT id, run_id, tool_name, tool_version, side_effect, input_fingerprint, requires_approval,
       state, attempts, reconcile_attempts, provider_reference, last_error_class,
       created_at, updated_at
FROM operations
WHERE (%(states)b::text[] IS NULL OR state = ANY(%(states)b::text[]))
  AND (%(tool)s::text IS NULL OR tool_name = %(tool)s::text)
  AND (%(run_id)s::text IS NULL OR run_id = %(run_id)s::text)
  AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR updated_at < %(until)s::timestamptz)
  AND (%(after_updated_at)s::timestamptz IS NULL
       OR (updated_at, id) < (%(after_updated_at)s::timestamptz, %(after_id)s::uuid))
ORDER BY updated_at DESC, id DESC
LIMIT %(limit)s

-- name: console_tool_operations_page
-- console_operations_page filtered by a tool (the store picks it when a tool is given): committed and rejected each newest first from operations_tool_settled, the open states from operations_state_next_attempt, each branch cut at its own limit (outbox.store.operator.tool_listing_limits: 0 for a state group the filter leaves out, and a LIMIT 0 never starts its plan), merged. A page then reads at most a page of entries from each, however few of the history's operations are the tool's; operations_updated read newest first kept the tool's rows, a scan of the table for a tool with none in the state asked for. Never the input.
WITH listed AS NOT MATERIALIZED (
    SELECT id, run_id, tool_name, tool_version, side_effect, input_fingerprint,
           requires_approval, state, attempts, reconcile_attempts, provider_reference,
           last_error_class, created_at, updated_at
    FROM operations
    WHERE tool_name = %(tool)s::text
      AND (%(states)b::text[] IS NULL OR state = ANY(%(states)b::text[]))
      AND (%(run_id)s::text IS NULL OR run_id = %(run_id)s::text)
      AND (%(since)s::timestamptz IS NULL OR updated_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR updated_at < %(until)s::timestamptz)
      AND (%(after_updated_at)s::timestamptz IS NULL
           OR (updated_at, id) < (%(after_updated_at)s::timestamptz, %(after_id)s::uuid))
)
SELECT * FROM (
    (SELECT * FROM listed WHERE state = 'committed'
     ORDER BY updated_at DESC, id DESC LIMIT %(committed_limit)s)
    UNION ALL
    (SELECT * FROM listed WHERE state = 'rejected'
     ORDER BY updated_at DESC, id DESC LIMIT %(rejected_limit)s)
    UNION ALL
    (SELECT * FROM listed WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated')
     ORDER BY updated_at DESC, id DESC LIMIT %(open_limit)s)
) AS page
ORDER BY updated_at DESC, id DESC
LIMIT %(limit)s

-- name: console_operation_approvals
-- Every grant and denial of one operation, newest first: who, when, until when, for which intent.
SELECT id, operation_id, intent_hash, decision, approved_by, expires_at, created_at
FROM approvals
WHERE operation_id = %(operation_id)s
ORDER BY created_at DESC, id

-- name: console_prepared_waits
-- What the prepared operations wait for, counted by the first that applies: a person's approval (it needs one and its latest decision is no valid grant of its intent, as approval_status rules), its provider (waiting_since), the dispatcher (an outbox row not yet published), the time of its next attempt (a backoff), else a consumer to claim it; with the oldest of each (by next_attempt_at) and how long it has been due, by the database's clock. Never the input.
WITH prepared AS (
    SELECT o.id, o.next_attempt_at,
           CASE
               WHEN o.requires_approval AND NOT COALESCE(
                   a.decision = 'granted' AND a.expires_at > now()
                   AND a.intent_hash = o.input_fingerprint, false) THEN 'approval'
               WHEN o.waiting_since IS NOT NULL THEN 'provider'
               WHEN EXISTS (
                   SELECT 1 FROM outbox b WHERE b.operation_id = o.id AND b.published_at IS NULL
               ) THEN 'unpublished'
               WHEN o.next_attempt_at > now() THEN 'scheduled'
               ELSE 'ready'
           END AS waits_for
    FROM operations o
    LEFT JOIN LATERAL (
        SELECT decision, expires_at, intent_hash FROM approvals
        WHERE operation_id = o.id
        ORDER BY created_at DESC
        LIMIT 1
    ) a ON o.requires_approval
    WHERE o.state = 'prepared'
), counted AS (
    SELECT waits_for, count(*) AS operations FROM prepared GROUP BY waits_for
), oldest AS (
    SELECT DISTINCT ON (waits_for) waits_for, id, next_attempt_at
    FROM prepared
    ORDER BY waits_for, next_attempt_at, id
)
SELECT c.waits_for, c.operations::bigint AS operations, o.id AS oldest_id,
       greatest(0, extract(epoch FROM now() - o.next_attempt_at))::float8 AS oldest_due_seconds
FROM counted c
JOIN oldest o USING (waits_for)
ORDER BY c.waits_for

-- ==== outbox.store.evidence: `outbox ops verify` and the console's check of an operation's evidence chain

-- name: verify_event_chains
-- Recompute the evidence chain of the operations whose ids lie in [first, last] (at most `limit` of them, in id order): per operation its event count and every broken link (event id or null, reason), hashed by outbox_event_hash as the insert trigger hashes; and whether the evidence supports the row: a birth event first, and the state the last transition event moved it to.
WITH page AS (
    -- Inclusive bounds are index conditions in any plan, also a generic one: one
    -- operation is [id, id], the next page of all of them starts past the last id seen.
    SELECT o.id, o.state
    FROM operations o
    WHERE o.id >= %(first)s::uuid AND o.id <= %(last)s::uuid
    ORDER BY o.id
    LIMIT %(limit)s
), chain AS (
    SELECT e.operation_id, e.id, e.seq, e.hash,
           row_number() OVER w AS position,
           e.hash IS DISTINCT FROM outbox_event_hash(e.operation_id, e.id, e.seq, e.name,
                                                     e.attributes, e.created_at, e.prev_hash)
               AS altered,
           CASE WHEN lag(e.id) OVER w IS NULL
                THEN e.prev_hash IS NOT NULL OR e.seq IS DISTINCT FROM 1
                ELSE e.prev_hash IS DISTINCT FROM lag(e.hash) OVER w
                     OR e.seq IS DISTINCT FROM lag(e.seq) OVER w + 1
           END AS unlinked,
           lead(e.id) OVER w IS NULL AS newest,
           e.name,
           -- The state an event says its operation entered: birth, a claim, or any
           -- runtime transition (each names its target in "to"); none for the rest.
           CASE WHEN e.name = 'operation.prepared' THEN 'prepared'
                WHEN e.name = 'operation.attempted' THEN 'in_flight'
                WHEN e.name LIKE 'operation.%%' AND jsonb_typeof(e.attributes -> 'to') = 'string'
                THEN e.attributes ->> 'to'
           END AS entered
    FROM page p
    JOIN operation_events e ON e.operation_id = p.id
    WINDOW w AS (PARTITION BY e.operation_id ORDER BY e.seq, e.id)
), links AS (
    SELECT operation_id, position, id AS event_id, 'hash_mismatch' AS reason
    FROM chain WHERE altered
    UNION ALL
    SELECT operation_id, position, id, 'prev_mismatch'
    FROM chain WHERE unlinked
    UNION ALL
    -- The head: more events counted than are left is a deleted tail; a head that
    -- names another last event, or none, was written around the chain trigger.
    SELECT p.id, NULL, CASE WHEN h.events > t.seq OR t.id IS NULL THEN NULL ELSE t.id END,
           CASE WHEN h.events > t.seq OR t.id IS NULL THEN 'missing_tail'
                ELSE 'anchor_mismatch' END
    FROM page p
    LEFT JOIN operation_event_heads h ON h.operation_id = p.id
    LEFT JOIN chain t ON t.operation_id = p.id AND t.newest
    WHERE (h.operation_id IS NOT NULL OR t.id IS NOT NULL)
      AND (h.operation_id IS NULL OR t.id IS NULL
           OR h.events IS DISTINCT FROM t.seq OR h.last_hash IS DISTINCT FROM t.hash)
    UNION ALL
    -- Every operation is born with its operation.prepared event, in the statement that
    -- records it: one whose first event is another, or that has none, was written
    -- around outbox_record_decision.
    SELECT p.id, 0, b.id, 'missing_birth'
    FROM page p
    LEFT JOIN chain b ON b.operation_id = p.id AND b.position = 1
    WHERE b.id IS NULL OR b.name <> 'operation.prepared'
    UNION ALL
    -- The row's state is the one its last transition event entered: a state no event
    -- supports (a committed row with no committed event) was written around the
    -- statements that move operations.
    SELECT p.id, l.position, l.id, 'state_mismatch'
    FROM page p
    JOIN LATERAL (
        SELECT c.id, c.position, c.entered FROM chain c
        WHERE c.operation_id = p.id AND c.entered IS NOT NULL
        ORDER BY c.position DESC
        LIMIT 1
    ) l ON true
    WHERE l.entered IS DISTINCT FROM p.state
), counted AS (
    SELECT operation_id, count(*) AS events FROM chain GROUP BY operation_id
), found AS (
    SELECT operation_id,
           jsonb_agg(jsonb_build_object('event_id', event_id, 'reason', reason)
                     ORDER BY position NULLS LAST, reason) AS broken
    FROM links
    GROUP BY operation_id
)
SELECT p.id AS operation_id, coalesce(c.events, 0) AS events,
       coalesce(f.broken, '[]'::jsonb) AS broken
FROM page p
LEFT JOIN counted c ON c.operation_id = p.id
LEFT JOIN found f ON f.operation_id = p.id
ORDER BY p.id

-- name: console_login
-- Who the console connects as: is that login a member of outbox_operator, and is it a superuser (which needs no grant at all)?
SELECT current_user AS login,
       (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser,
       -- pg_has_role() raises for a role that does not exist: roles.sql may not be applied.
       CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator')
            THEN pg_has_role(current_user, 'outbox_operator', 'MEMBER')
            ELSE false END AS operator

-- ==== outbox.store.history: `outbox history` (archive, export, status, drop) and the archived operations `ops show`, `ops list --archived`, `ops verify`, the console and a short id read

-- name: history_archive_batch
-- Move one batch of settled operations older than the hot window into history (outbox_history_archive in schema.sql, as the tables' owner); one checkpoint per day the batch touched, none when nothing was left to move.
SELECT settled_on, operations, events, digest
FROM outbox_history_archive(%(hot)s, %(batch)s)
ORDER BY settled_on

-- name: history_checkpoint_day
-- Record the checkpoint of one whole day of history as it is now (kind exported or dropped), and return it with its place in the checkpoint chain: the first line of an export, the last word on a dropped day.
SELECT id, seq, kind, settled_on, operations, events, digest, recorded_by, recorded_at,
       prev_hash, hash
FROM outbox_history_checkpoint(%(day)s, %(kind)s)

-- name: history_day_digest
-- What one day of history holds as this transaction sees it, as a checkpoint states it (outbox_history_day): an export compares its snapshot with the checkpoint it recorded just before.
SELECT operations, events, digest FROM outbox_history_day(%(day)s)

-- name: history_export_page
-- One page of a day of history in operation id order after a cursor, each row as the text Postgres gives its jsonb (numbers and strings exactly as stored): the lines of an export.
SELECT h.operation_id, to_jsonb(h)::text AS line
FROM history h
WHERE h.settled_on = %(day)s AND h.operation_id > %(after)s::uuid
ORDER BY h.operation_id
LIMIT %(limit)s

-- name: history_days
-- Every day history holds, with its partition, how many operations and events it has and whether a detach of it was left half done (DETACH ... CONCURRENTLY interrupted: `history drop` finishes it). A partition's name is history_pYYYYMMDD (outbox_history_partition). The counts are the sums of the day's archived checkpoints, read from history_checkpoints_day, not from the partition: a batch's rows and its checkpoint commit together and nothing but a drop of the whole day removes rows, so they agree, at the cost of one checkpoint row per archive batch and day instead of every row of history (counting each day read all of it, and its plan, a scan of every partition per day, was big enough to be compiled by JIT on every call: 6.4 s at 300,000 operations). A day with a dropped checkpoint that is still attached (its drop stopped after the checkpoint, or an operation settled that day was archived after the drop) says so in drop_recorded: its rows are counted by history_day_rows.
SELECT d.settled_on, c.relname::text AS partition, i.inhdetachpending AS detaching,
       EXISTS (SELECT 1 FROM history_checkpoints k
               WHERE k.settled_on = d.settled_on AND k.kind = 'dropped') AS drop_recorded,
       recorded.operations, recorded.events
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
CROSS JOIN LATERAL (SELECT to_date(substr(c.relname, 10), 'YYYYMMDD') AS settled_on) d
CROSS JOIN LATERAL (
    SELECT coalesce(sum(k.operations), 0) AS operations, coalesce(sum(k.events), 0) AS events
    FROM history_checkpoints k
    WHERE k.settled_on = d.settled_on AND k.kind = 'archived'
) recorded
WHERE i.inhparent = to_regclass('history') AND c.relname ~ '^history_p[0-9]{8}$'
ORDER BY c.relname

-- name: history_day_flat_digest
-- What one day of history holds, its digest as schema versions before 16 computed it (all its lines in one block): what an export of a day of more than 100,000 operations recorded then. `history verify --days` tries it when the day's digest disagrees with such a checkpoint.
SELECT operations, events, digest FROM outbox_history_day_blocks(%(day)s, 2147483647)

-- name: history_day_records
-- What the checkpoints record of each day (one with %(day)s, every one without): days whose partition is attached, and days an archive recorded whose drop was not recorded. Per day: whether its partition is attached, the sums of its archived checkpoints, whether a drop was recorded, its newest checkpoint (an export states the whole day as it should be now), and the exports whose counts are not what had been archived before them. `outbox history verify --days` compares them with the day's rows (history_day_digest).
WITH attached AS (
    SELECT to_date(substr(c.relname, 10), 'YYYYMMDD') AS settled_on
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = to_regclass('history') AND c.relname ~ '^history_p[0-9]{8}$'
), days AS (
    SELECT a.settled_on FROM attached a
    UNION
    SELECT k.settled_on FROM history_checkpoints k WHERE k.kind = 'archived'
)
SELECT d.settled_on,
       EXISTS (SELECT 1 FROM attached a WHERE a.settled_on = d.settled_on) AS attached,
       r.archived_operations, r.archived_events, r.archived_checkpoints, r.drop_recorded,
       n.id AS newest_id, n.kind AS newest_kind, n.digest AS newest_digest,
       x.exports_disagreeing
FROM days d
CROSS JOIN LATERAL (
    SELECT coalesce(sum(k.operations) FILTER (WHERE k.kind = 'archived'), 0) AS archived_operations,
           coalesce(sum(k.events) FILTER (WHERE k.kind = 'archived'), 0) AS archived_events,
           count(*) FILTER (WHERE k.kind = 'archived') AS archived_checkpoints,
           coalesce(bool_or(k.kind = 'dropped'), false) AS drop_recorded
    FROM history_checkpoints k
    WHERE k.settled_on = d.settled_on
) r
LEFT JOIN LATERAL (
    SELECT k.id, k.kind, k.digest
    FROM history_checkpoints k
    WHERE k.settled_on = d.settled_on
    ORDER BY k.seq DESC
    LIMIT 1
) n ON true
CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(e.id ORDER BY e.seq), '{}') AS exports_disagreeing
    FROM history_checkpoints e
    CROSS JOIN LATERAL (
        SELECT coalesce(sum(a.operations), 0) AS operations, coalesce(sum(a.events), 0) AS events
        FROM history_checkpoints a
        WHERE a.settled_on = e.settled_on AND a.kind = 'archived' AND a.seq < e.seq
    ) before
    WHERE e.settled_on = d.settled_on AND e.kind = 'exported'
      AND (e.operations <> before.operations OR e.events <> before.events)
) x
WHERE (%(day)s::date IS NULL OR d.settled_on = %(day)s::date)
  -- A day dropped as recorded holds nothing to compare.
  AND NOT (r.drop_recorded
           AND NOT EXISTS (SELECT 1 FROM attached a WHERE a.settled_on = d.settled_on))
ORDER BY d.settled_on

-- name: history_day_rows
-- How many operations and events one day of history holds, counted from its partition alone: for `history status` of a day whose archived checkpoints cannot say (history_days: drop_recorded).
SELECT count(*) AS operations, coalesce(sum(h.event_count), 0) AS events
FROM history h
WHERE h.settled_on = %(day)s

-- name: history_recent_checkpoints
-- The newest checkpoints, newest first: what left the hot tables, what was exported, what was dropped, by whom and when.
SELECT id, seq, kind, settled_on, operations, events, digest, recorded_by, recorded_at,
       encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
FROM history_checkpoints
ORDER BY seq DESC
LIMIT %(limit)s

-- name: history_checkpoint_of_export
-- The checkpoint row an export's first line names: by its id when the line carries one (exports since schema version 14), else the day's exported or dropped checkpoint with the line's digest, the oldest first.
SELECT id, seq, kind, settled_on, operations, events, digest, recorded_by, recorded_at,
       encode(prev_hash, 'hex') AS prev_hash, encode(hash, 'hex') AS hash
FROM history_checkpoints
WHERE id = %(id)s::bigint
   OR (%(id)s::bigint IS NULL AND settled_on = %(day)s::date AND digest = %(digest)s
       AND kind IN ('exported', 'dropped'))
ORDER BY id
LIMIT 1

-- name: verify_checkpoint_chain
-- Walk the chain of history checkpoints in seq order: how many there are, and every broken link (seq, checkpoint id or null, reason), each row hashed by outbox_checkpoint_hash as the insert trigger hashed it, and the last one compared with the head.
WITH chain AS (
    SELECT k.id, k.seq, k.hash,
           k.hash IS DISTINCT FROM outbox_checkpoint_hash(k.id, k.seq, k.kind, k.settled_on,
                                                          k.operations, k.events, k.digest,
                                                          k.recorded_by, k.recorded_at,
                                                          k.prev_hash) AS altered,
           CASE WHEN lag(k.id) OVER w IS NULL
                THEN k.prev_hash IS NOT NULL OR k.seq IS DISTINCT FROM 1
                ELSE k.prev_hash IS DISTINCT FROM lag(k.hash) OVER w
                     OR k.seq IS DISTINCT FROM lag(k.seq) OVER w + 1
           END AS unlinked,
           lead(k.id) OVER w IS NULL AS newest
    FROM history_checkpoints k
    WINDOW w AS (ORDER BY k.seq, k.id)
), links AS (
    SELECT seq, id, 'hash_mismatch' AS reason FROM chain WHERE altered
    UNION ALL
    SELECT seq, id, 'prev_mismatch' FROM chain WHERE unlinked
    UNION ALL
    -- The head: more checkpoints counted than are left is a deleted tail; a head that
    -- names another last checkpoint, or none at all, was written around the trigger.
    SELECT CASE WHEN h.checkpoints > coalesce(t.seq, 0) THEN h.checkpoints
                ELSE coalesce(t.seq, h.checkpoints, 0) END,
           CASE WHEN h.checkpoints > coalesce(t.seq, 0) THEN NULL ELSE t.id END,
           CASE WHEN h.checkpoints > coalesce(t.seq, 0) THEN 'missing_tail'
                ELSE 'anchor_mismatch' END
    FROM (SELECT 1) AS one
    LEFT JOIN history_checkpoint_head h ON h.singleton
    LEFT JOIN chain t ON t.newest
    WHERE h.singleton IS NULL
       OR h.checkpoints IS DISTINCT FROM coalesce(t.seq, 0)
       OR h.last_hash IS DISTINCT FROM t.hash
)
SELECT (SELECT count(*) FROM chain) AS checked,
       coalesce((SELECT jsonb_agg(jsonb_build_object('seq', l.seq, 'checkpoint_id', l.id,
                                                     'reason', l.reason)
                                  ORDER BY l.seq, l.reason)
                 FROM links l), '[]'::jsonb) AS broken

-- name: history_operation
-- One archived operation, found by id in each day's index, as the text Postgres gives its history row (the form an export line has): what `ops show` and `ops verify` read once the hot tables no longer hold it.
SELECT to_jsonb(h)::text AS line
FROM history h
WHERE h.operation_id = %(id)s

-- name: history_operation_facts
-- One archived operation without its events (a reader takes those a page at a time, history_events_page): the operation row as it was moved, its callbacks and approvals, when it settled and when it moved, and its chain head; found by id in each day's index.
SELECT h.operation_id, h.settled_on, h.settled_at, h.archived_at, h.operation, h.callbacks,
       h.approvals, h.event_count, h.last_hash
FROM history h
WHERE h.operation_id = %(id)s

-- name: history_events_page
-- list_events_page for an archived operation: at most `limit` of the events its history row holds after event `after`, oldest first, or (when not `forward`) the `limit` just before event `before`, and a count of the events on either side of the page, in one snapshot.
WITH events AS MATERIALIZED (
    SELECT (e->>'id')::bigint AS id, e->>'name' AS name, e->'attributes' AS attributes,
           (e->>'created_at')::timestamptz AS created_at
    FROM history h CROSS JOIN LATERAL jsonb_array_elements(h.events) AS e
    WHERE h.operation_id = %(operation_id)s
), page AS (
    (SELECT id, name, attributes, created_at FROM events
     WHERE %(forward)s::boolean AND id > %(after)s::bigint
     ORDER BY id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT id, name, attributes, created_at FROM events
     WHERE NOT %(forward)s::boolean AND id < %(before)s::bigint
     ORDER BY id DESC
     LIMIT %(limit)s)
), bounds AS MATERIALIZED (
    SELECT coalesce(min(id), CASE WHEN %(forward)s::boolean THEN %(after)s::bigint + 1
                                  ELSE %(before)s::bigint END) AS lo,
           coalesce(max(id), CASE WHEN %(forward)s::boolean THEN %(after)s::bigint
                                  ELSE %(before)s::bigint - 1 END) AS hi
    FROM page
), counts AS MATERIALIZED (
    SELECT b.lo, b.hi,
           (SELECT count(*) FROM events e WHERE e.id < b.lo) AS earlier,
           (SELECT count(*) FROM events e WHERE e.id > b.hi) AS later
    FROM bounds b
)
SELECT c.lo, c.hi, c.earlier, c.later,
       p.id, %(operation_id)s::uuid AS operation_id, p.name, p.attributes, p.created_at
FROM counts c
LEFT JOIN page p ON true
ORDER BY p.id

-- name: history_ids_in_range
-- Up to two archived operation ids between two bounds, lowest first: the operations a short id names in history (operation_ids_in_range is the hot tables'); one range scan of each day's primary key.
SELECT h.operation_id AS id
FROM history h
WHERE h.operation_id BETWEEN %(lowest)s AND %(highest)s
ORDER BY h.operation_id
LIMIT 2

-- name: history_states
-- The final state of each of these operations that history holds (the operations of dead letters the hot tables no longer have): a primary-key probe of each day per id.
SELECT h.operation_id, h.state
FROM history h
WHERE h.operation_id = ANY(%(ids)b::uuid[])

-- name: history_summaries
-- list_operation_summaries over history (`outbox ops list --archived`): archived operations settled newest first, filtered by state, tool and age, at most `limit`. Day by day from the newest (a top-N of one partition each; history has no index on the settled time), so a listing reads the few newest days it shows, not the whole history (executed in 4 to 8 ms where one sort of a history of 92,227 operations took 972 ms, docs/operating.md "History retention"). Never the input.
SELECT o.id, o.run_id, o.tool_name, o.tool_version, o.side_effect, o.input_fingerprint,
       o.requires_approval, o.state, o.attempts, o.reconcile_attempts, o.provider_reference,
       o.last_error_class, o.created_at, o.updated_at, p.archived_at
FROM (
    SELECT d.day, h.operation_id, h.settled_at, h.archived_at, h.operation
    FROM (
        -- The days history holds, newest first: the order the rows are wanted in, so
        -- the days are visited lazily and the limit stops the walk.
        SELECT to_date(substr(c.relname, 10), 'YYYYMMDD') AS day
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = to_regclass('history') AND c.relname ~ '^history_p[0-9]{8}$'
        ORDER BY 1 DESC
    ) d
    CROSS JOIN LATERAL (
        SELECT h.operation_id, h.settled_at, h.archived_at, h.operation
        FROM history h
        WHERE h.settled_on = d.day
          AND (%(states)b::text[] IS NULL OR h.state = ANY(%(states)b::text[]))
          AND (%(tool)s::text IS NULL OR h.operation->>'tool_name' = %(tool)s::text)
          AND (%(since)s::timestamptz IS NULL OR h.settled_at >= %(since)s::timestamptz)
          AND (%(ago)s::interval IS NULL OR h.settled_at >= now() - %(ago)s::interval)
        ORDER BY h.settled_at DESC, h.operation_id
        LIMIT %(limit)s
    ) h
    WHERE (%(since)s::timestamptz IS NULL
           OR d.day >= (%(since)s::timestamptz AT TIME ZONE 'UTC')::date)
      AND (%(ago)s::interval IS NULL
           OR d.day >= ((now() - %(ago)s::interval) AT TIME ZONE 'UTC')::date)
    ORDER BY d.day DESC, h.settled_at DESC, h.operation_id
    LIMIT %(limit)s
) p
CROSS JOIN LATERAL jsonb_populate_record(NULL::operations, p.operation - 'input') AS o
ORDER BY p.day DESC, p.settled_at DESC, p.operation_id

-- name: history_rotate_keys
-- Forget the older generation of archived decision keys once every key in it is older than the retention, and make it the current one (outbox_history_rotate_keys, the owner's alone); whether it did.
SELECT outbox_history_rotate_keys(%(retention)s) AS rotated

-- ==== outbox.schema: migrations and database administration (the DDL itself is schema.sql and roles.sql)

-- name: take_migration_lock
-- Queue behind any other migration of this database until this transaction ends (outbox.schema passes the shared key).
SELECT pg_advisory_xact_lock(%(key)s)

-- name: current_schema
-- The schema this connection creates objects in: the first of its search_path that exists (NULL when none does).
SELECT current_schema() AS schema

-- name: schema_creators
-- Roles other than the schema's owner, its members and superusers that may still create objects in the schema this connection migrates (held by name or through a group).
SELECT r.rolname AS role
FROM pg_roles r, pg_namespace n
WHERE n.oid = current_schema()::regnamespace
  AND NOT r.rolsuper
  AND NOT pg_has_role(r.oid, n.nspowner, 'MEMBER')
  AND has_schema_privilege(r.oid, n.oid, 'CREATE')
ORDER BY r.rolname

-- name: has_schema_digest_table
-- Whether the table of the applied schema.sql's digest exists (version 10 and later).
SELECT to_regclass('outbox_schema_applied') IS NOT NULL AS present

-- name: applied_schema_digest
-- The SHA-256 of schema.sql as it was last applied to this schema, if recorded.
SELECT digest FROM outbox_schema_applied

-- name: record_schema_digest
-- Remember the SHA-256 of the schema.sql just applied, so that applying it again can take nothing.
INSERT INTO outbox_schema_applied (digest) VALUES (%(digest)s)
ON CONFLICT (singleton) DO UPDATE SET digest = EXCLUDED.digest, applied_at = clock_timestamp()

-- name: set_lock_timeout
-- How long each statement of this transaction waits for a lock before it gives up (SQLSTATE 55P03).
SELECT set_config('lock_timeout', %(lock_timeout)s, true)

-- name: schema_lock_holders
-- Other sessions holding a lock on a table of this schema, longest transaction first: who a migration waited for.
SELECT DISTINCT a.pid, a.usename AS role, a.state,
       floor(extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.backend_start)))::bigint AS seconds
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
JOIN pg_class c ON c.oid = l.relation
WHERE l.granted AND l.locktype = 'relation'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND c.relnamespace = current_schema()::regnamespace
  AND a.pid <> pg_backend_pid()
ORDER BY seconds DESC, a.pid
LIMIT 5

-- name: has_schema_version_table
-- Whether the schema's version table exists; asks the catalog, so it works on an empty database.
SELECT to_regclass('outbox_schema_version') IS NOT NULL AS present

-- name: schema_version
-- The highest applied schema version (NULL when the table is empty).
SELECT max(version) AS version FROM outbox_schema_version

-- name: schema_is_current
-- Whether this library's schema is applied: the newest tables and functions (version 5's evidence chain, version 6's bounds, version 7's callbacks inbox, version 9's provider breaker, version 10's search_path without the schema on it and agent reports, version 11's callbacks chained at application, version 12's record of discarded dead letters, version 13's history, version 14's chained checkpoints, version 15's archive batch bounded by its locks, version 16's day digest in blocks, version 17's key rows of typed columns, version 18's operation bounds in its guards, version 19's events checked for their operation by the chain) and columns (version 4's effect_possible, version 9's waiting_since) it needs exist. Catalog only, so any role may ask. The column is sought on any table of the schema, as the table and the function are: this asks whether the migrations ran, and an operations table gone missing since is a failure of its own (SchemaMissing, per statement).
SELECT to_regclass('operation_event_heads') IS NOT NULL
       AND to_regproc('outbox_chain_event') IS NOT NULL
       AND to_regproc('outbox_guard_approval') IS NOT NULL
       AND to_regclass('callbacks') IS NOT NULL
       AND to_regproc('outbox_record_callback') IS NOT NULL
       AND to_regclass('provider_health') IS NOT NULL
       AND to_regclass('provider_calls') IS NOT NULL
       AND to_regproc('outbox_chain_agent_reports') IS NOT NULL
       AND to_regproc('outbox_chain_callback') IS NOT NULL
       AND to_regclass('discarded_dead_letters') IS NOT NULL
       AND to_regproc('outbox_history_archive') IS NOT NULL
       AND to_regclass('history_checkpoint_head') IS NOT NULL
       AND to_regproc('outbox_chain_checkpoint') IS NOT NULL
       AND to_regproc('outbox_history_quiet') IS NOT NULL
       AND to_regproc('outbox_history_day_blocks') IS NOT NULL
       AND to_regproc('outbox_operation_state_refused') IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_constraint k
                       WHERE k.conname = 'operation_events_operation_id_fkey'
                         AND k.connamespace = current_schema()::regnamespace)
       -- Two of this name (one per key generation): to_regproc answers NULL for either.
       AND EXISTS (SELECT 1 FROM pg_proc p
                   WHERE p.proname = 'outbox_history_key_operation'
                     AND p.pronamespace = current_schema()::regnamespace)
       AND (SELECT 'search_path=pg_catalog, pg_temp' = ANY(p.proconfig)
            FROM pg_proc p WHERE p.oid = to_regproc('outbox_record_decision'))
       AND (SELECT count(DISTINCT a.attname) = 2
            FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
            WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'
              -- Version 17's key rows keep an operation's effect_possible of their own.
              AND c.relname NOT IN ('history_keys_0', 'history_keys_1')
              AND a.attname IN ('effect_possible', 'waiting_since')
              AND NOT a.attisdropped) AS is_current

-- name: database_exists
-- Whether a database of this name exists on the server.
SELECT 1 FROM pg_database WHERE datname = %(name)s

-- ==== harness/diagnostics.py: only the chaos harness runs these (it is not in the wheel)

-- name: terminate_backends
-- End every session of these applications in this database except the caller's own; how many ended.
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS ended
FROM pg_stat_activity
WHERE datname = current_database() AND application_name = ANY(%(application_names)b::text[])
  AND pid <> pg_backend_pid()

-- name: session_snapshot
-- Every other session in this database: who, in what state, how long in its transaction, what it waits for, and the head of its statement (never its parameters).
SELECT pid, application_name, state,
       round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1) AS in_transaction_s,
       wait_event_type, wait_event,
       left(regexp_replace(query, '\s+', ' ', 'g'), 160) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
ORDER BY xact_start NULLS LAST
