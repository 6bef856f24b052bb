-- effect-outbox: least privilege in Postgres (docs/design.md section 7).
--
-- Applied by `outbox migrate --roles`, after schema.sql, in the same transaction and
-- under the same advisory lock. Idempotent: applying it again changes nothing.
--
-- Five NOLOGIN group roles, one per component. Grant one to each login role a
-- component connects as (`GRANT outbox_agent TO refund_agent_service;`). Each group
-- gets exactly what the statements in outbox/sql/queries.sql that its component runs
-- need, and nothing more:
--
--   outbox_agent       record_decision: insert_decision (EXECUTE on outbox_record_decision,
--                      its only write path), report_agent_completed (EXECUTE on
--                      outbox_report_agent_completed), get_operation_by_decision_key,
--                      fingerprint_key; await_outcome: listen_operation_changes,
--                      operation_outcomes, archived_outcomes (an operation moved to
--                      history); check_approval: latest_approval
--   outbox_dispatcher  claim_outbox_batch, mark_outbox_published, mark_outbox_failed,
--                      outbox_backlog, operations_by_state, delete_published_outbox_rows,
--                      listen_outbox_pending
--   outbox_consumer    get_operation, get_operations, latest_approval, insert_event,
--                      claim_deliveries, claim_operations, commit_operations,
--                      transition_operation, requeue_stale_prepared,
--                      claim_reconciliation_batch, lease_for_reconciliation,
--                      defer_reconciliation, escalate_undeliverable,
--                      reject_denied_operations, fingerprint_key, execution_gauges,
--                      chain_agent_reports (EXECUTE on outbox_chain_agent_reports)
--   outbox_operator    the `outbox ops` and `outbox approvals` commands and `outbox
--                      console` (console_operations_page, console_operation_approvals,
--                      console_login): reads, plus transition_operation (resolve) and
--                      insert_approval;
--                      verify_event_chains (`outbox ops verify`) reads the chain heads;
--                      operation_callbacks (`ops show`), list_callbacks (`outbox
--                      callbacks list`), operation_ids_in_range (a short id such as
--                      `op_74ca7733` in `ops show`), list_approval_candidates
--                      (`approvals pending`, with each one's latest decision);
--                      `outbox history` archive, export, status and verify (EXECUTE
--                      on outbox_history_archive and outbox_history_checkpoint, SELECT
--                      on history, history_checkpoints and history_checkpoint_head)
--   outbox_callbacks   `outbox callbacks` and record_callback(): record_callback
--                      (EXECUTE on outbox_record_callback, its only write path and
--                      its only privilege), schema_is_current (the catalog)
--
-- The consumer also applies provider callbacks: claim_callback_batch,
-- operation_callbacks, apply_callback, lock_operation.
--
-- Not granted, because nothing needs it:
-- - USAGE on the identity sequences of outbox and operation_events: an identity
--   column draws its value without a sequence privilege check.
-- - REFERENCES or SELECT for the foreign keys: Postgres checks them as the table owner.
-- - EXECUTE on the trigger functions: triggers fire without an EXECUTE check, and
--   pg_notify() is executable by PUBLIC.
-- - UPDATE or DELETE on operation_events, to anyone: it is append-only evidence (its
--   trigger refuses too; the grants say it first).
-- - Any write on operation_event_heads, to anyone: the chain trigger keeps it, as the
--   owner (SECURITY DEFINER), so appending an event needs nothing more than today.
--
-- The consumer needs UPDATE on operations to move operations through execution, so a
-- grant cannot stop it from touching an escalated one; the transition trigger in
-- schema.sql does: once outbox_operator exists, only its members (and superusers) may
-- change an escalated operation.
--
-- Creating the roles needs CREATEROLE (or a superuser) the first time; later runs only
-- grant, which the tables' owner may do.

-- Roles are cluster-wide, so a migration of another database of this cluster may be
-- creating the same role at the same moment (the advisory lock is per database): the
-- loser of that race sees the winner's role and carries on.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['outbox_agent', 'outbox_dispatcher', 'outbox_consumer',
                                     'outbox_operator', 'outbox_callbacks']
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END;
$$;

-- Tables are only reachable through their schema. PUBLIC usually has USAGE on it, but
-- a hardened cluster may have revoked that; say what the roles need instead of relying
-- on it. current_schema() is where schema.sql created the tables.
DO $$
BEGIN
    EXECUTE format(
        'GRANT USAGE ON SCHEMA %I TO outbox_agent, outbox_dispatcher, outbox_consumer, '
        'outbox_operator, outbox_callbacks',
        current_schema()
    );
END;
$$;

