-- effect-outbox: the one DDL.
--
-- Applied by `outbox migrate` and by the test suite, always inside one transaction
-- that first takes an advisory lock, so concurrent migrations queue up. Every
-- statement is idempotent: applying this file twice changes nothing.

CREATE TABLE IF NOT EXISTS outbox_schema_version (
    version     integer PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per agent decision: the business operation whose effect we own.
CREATE TABLE IF NOT EXISTS operations (
    id                  uuid PRIMARY KEY,
    run_id              text NOT NULL CHECK (length(run_id) BETWEEN 1 AND 200),
    decision_key        text CHECK (decision_key IS NULL OR length(decision_key) BETWEEN 1 AND 200),
    tool_name           text NOT NULL CHECK (tool_name ~ '^[a-z][a-z0-9_.-]{0,63}$'),
    tool_version        integer NOT NULL CHECK (tool_version >= 1),
    side_effect         text NOT NULL CHECK (side_effect IN
                            ('read_only', 'idempotent_write', 'deduplicated_write', 'non_repeatable_write')),
    input               jsonb NOT NULL,
    input_fingerprint   text NOT NULL CHECK (input_fingerprint ~ '^[0-9a-f]{64}$'),
    requires_approval   boolean NOT NULL DEFAULT false,
    state               text NOT NULL DEFAULT 'prepared' CHECK (state IN
                            ('prepared', 'in_flight', 'committed', 'rejected', 'outcome_unknown', 'escalated')),
    attempts            integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    reconcile_attempts  integer NOT NULL DEFAULT 0 CHECK (reconcile_attempts >= 0),
    -- Fencing token: bumped by every claim; every later write names the token it holds.
    lease_token         bigint NOT NULL DEFAULT 0,
    lease_owner         text,
    lease_expires_at    timestamptz,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    first_attempt_at    timestamptz,
    provider_reference  text,
    result              jsonb,
    last_error_class    text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT operations_run_decision_key UNIQUE (run_id, decision_key),
    -- A worker talking to the provider always holds a lease; a reconciler may hold one
    -- on an unknown outcome; settled and waiting operations hold none.
    CONSTRAINT operations_lease_consistent CHECK (
        (lease_owner IS NULL) = (lease_expires_at IS NULL)
        AND (state <> 'in_flight' OR lease_expires_at IS NOT NULL)
        AND (state IN ('in_flight', 'outcome_unknown') OR lease_expires_at IS NULL)
    )
);

-- Version 4: whether the effect may have happened. Set by every move to outcome_unknown
-- (transition_operation), cleared only by a lookup that proved the effect absent, never
-- by anything else: once an attempt's outcome was unknown, later attempts that provably
-- never left do not make the operation "not done" (consumer/policy.py after_attempt).
-- The consumer holds UPDATE on operations and so could clear it by hand; like state,
-- the column is trusted to the consumer's code, not to a grant.
ALTER TABLE operations ADD COLUMN IF NOT EXISTS effect_possible boolean NOT NULL DEFAULT false;

CREATE INDEX IF NOT EXISTS operations_state_next_attempt
    ON operations (state, next_attempt_at)
    WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated');
CREATE INDEX IF NOT EXISTS operations_run ON operations (run_id);

-- One row per message to publish. Claimed by state (published_at IS NULL), never by
-- a high-water mark on id: ids are assigned before commit, not in commit order.
CREATE TABLE IF NOT EXISTS outbox (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id      uuid NOT NULL REFERENCES operations (id),
    routing_key       text NOT NULL,
    headers           jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Statement time, not transaction start: the dispatcher's latency metric starts here.
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at      timestamptz NOT NULL DEFAULT now(),
    published_at      timestamptz,
    publish_attempts  integer NOT NULL DEFAULT 0 CHECK (publish_attempts >= 0),
    last_error        text
);

CREATE INDEX IF NOT EXISTS outbox_pending
    ON outbox (id) INCLUDE (available_at) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_published
    ON outbox (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS outbox_operation ON outbox (operation_id);

-- Published rows are deleted in batches; keep autovacuum close behind them.
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);

-- Append-only lifecycle evidence. Attributes never hold tool inputs or user text.
CREATE TABLE IF NOT EXISTS operation_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id  uuid NOT NULL REFERENCES operations (id),
    name          text NOT NULL CHECK (name ~ '^[a-z_]+\.[a-z_]+$'),
    attributes    jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX IF NOT EXISTS operation_events_operation ON operation_events (operation_id, id);

-- A grant binds one operation and the exact intent (fingerprint) a person approved.
CREATE TABLE IF NOT EXISTS approvals (
    id            uuid PRIMARY KEY,
    operation_id  uuid NOT NULL REFERENCES operations (id),
    intent_hash   text NOT NULL CHECK (intent_hash ~ '^[0-9a-f]{64}$'),
    decision      text NOT NULL DEFAULT 'granted' CHECK (decision IN ('granted', 'denied')),
    approved_by   text NOT NULL CHECK (length(approved_by) BETWEEN 1 AND 200),
    expires_at    timestamptz NOT NULL,
    -- clock_timestamp, not now(): two grants in one transaction still order.
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX IF NOT EXISTS approvals_operation ON approvals (operation_id, created_at DESC);

-- The state machine of docs/design.md section 5, enforced by the database itself so that
-- no code path (a bug, a manual UPDATE) can move an operation along an illegal edge.
CREATE OR REPLACE FUNCTION outbox_guard_transition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT (
        (OLD.state, NEW.state) IN (
            ('prepared', 'in_flight'),
            ('prepared', 'escalated'),
            ('prepared', 'rejected'),
            ('in_flight', 'committed'),
            ('in_flight', 'rejected'),
            ('in_flight', 'prepared'),
            ('in_flight', 'outcome_unknown'),
            ('outcome_unknown', 'committed'),
            ('outcome_unknown', 'prepared'),
            ('outcome_unknown', 'escalated'),
            ('escalated', 'committed'),
            ('escalated', 'rejected'),
            ('escalated', 'prepared')
        )
    ) THEN
        RAISE EXCEPTION 'illegal operation transition % -> %', OLD.state, NEW.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_legal_transition';
    END IF;
    -- The recorded intent is what a person approves and what the consumer executes:
    -- nobody, whatever their grants, may change it after the decision was recorded.
    IF (NEW.id, NEW.run_id, NEW.decision_key, NEW.tool_name, NEW.tool_version,
        NEW.side_effect, NEW.input, NEW.input_fingerprint, NEW.requires_approval,
        NEW.created_at)
       IS DISTINCT FROM
       (OLD.id, OLD.run_id, OLD.decision_key, OLD.tool_name, OLD.tool_version,
        OLD.side_effect, OLD.input, OLD.input_fingerprint, OLD.requires_approval,
        OLD.created_at) THEN
        RAISE EXCEPTION 'operation %: its recorded intent (input, fingerprint, tool, side effect, approval requirement) cannot change', OLD.id
            USING ERRCODE = 'insufficient_privilege', CONSTRAINT = 'operations_intent_frozen';
    END IF;
    IF OLD.state IN ('committed', 'rejected') THEN
        RAISE EXCEPTION 'operation % is terminal (%)', OLD.id, OLD.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_terminal';
    END IF;
    -- Nobody but an operator resolves an escalation. The consumer holds UPDATE on
    -- operations for its own transitions, so no grant can stop it here; this does, once
    -- roles.sql has created outbox_operator (before that, there are no roles to tell
    -- apart). Nested IFs: pg_has_role() raises for a role that does not exist, and SQL
    -- does not promise to evaluate AND left to right. Superusers are members of every
    -- role. current_user, not session_user: a SET ROLE to outbox_operator is what
    -- acting as an operator means.
    IF OLD.state = 'escalated' THEN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator') THEN
            IF NOT pg_has_role(current_user, 'outbox_operator', 'MEMBER') THEN
                RAISE EXCEPTION 'operation % is escalated: only a member of outbox_operator may resolve it, and % is not', OLD.id, current_user
                    USING ERRCODE = 'insufficient_privilege',
                          CONSTRAINT = 'operations_escalation_operator_only',
                          HINT = 'resolve it with `outbox ops resolve`, connected as an operator';
            END IF;
        END IF;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS operations_guard_transition ON operations;
CREATE TRIGGER operations_guard_transition
    BEFORE UPDATE ON operations
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_transition();

-- Every operation is born prepared, untouched: no attempt, no lease, no outcome. A role
-- that may insert operations can therefore never insert one that looks executed.
CREATE OR REPLACE FUNCTION outbox_guard_birth() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state <> 'prepared' OR NEW.attempts <> 0 OR NEW.reconcile_attempts <> 0
       OR NEW.lease_token <> 0 OR NEW.lease_owner IS NOT NULL
       OR NEW.lease_expires_at IS NOT NULL OR NEW.first_attempt_at IS NOT NULL
       OR NEW.provider_reference IS NOT NULL OR NEW.result IS NOT NULL
       OR NEW.last_error_class IS NOT NULL OR NEW.effect_possible THEN
        RAISE EXCEPTION 'a new operation must be prepared, with no attempt, lease or outcome'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_born_prepared';
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS operations_guard_birth ON operations;
CREATE TRIGGER operations_guard_birth
    BEFORE INSERT ON operations
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_birth();

-- Which events each component may append, once roles.sql has created the groups: the
-- agent only agent.completed (operation.prepared comes from outbox_record_decision
-- below); the consumer neither what records a decision nor what only a person does;
-- operators (and the tables' owner, and superusers) anything. A role in no group may
-- append nothing. Nested IFs for the reason given in outbox_guard_transition.
CREATE OR REPLACE FUNCTION outbox_guard_event_names() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    owner oid;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        RETURN NEW;
    END IF;
    SELECT relowner INTO owner FROM pg_class WHERE oid = TG_RELID;
    IF pg_has_role(current_user, owner, 'MEMBER')
       OR pg_has_role(current_user, 'outbox_operator', 'MEMBER') THEN
        RETURN NEW;
    END IF;
    IF pg_has_role(current_user, 'outbox_consumer', 'MEMBER') THEN
        IF NEW.name NOT IN ('operation.prepared', 'operation.resolved',
                            'operation.approval_granted', 'operation.approval_denied',
                            'operation.cancelled', 'agent.completed') THEN
            RETURN NEW;
        END IF;
    ELSIF pg_has_role(current_user, 'outbox_agent', 'MEMBER') THEN
        IF NEW.name = 'agent.completed' THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'role % may not append % events', current_user, NEW.name
        USING ERRCODE = 'insufficient_privilege', CONSTRAINT = 'operation_events_by_role';
END;
$$;

DROP TRIGGER IF EXISTS operation_events_by_role ON operation_events;
CREATE TRIGGER operation_events_by_role
    BEFORE INSERT ON operation_events
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_event_names();

CREATE OR REPLACE FUNCTION outbox_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'operation_events is append-only'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS operation_events_append_only ON operation_events;
CREATE TRIGGER operation_events_append_only
    BEFORE UPDATE OR DELETE ON operation_events
    FOR EACH ROW EXECUTE FUNCTION outbox_events_append_only();

-- Wake the dispatchers. A notification sent while nobody listens is lost, which is
-- why dispatchers LISTEN before their first scan and keep a polling fallback.
CREATE OR REPLACE FUNCTION outbox_notify_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_pending', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_notify_pending ON outbox;
CREATE TRIGGER outbox_notify_pending
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_pending();

-- Wake the agents that await an outcome (outbox/awaiting.py). Every change an agent
-- can see (a transition, an approval asked for, granted or denied) appends an event in
-- the same statement. The events of a decision's birth and of each claim change nothing
-- an agent acts on (it reads both as pending) and are most of the traffic, so they
-- notify nobody: the NOTIFY is kept off the agent's record transaction and off the
-- consumer's claim. The empty payload lets Postgres fold a transaction's notifications
-- into one. Waiters poll as well: a notification nobody listened for is lost.
CREATE OR REPLACE FUNCTION outbox_notify_operation_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_operation_changed', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS operation_events_notify_changed ON operation_events;
CREATE TRIGGER operation_events_notify_changed
    AFTER INSERT ON operation_events
    FOR EACH ROW
    WHEN (NEW.name NOT IN ('operation.prepared', 'operation.attempted', 'agent.completed'))
    EXECUTE FUNCTION outbox_notify_operation_changed();

-- The per-deployment key of the short fingerprints that logs, events and spans show
-- (outbox/fingerprint_key.py): created once, at random, by the first migration.
-- gen_random_uuid() draws from the server's strong random source.
CREATE TABLE IF NOT EXISTS outbox_deployment (
    singleton        boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    fingerprint_key  text NOT NULL CHECK (length(fingerprint_key) >= 32)
);
INSERT INTO outbox_deployment (fingerprint_key)
SELECT encode(sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')), 'hex')
ON CONFLICT (singleton) DO NOTHING;

-- The agent's one write path (roles.sql grants outbox_agent EXECUTE on it and no INSERT
-- on operations or outbox): a prepared operation, its outbox row and its
-- operation.prepared event, in one statement; no row back when (run_id, decision_key)
-- is taken. It runs as the tables' owner with a search_path pinned to this schema, so
-- a caller's objects cannot stand in for the tables. What it cannot check (that the
-- fingerprint and the approval flag match the input) the consumer recomputes before
-- any effect.
DO $$
BEGIN
    EXECUTE format($definition$
        CREATE OR REPLACE FUNCTION outbox_record_decision(
            p_id uuid, p_run_id text, p_decision_key text, p_tool_name text,
            p_tool_version integer, p_side_effect text, p_input jsonb,
            p_input_fingerprint text, p_requires_approval boolean, p_headers jsonb,
            p_event_attributes jsonb
        ) RETURNS SETOF operations
        LANGUAGE sql SECURITY DEFINER SET search_path = %I, pg_temp AS $body$
            WITH operation AS (
                INSERT INTO operations (id, run_id, decision_key, tool_name, tool_version,
                                        side_effect, input, input_fingerprint,
                                        requires_approval)
                VALUES (p_id, p_run_id, p_decision_key, p_tool_name, p_tool_version,
                        p_side_effect, p_input, p_input_fingerprint, p_requires_approval)
                ON CONFLICT (run_id, decision_key) DO NOTHING
                RETURNING *
            ), queued AS (
                INSERT INTO outbox (operation_id, routing_key, headers)
                SELECT id, tool_name || '.v' || tool_version, p_headers FROM operation
            ), event AS (
                INSERT INTO operation_events (operation_id, name, attributes)
                SELECT id, 'operation.prepared', p_event_attributes FROM operation
            )
            SELECT * FROM operation
        $body$
    $definition$, current_schema());
END;
$$;

INSERT INTO outbox_schema_version (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (2) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (3) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (4) ON CONFLICT (version) DO NOTHING;
