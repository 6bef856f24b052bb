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

-- The state machine of DESIGN.md section 5, enforced by the database itself so that
-- no code path (a bug, a manual UPDATE) can move an operation along an illegal edge.
CREATE OR REPLACE FUNCTION outbox_guard_transition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT (
        (OLD.state, NEW.state) IN (
            ('prepared', 'in_flight'),
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

INSERT INTO outbox_schema_version (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