-- Nobody but the schema's owner creates objects in it. A role that may could define an
-- operator or a function that fits an expression better than the built-in one; the
-- functions of schema.sql never look one up here (their search_path holds pg_catalog
-- alone), and this takes away what PostgreSQL 14 and older grant every role in public.
-- A role that still holds CREATE by name is one outbox migrate --roles names and stops
-- for (outbox/migrate.py), unless told to go on.
DO $$
BEGIN
    EXECUTE format(
        'REVOKE CREATE ON SCHEMA %I FROM PUBLIC, outbox_agent, outbox_dispatcher, '
        'outbox_consumer, outbox_operator, outbox_callbacks',
        current_schema()
    );
END;
$$;

-- Start from nothing on every outbox table, then grant: an older roles.sql's wider
-- grant does not survive a migration, and PUBLIC (every role, present and future)
-- holds nothing. One transaction, so no session ever sees the gap.
REVOKE ALL ON operations, outbox, operation_events, approvals, outbox_schema_version,
    outbox_schema_applied, outbox_deployment, operation_event_heads, operation_status,
    callbacks, provider_health, provider_events, provider_calls, agent_reports,
    discarded_dead_letters, history, history_checkpoints, history_keys_0, history_keys_1,
    history_key_generations, history_checkpoint_head
    FROM PUBLIC, outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator,
         outbox_callbacks;
-- Column grants survive a table-level REVOKE only if named: drop every column grant
-- of an older roles.sql (and of this one), so what follows is all that is held.
DO $$
DECLARE
    held record;
BEGIN
    FOR held IN
        SELECT DISTINCT c.relname, a.attname, g.rolname, p.privilege_type
        FROM pg_class c
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        CROSS JOIN LATERAL aclexplode(a.attacl) p
        JOIN pg_roles g ON g.oid = p.grantee
        WHERE c.relnamespace = current_schema()::regnamespace
          AND c.relname IN ('operations', 'outbox', 'operation_events', 'approvals',
                            'callbacks', 'history')
          AND g.rolname IN ('outbox_agent', 'outbox_dispatcher', 'outbox_consumer',
                            'outbox_operator', 'outbox_callbacks')
    LOOP
        EXECUTE format('REVOKE %s (%I) ON %I FROM %I', held.privilege_type, held.attname,
                       held.relname, held.rolname);
    END LOOP;
END;
$$;
-- A new function is executable by PUBLIC; this one writes decisions, so only the agent.
REVOKE ALL ON FUNCTION outbox_record_decision(uuid, text, text, text, integer, text, jsonb,
    text, boolean, jsonb, integer) FROM PUBLIC, outbox_dispatcher, outbox_consumer, outbox_operator,
    outbox_callbacks;
-- And this one records provider callbacks, so only the callbacks role.
REVOKE ALL ON FUNCTION outbox_record_callback(text, text, text, uuid, text, text)
    FROM PUBLIC, outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator;
-- The agent reports through this one; the consumer's reconciler chains what it wrote.
REVOKE ALL ON FUNCTION outbox_report_agent_completed(uuid, jsonb)
    FROM PUBLIC, outbox_dispatcher, outbox_consumer, outbox_operator, outbox_callbacks;
REVOKE ALL ON FUNCTION outbox_chain_agent_reports(integer)
    FROM PUBLIC, outbox_agent, outbox_dispatcher, outbox_operator, outbox_callbacks;
-- History retention (schema.sql version 13): the move into history is the operators'
-- (and the owner's); a checkpoint of a day, for an export, too. Forgetting decision keys
-- and creating partitions are the owner's alone, and dropping a day needs ownership of
-- history, which no group holds: no agent, dispatcher, consumer or callbacks login can
-- move, detach or drop anything of it.
REVOKE ALL ON FUNCTION outbox_history_archive(interval, integer), outbox_history_checkpoint(date, text),
    outbox_history_rotate_keys(interval), outbox_history_partition(date), outbox_history_moving()
    FROM PUBLIC, outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator, outbox_callbacks;

-- No temporary tables for anyone by default in this database: a temporary table is
-- searched before any schema for a relation, and so is the one object every login can
-- make that could stand in for a catalog or an outbox table in a function that forgot
-- to pin its search_path (schema.sql pins every one; this is the second lock). A login
-- of the application that needs temporary tables gets TEMPORARY by name. The owner of
-- the database (or a superuser) may revoke it; anyone else is warned, not stopped.
DO $$
BEGIN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
END;
$$;

-- The agent service records decisions through outbox_record_decision (SECURITY
-- DEFINER: a prepared operation, its outbox row and its operation.prepared event, and
-- nothing else) and reads them back; it holds no INSERT on operations or outbox, so it
-- cannot write an operation any other way. It appends to no chain (below). No UPDATE or
-- DELETE anywhere: an agent can decide, never execute, settle or erase.
GRANT EXECUTE ON FUNCTION outbox_record_decision(uuid, text, text, text, integer, text, jsonb,
    text, boolean, jsonb, integer) TO outbox_agent;
-- What await_outcome and record_decision read back, through the operation_status view
-- (schema.sql): where each operation stands and what it recorded, never the input
-- (another run's tool input is not the agent's to read; its own it already holds). Of
-- the table itself only what check_approval compares: the id and the fingerprint.
GRANT SELECT ON operation_status TO outbox_agent;
GRANT SELECT (id, input_fingerprint) ON operations TO outbox_agent;
-- await_outcome of an operation that moved to history (history retention, schema.sql
-- version 13), after record_decision answered a retried key with it or a wait began
-- late: the outcome as the archived key keeps it, the operation row without its input
-- (what operation_status shows of a hot one, and what outbox_record_decision already
-- hands the agent for a retried key), and of history only what maps an id to its key.
-- Not history's operation (its input), events, callbacks or approvals (who decided):
-- those are the operators'.
GRANT SELECT ON history_keys_0, history_keys_1 TO outbox_agent;
GRANT SELECT (operation_id, run_id, decision_key) ON history TO outbox_agent;
-- What the agent says of an operation its login recorded (agent.completed) goes through
-- outbox_report_agent_completed, never into operation_events: an append there locks the
-- operation's chain head until the agent's transaction ends, and the agent's
-- transaction is the agent's. The consumer's reconciler chains the reports.
GRANT EXECUTE ON FUNCTION outbox_report_agent_completed(uuid, jsonb) TO outbox_agent;
-- await_outcome tells "waiting for a person's approval" from "running" by the latest
-- approval decision, and check_approval reports whether a grant lets the effect run.
-- Not who decided: a person's name is the operators' to read. Reading only: a grant is
-- a person's act, on the operator path.
GRANT SELECT (id, operation_id, intent_hash, decision, expires_at, created_at) ON approvals
    TO outbox_agent;
-- The key of the short fingerprints its events and log lines show (fingerprint_key);
-- an operator may read it to match a log line to an operation.
GRANT SELECT ON outbox_deployment TO outbox_agent, outbox_consumer, outbox_operator;

-- The dispatcher publishes outbox rows. claim_outbox_batch joins operations for the
-- message envelope (and operations_by_state feeds a gauge): those columns only, never
-- the tool input. Its FOR UPDATE on outbox needs UPDATE; marking rows needs UPDATE;
-- retention needs DELETE.
GRANT SELECT (id, state, tool_name, tool_version, input_fingerprint) ON operations
    TO outbox_dispatcher;
-- It marks rows published or failed, and rewrites nothing a message is made of: not
-- the routing key, the headers or the operation a row belongs to.
GRANT SELECT, DELETE ON outbox TO outbox_dispatcher;
GRANT UPDATE (published_at, publish_attempts, last_error, available_at) ON outbox
    TO outbox_dispatcher;

-- The consumer moves operations through execution: claim, transition, reconcile (the
-- FOR UPDATE of claim_reconciliation_batch and requeue_stale_prepared needs UPDATE
-- too). requeue_stale_prepared reads outbox and operation_events and inserts with
-- RETURNING; transitions append events and queue retries; the approval check reads
-- approvals. It never writes approvals and never deletes anything.
-- Column grants: it moves an operation, never rewrites what was decided (the intent
-- columns, which a trigger freezes as well) or when; it queues a row for an operation,
-- never chooses the row's headers, publication or birth time; it appends an event,
-- never chooses its id, chain link or time.
GRANT SELECT ON operations TO outbox_consumer;
GRANT UPDATE (state, attempts, reconcile_attempts, lease_token, lease_owner, lease_expires_at,
              next_attempt_at, first_attempt_at, provider_reference, result, last_error_class,
              effect_possible, waiting_since) ON operations TO outbox_consumer;
GRANT SELECT ON outbox TO outbox_consumer;
GRANT INSERT (operation_id, routing_key, available_at) ON outbox TO outbox_consumer;
GRANT SELECT ON operation_events TO outbox_consumer;
GRANT INSERT (operation_id, name, attributes) ON operation_events TO outbox_consumer;
-- The reconciler moves the agents' reports into their chains (as the owner: the words
-- are the agent's, and the consumer chooses none of them).
GRANT EXECUTE ON FUNCTION outbox_chain_agent_reports(integer) TO outbox_consumer;
GRANT SELECT ON approvals TO outbox_consumer;
-- The provider breaker (outbox/breaker.py): the consumer keeps its row (creating it at
-- a provider's first failure, locking it to decide) and appends its outages; it never
-- rewrites or deletes an outage's event. Operators read both (`outbox providers`).
GRANT SELECT, INSERT (provider), UPDATE ON provider_health TO outbox_consumer;
GRANT INSERT (provider, name, attributes) ON provider_events TO outbox_consumer;
-- The calls out to a provider with a declared limit on calls at once: taken and given
-- back by the consumer, nobody else.
GRANT SELECT, INSERT, DELETE ON provider_calls TO outbox_consumer;
GRANT UPDATE (expires_at) ON provider_calls TO outbox_consumer;
GRANT SELECT ON provider_calls TO outbox_operator;
GRANT SELECT ON provider_health, provider_events TO outbox_operator;

-- A person at the `outbox ops` / `outbox approvals` commands: reads everything,
-- resolves (UPDATE operations, its event, a retry's outbox row) and records grants
-- and denials (insert_approval ... RETURNING *).
-- The same column grants as the consumer's, and an approval's own columns: its time is
-- the database's (a trigger sets it, and appends the decision's event).
GRANT SELECT ON operations TO outbox_operator;
GRANT UPDATE (state, attempts, reconcile_attempts, lease_token, lease_owner, lease_expires_at,
              next_attempt_at, first_attempt_at, provider_reference, result, last_error_class,
              effect_possible, waiting_since) ON operations TO outbox_operator;
GRANT SELECT ON outbox TO outbox_operator;
GRANT INSERT (operation_id, routing_key, available_at) ON outbox TO outbox_operator;
GRANT SELECT ON operation_events TO outbox_operator;
GRANT INSERT (operation_id, name, attributes) ON operation_events TO outbox_operator;
GRANT SELECT ON approvals TO outbox_operator;
GRANT INSERT (id, operation_id, intent_hash, decision, approved_by, expires_at) ON approvals
    TO outbox_operator;
GRANT SELECT ON outbox_schema_version TO outbox_operator;
-- `outbox ops verify` compares each chain with its head: reading only.
GRANT SELECT ON operation_event_heads TO outbox_operator;
-- `outbox history archive` moves settled operations into history (as the owner, through
-- the function); `history status`, `history export`, `ops show` and `ops verify` read it.
GRANT EXECUTE ON FUNCTION outbox_history_archive(interval, integer),
    outbox_history_checkpoint(date, text) TO outbox_operator;
GRANT SELECT ON history, history_checkpoints, history_keys_0, history_keys_1,
    history_key_generations TO outbox_operator;
-- `outbox history verify` and `ops verify --archive` walk the checkpoint chain to its
-- head (version 14); only the chain trigger writes either.
GRANT SELECT ON history_checkpoint_head TO outbox_operator;

-- The consumer applies provider callbacks (docs/design.md section 5, "Callbacks"): it reads
-- the inbox (and locks the rows it applies: FOR UPDATE needs UPDATE) and writes one
-- column, what it did with a callback; a trigger stamps the time and freezes the rest.
GRANT SELECT ON callbacks TO outbox_consumer;
GRANT UPDATE (outcome) ON callbacks TO outbox_consumer;
-- Operators read the inbox: `outbox callbacks list`, `ops show`, the console.
GRANT SELECT ON callbacks TO outbox_operator;

-- A person discarding dead letters (`outbox dlq discard`, the console) records each one
-- first: what it was (digest, size, envelope), why and by whom. Appended, never
-- changed; the login and the time are the database's. Operators read the record
-- (`outbox dlq discarded`).
GRANT SELECT ON discarded_dead_letters TO outbox_operator;
GRANT INSERT (message_id, operation_ids, tools, body_sha256, body_bytes, death_reason, died_at,
              reason, discarded_by) ON discarded_dead_letters TO outbox_operator;

-- The callbacks receiver (`outbox callbacks`, or record_callback() in a web app of the
-- user's) records verified callbacks through outbox_record_callback (SECURITY DEFINER:
-- an inbox row and, for an operation it finds, that operation's callback_received event)
-- and holds nothing else: it reads no table, so it learns nothing of operations but
-- whether the one a callback names exists, and writes nothing any other way. It is as
-- trusted as the signatures it checks; what its callbacks can do is the contracts' to
-- say, and the consumer's to apply.
GRANT EXECUTE ON FUNCTION outbox_record_callback(text, text, text, uuid, text, text)
    TO outbox_callbacks;
