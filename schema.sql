-- effect-outbox: the one DDL.
--
-- Applied by `outbox migrate` and by the test suite, always inside one transaction
-- that first takes an advisory lock, so concurrent migrations queue up. Every
-- statement is idempotent: applying this file twice changes nothing. Not for psql:
-- outbox/schema.py puts the schema's name where this file writes @schema@.

CREATE TABLE IF NOT EXISTS outbox_schema_version (
    version     integer PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- Version 10: the SHA-256 of the text of this file as it was last applied (with the
-- schema's name in it). outbox migrate reads it first and, when it is this file's and
-- the schema is current, applies nothing: a re-run takes no lock on any table, where
-- the ALTER TABLEs below would each wait for ACCESS EXCLUSIVE behind any open
-- transaction and every later reader and writer would queue behind them.
CREATE TABLE IF NOT EXISTS outbox_schema_applied (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    digest      text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One row per agent decision: the business operation whose effect we own. The bounds of
-- its values are checked by its two guards, not by CHECK constraints (version 18, at the
-- end of the guards below): outbox_guard_birth bounds the recorded intent at the insert,
-- and outbox_guard_transition, which also freezes that intent, bounds what moves.
CREATE TABLE IF NOT EXISTS operations (
    id                  uuid PRIMARY KEY,
    run_id              text NOT NULL,
    decision_key        text,
    tool_name           text NOT NULL,
    tool_version        integer NOT NULL,
    side_effect         text NOT NULL,
    input               jsonb NOT NULL,
    input_fingerprint   text NOT NULL,
    requires_approval   boolean NOT NULL DEFAULT false,
    state               text NOT NULL DEFAULT 'prepared',
    attempts            integer NOT NULL DEFAULT 0,
    reconcile_attempts  integer NOT NULL DEFAULT 0,
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
    CONSTRAINT operations_run_decision_key UNIQUE (run_id, decision_key)
);

-- Version 4: whether the effect may have happened. Set by every move to outcome_unknown
-- (transition_operation), cleared only by a lookup that proved the effect absent, never
-- by anything else: once an attempt's outcome was unknown, later attempts that provably
-- never left do not make the operation "not done" (consumer/policy.py after_attempt).
-- The consumer holds UPDATE on operations and so could clear it by hand; like state,
-- the column is trusted to the consumer's code, not to a grant.
ALTER TABLE operations ADD COLUMN IF NOT EXISTS effect_possible boolean NOT NULL DEFAULT false;

-- Version 9: since when the operation has been waiting for its provider (a call or a
-- lookup that could not reach it, or a breaker that holds its calls back). Waiting
-- spends no attempt and no lookup; the contract's outage_tolerance, counted from here,
-- is what hands it to a person. Cleared by any answer the provider gives.
ALTER TABLE operations ADD COLUMN IF NOT EXISTS waiting_since timestamptz;
-- Version 10: the login that recorded the decision (outbox_record_decision writes its
-- session_user). An agent reports only on the operations its own login recorded. No
-- default: adding the column rewrites nothing.
ALTER TABLE operations ADD COLUMN IF NOT EXISTS recorded_by name;
CREATE INDEX IF NOT EXISTS operations_waiting
    ON operations (tool_name) WHERE waiting_since IS NOT NULL;

CREATE INDEX IF NOT EXISTS operations_state_next_attempt
    ON operations (state, next_attempt_at)
    WHERE state IN ('prepared', 'in_flight', 'outcome_unknown', 'escalated');
-- Version 8: no index on run_id alone. The unique (run_id, decision_key) index has the
-- same leading column and serves every query that filters by run (the console's run
-- filter, the agent's lookup by decision key); a second index only cost every insert
-- and every non-HOT update of an operation one more entry.
DROP INDEX IF EXISTS operations_run;
-- The console's keyset pages (console_operations_page): newest change first, strictly
-- after a (updated_at, id) cursor, read from this index instead of sorting the table
-- for every page. Only an index: no version row, a database without it is as correct.
CREATE INDEX IF NOT EXISTS operations_updated ON operations (updated_at, id);
-- The same lists filtered by a tool (the console's /operations?tool=T, where each cell
-- of the overview's table links, and `outbox ops list --tool T`): each settled state
-- newest first, a page at most, however few of the history's operations are the tool's
-- (without it, a tool with none in a state is a scan of the table). The open states are
-- operations_state_next_attempt's. Settled states only: one entry an operation, written
-- when it settles, where an index over every state takes one at its birth and at every
-- move (no update of an operation is HOT: each sets updated_at). Only an index, as above.
CREATE INDEX IF NOT EXISTS operations_tool_settled
    ON operations (tool_name, state, updated_at, id)
    WHERE state IN ('committed', 'rejected');

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
-- operation_id names an operation that exists: the chain trigger checks it (version 19,
-- below), where a foreign key used to.
CREATE TABLE IF NOT EXISTS operation_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id  uuid NOT NULL,
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

-- Version 6: every value a role can write is bounded here exactly as outbox/bounds.py
-- bounds it in Python (a unit test compares the numbers), and every function below runs
-- with a pinned search_path: a caller's temporary objects (pg_temp comes first for
-- relations) can stand in for nothing. These two helpers have SQL-standard bodies,
-- parsed and bound once, here, whatever the caller's search_path.
--
-- Whether containers nest more than 64 levels deep (the value itself being level 1): a
-- container at path level 64 sits 65 deep. jsonpath's .** walks the value in C.
CREATE OR REPLACE FUNCTION outbox_json_too_deep(p_value jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN jsonb_path_exists(
    p_value, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")'
);

-- The marker a stored value no reader should parse is replaced by (outbox/bounds.py
-- unreadable()): why, and how many bytes the value had.
CREATE OR REPLACE FUNCTION outbox_unreadable(p_reason text, p_bytes integer) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN jsonb_build_object(
    'outbox.unreadable', jsonb_build_object('reason', p_reason, 'bytes', p_bytes)
);

-- Whether a value is not what an agent may say (agent.completed's attributes, and a
-- report that waits to become one): a JSON object within 4096 bytes (jsonb text) and 64
-- levels, every key agent.<name>. The one statement of the rule: the events' trigger,
-- the agent's report function and the reports' table all ask it.
CREATE OR REPLACE FUNCTION outbox_agent_words_refused(p_value jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN jsonb_typeof(p_value) IS DISTINCT FROM 'object' THEN true
    ELSE octet_length(p_value::text) > 4096
         OR outbox_json_too_deep(p_value)
         OR EXISTS (SELECT 1 FROM jsonb_object_keys(p_value) AS k (key)
                    WHERE k.key !~ '^agent\.[a-z][a-z0-9_]{0,63}$')
END;

-- A timestamp a role may write: finite, and one Python can hold (year 1 to 9999) with
-- room to spare; none of the runtime's waits is longer than 30 days.
--
-- VOLATILE, as clock_timestamp() is: Postgres inlines a SQL function into its caller's
-- expression only when the function is declared no less volatile than its body, and
-- declared STABLE this one ran the SQL-function executor on every call instead (the
-- outbox and operations guards call it on each row they check; docs/benchmarks.md,
-- "2026-12-03: the outbox row's guard", has what that cost a decision).
CREATE OR REPLACE FUNCTION outbox_plausible_time(p_value timestamptz) RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN p_value IS NULL OR (
    p_value >= '2000-01-01 00:00:00+00'::timestamptz
    AND p_value <= clock_timestamp() + interval '30 days'
);

-- Version 18: an operation's bounds, which were CHECK constraints until version 17. Postgres
-- reads a table's CHECK expressions back from the catalog and prepares them again for
-- every statement that writes the table, however few rows it writes; the operations
-- table had ten, and the claim and the outcome each paid for all ten (six of them on
-- columns no update may change) in every statement: about 40 µs of a one-row UPDATE's
-- 140 (docs/benchmarks.md, "what the database's guards cost"). The guards below run the
-- same conditions from plans each session prepares once. Each answers the name of the
-- constraint a row breaks, NULL if none (a NULL value passes, as it did a CHECK), and
-- the guards raise it as Postgres raised a CHECK's: check_violation, the same name.
CREATE OR REPLACE FUNCTION outbox_operation_intent_refused(
    p_run_id text, p_decision_key text, p_tool_name text, p_tool_version integer,
    p_side_effect text, p_input_fingerprint text
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN NOT (length(p_run_id) BETWEEN 1 AND 200) THEN 'operations_run_id_check'
    WHEN NOT (p_decision_key IS NULL OR length(p_decision_key) BETWEEN 1 AND 200)
        THEN 'operations_decision_key_check'
    WHEN NOT (p_tool_name ~ '^[a-z][a-z0-9_.-]{0,63}$') THEN 'operations_tool_name_check'
    WHEN NOT (p_tool_version >= 1) THEN 'operations_tool_version_check'
    WHEN NOT (p_side_effect IN ('read_only', 'idempotent_write', 'deduplicated_write',
                                'non_repeatable_write'))
        THEN 'operations_side_effect_check'
    WHEN NOT (p_input_fingerprint ~ '^[0-9a-f]{64}$') THEN 'operations_input_fingerprint_check'
END;

-- A worker talking to the provider always holds a lease; a reconciler may hold one on an
-- unknown outcome; settled and waiting operations hold none (operations_lease_consistent).
CREATE OR REPLACE FUNCTION outbox_operation_state_refused(
    p_state text, p_attempts integer, p_reconcile_attempts integer, p_lease_owner text,
    p_lease_expires_at timestamptz
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN NOT (p_state IN ('prepared', 'in_flight', 'committed', 'rejected',
                          'outcome_unknown', 'escalated'))
        THEN 'operations_state_check'
    WHEN NOT (p_attempts >= 0) THEN 'operations_attempts_check'
    WHEN NOT (p_reconcile_attempts >= 0) THEN 'operations_reconcile_attempts_check'
    WHEN NOT ((p_lease_owner IS NULL) = (p_lease_expires_at IS NULL)
              AND (p_state <> 'in_flight' OR p_lease_expires_at IS NOT NULL)
              AND (p_state IN ('in_flight', 'outcome_unknown') OR p_lease_expires_at IS NULL))
        THEN 'operations_lease_consistent'
END;

-- The state machine of docs/design.md section 5, enforced by the database itself so that
-- no code path (a bug, a manual UPDATE) can move an operation along an illegal edge.
CREATE OR REPLACE FUNCTION outbox_guard_transition() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    refused text;
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
        NEW.created_at, NEW.recorded_by)
       IS DISTINCT FROM
       (OLD.id, OLD.run_id, OLD.decision_key, OLD.tool_name, OLD.tool_version,
        OLD.side_effect, OLD.input, OLD.input_fingerprint, OLD.requires_approval,
        OLD.created_at, OLD.recorded_by) THEN
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
    -- What the daemons and operators write as an operation moves: each value only when it
    -- changes, so a row written before these bounds can still be moved and resolved.
    IF NEW.result IS DISTINCT FROM OLD.result AND NEW.result IS NOT NULL THEN
        -- A provider's result is replaced, never refused: the effect it reports happened,
        -- and refusing the write would lose the record of it.
        IF jsonb_typeof(NEW.result) <> 'object' THEN
            NEW.result := @schema@.outbox_unreadable('not_an_object', octet_length(NEW.result::text));
        ELSIF octet_length(NEW.result::text) > 65536 THEN
            NEW.result := @schema@.outbox_unreadable('too_large', octet_length(NEW.result::text));
        ELSIF @schema@.outbox_json_too_deep(NEW.result) THEN
            NEW.result := @schema@.outbox_unreadable('too_deep', octet_length(NEW.result::text));
        END IF;
    END IF;
    IF (NEW.provider_reference IS DISTINCT FROM OLD.provider_reference
            AND length(NEW.provider_reference) > 500)
       OR (NEW.lease_owner IS DISTINCT FROM OLD.lease_owner AND length(NEW.lease_owner) > 200)
       OR (NEW.last_error_class IS DISTINCT FROM OLD.last_error_class
           AND NEW.last_error_class !~ '^[a-z0-9][a-z0-9_.-]{0,63}$')
       OR (NEW.lease_expires_at IS DISTINCT FROM OLD.lease_expires_at
           AND NOT @schema@.outbox_plausible_time(NEW.lease_expires_at))
       OR (NEW.next_attempt_at IS DISTINCT FROM OLD.next_attempt_at
           AND NOT @schema@.outbox_plausible_time(NEW.next_attempt_at))
       OR (NEW.first_attempt_at IS DISTINCT FROM OLD.first_attempt_at
           AND NOT @schema@.outbox_plausible_time(NEW.first_attempt_at))
       OR (NEW.waiting_since IS DISTINCT FROM OLD.waiting_since
           AND NOT @schema@.outbox_plausible_time(NEW.waiting_since)) THEN
        RAISE EXCEPTION 'operation %: a reference, lease owner, error class or time outside its bounds', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_values_bounded';
    END IF;
    -- Last, where the CHECK constraints were evaluated (after every BEFORE trigger), so a
    -- row refused for a reason above still says that reason: what may move stays within
    -- its bounds; the intent, frozen above, kept the bounds its insert was held to.
    refused := @schema@.outbox_operation_state_refused(
        NEW.state, NEW.attempts, NEW.reconcile_attempts, NEW.lease_owner, NEW.lease_expires_at);
    IF refused IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "operations" violates check constraint "%"', refused
            USING ERRCODE = 'check_violation', CONSTRAINT = refused;
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
DECLARE
    refused text;
BEGIN
    IF NEW.state <> 'prepared' OR NEW.attempts <> 0 OR NEW.reconcile_attempts <> 0
       OR NEW.lease_token <> 0 OR NEW.lease_owner IS NOT NULL
       OR NEW.lease_expires_at IS NOT NULL OR NEW.first_attempt_at IS NOT NULL
       OR NEW.provider_reference IS NOT NULL OR NEW.result IS NOT NULL
       OR NEW.last_error_class IS NOT NULL OR NEW.effect_possible
       OR NEW.waiting_since IS NOT NULL THEN
        RAISE EXCEPTION 'a new operation must be prepared, with no attempt, lease or outcome'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_born_prepared';
    END IF;
    -- The input is what the consumer parses and a person reads: a JSON object within the
    -- depth Python refuses beyond, and within the database's own size ceiling (the
    -- consumer refuses anything larger than record_decision would have accepted).
    IF jsonb_typeof(NEW.input) IS DISTINCT FROM 'object'
       OR octet_length(NEW.input::text) > 1048576
       OR @schema@.outbox_json_too_deep(NEW.input) THEN
        RAISE EXCEPTION 'a tool input must be a JSON object of at most 1048576 bytes (jsonb text) nested at most 64 deep'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_input_bounded';
    END IF;
    -- Prepared, with no attempt or lease (above), the row is within the bounds of what
    -- moves; the intent's own are checked here, once, since no update may change it.
    refused := @schema@.outbox_operation_intent_refused(
        NEW.run_id, NEW.decision_key, NEW.tool_name, NEW.tool_version, NEW.side_effect,
        NEW.input_fingerprint);
    IF refused IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "operations" violates check constraint "%"', refused
            USING ERRCODE = 'check_violation', CONSTRAINT = refused;
    END IF;
    -- The database's clock, never the writer's.
    NEW.created_at := now();
    NEW.updated_at := now();
    NEW.next_attempt_at := now();
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS operations_guard_birth ON operations;
CREATE TRIGGER operations_guard_birth
    BEFORE INSERT ON operations
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_birth();

-- Version 18: the CHECK constraints a database created before it holds, now checked by
-- the two guards above (which are in place by this point of the migration's transaction).
ALTER TABLE operations
    DROP CONSTRAINT IF EXISTS operations_run_id_check,
    DROP CONSTRAINT IF EXISTS operations_decision_key_check,
    DROP CONSTRAINT IF EXISTS operations_tool_name_check,
    DROP CONSTRAINT IF EXISTS operations_tool_version_check,
    DROP CONSTRAINT IF EXISTS operations_side_effect_check,
    DROP CONSTRAINT IF EXISTS operations_input_fingerprint_check,
    DROP CONSTRAINT IF EXISTS operations_state_check,
    DROP CONSTRAINT IF EXISTS operations_attempts_check,
    DROP CONSTRAINT IF EXISTS operations_reconcile_attempts_check,
    DROP CONSTRAINT IF EXISTS operations_lease_consistent;

-- Which events each component may append, once roles.sql has created the groups: the
-- agent only agent.completed (operation.prepared comes from outbox_record_decision
-- below); the consumer neither what records a decision nor what only a person does,
-- nor a provider's callback (outbox_record_callback writes that one, as the owner);
-- operators (and the tables' owner, and superusers) anything. A role in no group may
-- append nothing. Nested IFs for the reason given in outbox_guard_transition.
--
-- Whoever appends, the attributes are a JSON object of at most 65536 bytes (jsonb text)
-- nested at most 64 deep: every reader of the timeline parses them. An agent.completed
-- event carries the agent's own words, so they stay in the agent's namespace (every key
-- agent.<name>) and small, and every view shows them as the agent's, never as the
-- runtime's.
--
-- Version 8: once per statement, over the rows it appended (a transition table), not
-- once per row: the consumer appends a burst's events in one statement, and the role
-- is the statement's, the same for every row. The check runs after the rows are
-- written and chained; a refusal raises, and the statement, its heads included, is
-- undone with it.
CREATE OR REPLACE FUNCTION outbox_guard_event_names() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    owner oid;
    refused text;
BEGIN
    IF EXISTS (SELECT 1 FROM appended a
               WHERE jsonb_typeof(a.attributes) IS DISTINCT FROM 'object'
                  OR octet_length(a.attributes::text) > 65536
                  OR @schema@.outbox_json_too_deep(a.attributes)) THEN
        RAISE EXCEPTION 'event attributes must be a JSON object of at most 65536 bytes (jsonb text) nested at most 64 deep'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operation_events_attributes_bounded';
    END IF;
    IF EXISTS (SELECT 1 FROM appended a
               WHERE a.name = 'agent.completed'
                 AND @schema@.outbox_agent_words_refused(a.attributes)) THEN
        RAISE EXCEPTION 'agent.completed attributes are the agent''s own: keys agent.<name>, at most 4096 bytes'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operation_events_agent_namespace';
    END IF;
    -- to_regrole, not a read of the pg_roles view: a sixth of the decision's statement.
    IF to_regrole('outbox_operator') IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT relowner INTO owner FROM pg_class WHERE oid = TG_RELID;
    IF pg_has_role(current_user, owner, 'MEMBER')
       OR pg_has_role(current_user, 'outbox_operator', 'MEMBER') THEN
        RETURN NULL;
    END IF;
    IF pg_has_role(current_user, 'outbox_consumer', 'MEMBER') THEN
        SELECT a.name INTO refused FROM appended a
        WHERE a.name IN ('operation.prepared', 'operation.resolved',
                         'operation.approval_granted', 'operation.approval_denied',
                         'operation.cancelled', 'agent.completed',
                         'operation.callback_received')
        LIMIT 1;
    ELSIF pg_has_role(current_user, 'outbox_agent', 'MEMBER') THEN
        SELECT a.name INTO refused FROM appended a WHERE a.name <> 'agent.completed' LIMIT 1;
    ELSE
        SELECT a.name INTO refused FROM appended a LIMIT 1;
    END IF;
    IF refused IS NOT NULL THEN
        RAISE EXCEPTION 'role % may not append % events', current_user, refused
            USING ERRCODE = 'insufficient_privilege', CONSTRAINT = 'operation_events_by_role';
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS operation_events_by_role ON operation_events;
CREATE TRIGGER operation_events_by_role
    AFTER INSERT ON operation_events
    REFERENCING NEW TABLE AS appended
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_guard_event_names();

-- Version 13: the one exception is the history move (outbox_history_archive, below),
-- which deletes an archived operation's events in the transaction that copied them into
-- history. It says so with a transaction-local setting, and runs as the tables' owner:
-- any login can set the setting, but only the owner (who may switch this trigger off
-- anyway) is let through by it, and no component login is the owner.
CREATE OR REPLACE FUNCTION outbox_history_moving() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN current_setting('outbox.history_move', true) IS NOT DISTINCT FROM 'on'
           AND (SELECT c.relowner FROM pg_class c
                WHERE c.oid = '@schema@.operations'::regclass)
               = (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user);
END;
$$;
REVOKE ALL ON FUNCTION outbox_history_moving() FROM PUBLIC;

CREATE OR REPLACE FUNCTION outbox_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND @schema@.outbox_history_moving() THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'operation_events is append-only'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS operation_events_append_only ON operation_events;
CREATE TRIGGER operation_events_append_only
    BEFORE UPDATE OR DELETE ON operation_events
    FOR EACH ROW EXECUTE FUNCTION outbox_events_append_only();

-- Version 5: tamper-evident evidence. The roles already forbid UPDATE and DELETE on
-- operation_events to everyone but the tables' owner and superusers, who can switch the
-- append-only trigger off; the chain makes what they do then visible to `outbox ops
-- verify` (docs/operating.md, "The evidence chain"). Each event carries its position in
-- its operation's chain (seq), the hash of the event before it (prev_hash, NULL for the
-- first) and its own hash over a canonical form of itself and prev_hash. seq, not id,
-- orders the chain: an id is drawn before the trigger waits for the operation's head, so
-- two appends racing on one operation may take the head in the other order.
ALTER TABLE operation_events ADD COLUMN IF NOT EXISTS seq integer;
ALTER TABLE operation_events ADD COLUMN IF NOT EXISTS prev_hash bytea;
ALTER TABLE operation_events ADD COLUMN IF NOT EXISTS hash bytea;

-- The head of each operation's chain: how many events it has and the hash of the last.
-- A chain alone cannot show that its newest events were deleted (what is left is still a
-- valid chain); its head can. The row is also what serializes appends to one operation:
-- the trigger's UPDATE locks it until the transaction ends, so a second append waits and
-- then chains after the first instead of forking. That is one lock per append and no
-- other: the row is read and written in one statement, and no extra lock is taken on
-- operations. Every row is rewritten a few times soon after its insert; room left on its
-- page (fillfactor) keeps those updates HOT, with no new index entry. No foreign key to
-- operations: only the trigger writes a head, and only once it has found the event's
-- operation (version 19, below).
CREATE TABLE IF NOT EXISTS operation_event_heads (
    operation_id  uuid PRIMARY KEY,
    events        integer NOT NULL CHECK (events >= 1),
    -- The hash before last_hash: the trigger's one UPDATE returns it as the new event's
    -- prev_hash (RETURNING sees only the new row).
    prev_hash     bytea,
    last_hash     bytea NOT NULL
) WITH (fillfactor = 50);

-- The canonical form of an event, and its hash: the one definition the trigger, the
-- migration below and verify_event_chains (queries.sql) all use. SHA-256 over the tag
-- "outbox.event.v1", then the fixed-width binary forms of operation_id (16 bytes), id
-- (8), seq (4) and created_at (8: microseconds since 2000-01-01 UTC, whatever the
-- session's TimeZone), then prev_hash and name each behind its length in bytes (a
-- 4-byte signed integer, -1 for no prev_hash), then attributes, the rest; text as UTF-8
-- whatever the client encoding, integers big-endian. jsonb's text form is canonical:
-- keys sorted and deduplicated, fixed spacing. Fixed widths and lengths make the form
-- unambiguous: no two different events share one. A NULL anywhere (a column a superuser
-- nulled) gives NULL, which matches no stored hash. A SQL-standard body (RETURN) is
-- parsed once, here, so what its operators mean cannot depend on a caller's
-- search_path, and it is still inlined into the statements that call it. STABLE rather
-- than IMMUTABLE only because convert_to is.
CREATE OR REPLACE FUNCTION outbox_event_hash(
    p_operation_id uuid, p_id bigint, p_seq integer, p_name text, p_attributes jsonb,
    p_created_at timestamptz, p_prev_hash bytea
) RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
RETURN sha256(
    'outbox.event.v1'::bytea
    || uuid_send(p_operation_id) || int8send(p_id) || int4send(p_seq)
    || timestamptz_send(p_created_at)
    || int4send(coalesce(octet_length(p_prev_hash), -1)) || coalesce(p_prev_hash, ''::bytea)
    || int4send(octet_length(convert_to(p_name, 'UTF8'))) || convert_to(p_name, 'UTF8')
    || convert_to(p_attributes::text, 'UTF8')
);

-- Chain every new event, whoever inserts it and whatever its INSERT said about id, seq,
-- prev_hash, hash and created_at: the trigger overwrites them, in the statement that
-- writes the event. SECURITY DEFINER: the heads table is granted to no component (so
-- none can rewind its own chain), and the agent, which may only insert events, needs no
-- grant to append one. Its search_path is pinned like every function's here (the loop
-- at the end of this file; about 1.5 µs an event, measured on this 2-core machine), and
-- every name the body resolves is qualified besides.
--
-- The id is drawn here, from the column's own sequence, never taken from the INSERT: a
-- BEFORE trigger runs before the unique check, so an event whose id was chosen to
-- collide (INSERT ... OVERRIDING SYSTEM VALUE ... ON CONFLICT DO NOTHING) would move
-- the head and then not be inserted, and every later append would report a deleted
-- event. With a fresh id nothing can collide: the head moves exactly for the rows that
-- are inserted. (The roles hold no INSERT on the column either; this holds for the
-- owner too.) The time is the database's clock at the append, so no writer backdates
-- evidence. BEFORE triggers fire in name order: this one must stay the last, since it
-- hashes NEW as it will be stored (today it is the only one; operation_events_by_role
-- checks the rows after the statement, and only refuses).
--
-- Appends that move an operation lock its operations row first (their UPDATE) and its
-- head next; appends that move nothing (insert_event, insert_approval, agent.completed)
-- lock only the head. Two transactions appending to the same two operations in opposite
-- orders can therefore deadlock where they used not to; Postgres ends one (SQLSTATE
-- 40P01), which the store reports as transient and the daemons retry.
--
-- Version 19: the trigger, not a foreign key, refuses an event whose operation does not
-- exist (SQLSTATE 23503, under the name the foreign key had). The foreign key looked the
-- operation up again for every event and locked its row (FOR KEY SHARE), one more WAL
-- record each time, mostly on a row the same statement had just updated: about 200 µs
-- of the backend's 1,600 an operation (decision, claim and outcome; bench results of
-- 2026-12-05 in docs/benchmarks.md). An event that finds its operation's head needs no
-- look: a head is written only for an operation that was found, and goes only with it
-- (outbox_history_archive locks the heads it deletes, so an append either commits
-- first and moves with the operation, or waits and then finds no head). An event that
-- finds none, its operation's first, looks the operation up and locks it as the foreign
-- key did, so no operation is deleted from under an event that names it.
DO $$
BEGIN
    EXECUTE format($definition$
        CREATE OR REPLACE FUNCTION outbox_chain_event() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER AS $body$
        BEGIN
            NEW.id := nextval(%2$L::regclass);
            NEW.created_at := clock_timestamp();
            -- An operation.prepared is its operation's first event (written by the
            -- statement that records it): straight to the INSERT below, without an UPDATE
            -- that finds no head. Should a head exist after all, ON CONFLICT chains
            -- after it as for any event.
            IF NEW.name OPERATOR(pg_catalog.<>) 'operation.prepared' THEN
                -- In READ COMMITTED, an UPDATE that waited for another transaction's
                -- lock on the row rereads its committed version: the chain continues
                -- from the head that transaction left.
                UPDATE %1$I.operation_event_heads
                SET events = events OPERATOR(pg_catalog.+) 1,
                    prev_hash = last_hash,
                    last_hash = %1$I.outbox_event_hash(
                        NEW.operation_id, NEW.id, events OPERATOR(pg_catalog.+) 1, NEW.name,
                        NEW.attributes, NEW.created_at, last_hash)
                WHERE operation_id OPERATOR(pg_catalog.=) NEW.operation_id
                RETURNING events, prev_hash, last_hash INTO NEW.seq, NEW.prev_hash, NEW.hash;
                IF FOUND THEN
                    RETURN NEW;
                END IF;
            END IF;
            -- The operation's first event (its operation.prepared, in the statement that
            -- records it), or one that raced another first event: ON CONFLICT waits for
            -- that one and chains after it. Either way, only an operation that exists.
            PERFORM FROM %1$I.operations o
            WHERE o.id OPERATOR(pg_catalog.=) NEW.operation_id
            FOR KEY SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'an event names an operation that does not exist'
                    USING ERRCODE = 'foreign_key_violation',
                          CONSTRAINT = 'operation_events_operation_id_fkey';
            END IF;
            INSERT INTO %1$I.operation_event_heads AS h
                (operation_id, events, prev_hash, last_hash)
            VALUES (NEW.operation_id, 1, NULL,
                    %1$I.outbox_event_hash(NEW.operation_id, NEW.id, 1, NEW.name,
                                           NEW.attributes, NEW.created_at, NULL))
            ON CONFLICT (operation_id) DO UPDATE
            SET events = h.events OPERATOR(pg_catalog.+) 1,
                prev_hash = h.last_hash,
                last_hash = %1$I.outbox_event_hash(
                    NEW.operation_id, NEW.id, h.events OPERATOR(pg_catalog.+) 1,
                    NEW.name, NEW.attributes, NEW.created_at, h.last_hash)
            RETURNING h.events, h.prev_hash, h.last_hash
            INTO NEW.seq, NEW.prev_hash, NEW.hash;
            RETURN NEW;
        END;
        $body$
    $definition$, current_schema(), pg_get_serial_sequence('operation_events', 'id'));
END;
$$;
-- A trigger fires without an EXECUTE check, but creating one needs EXECUTE: without
-- this, any role could hang the function on a temporary table of its own and move the
-- heads as the owner.
REVOKE ALL ON FUNCTION outbox_chain_event() FROM PUBLIC;

DROP TRIGGER IF EXISTS operation_events_chain ON operation_events;
CREATE TRIGGER operation_events_chain
    BEFORE INSERT ON operation_events
    FOR EACH ROW EXECUTE FUNCTION outbox_chain_event();

ALTER TABLE operation_events DROP CONSTRAINT IF EXISTS operation_events_operation_id_fkey;

-- Only the chain trigger moves a head. pg_trigger_depth() is 0 for a statement someone
-- typed and 1 inside outbox_chain_event, and the WHEN clause is evaluated without calling
-- a function, so appends pay nearly nothing for this. Like the append-only trigger, it
-- stops everyone but those who may switch triggers off (the owner, superusers).
--
-- Version 8: per statement, not per row. Any BEFORE UPDATE row trigger, even one whose
-- WHEN is false, makes Postgres lock each row before it updates it, which is one more
-- WAL record for every event appended; a statement-level trigger costs the chain's
-- UPDATE nothing per row, and refuses a statement someone typed before it touches any.
CREATE OR REPLACE FUNCTION outbox_event_heads_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Version 13: the history move deletes the heads of the operations it archived.
    IF TG_OP = 'DELETE' AND @schema@.outbox_history_moving() THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'operation_event_heads is written only by the operation_events chain trigger'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS operation_event_heads_guard ON operation_event_heads;
CREATE TRIGGER operation_event_heads_guard
    BEFORE UPDATE OR DELETE ON operation_event_heads
    FOR EACH STATEMENT WHEN (pg_trigger_depth() = 0)
    EXECUTE FUNCTION outbox_event_heads_guard();

-- Chain the events a database had before version 5, in id order per operation (before
-- version 5 ids were the only order there was), and anchor their heads. Once: version 5
-- is recorded in this same transaction. The append-only trigger is switched off for
-- these UPDATEs only, inside the migration's transaction: no other session ever sees it
-- off, and the ADD COLUMNs above hold the table's ACCESS EXCLUSIVE lock until commit, so
-- no event is appended meanwhile. One pass in (operation_id, id) order: each hash needs
-- the one before it.
DO $$
DECLARE
    event record;
    chained_operation uuid;
    chain_seq integer;
    previous bytea;
    link_hash bytea;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_schema_version WHERE version = 5) THEN
        RETURN;
    END IF;
    ALTER TABLE operation_events DISABLE TRIGGER operation_events_append_only;
    FOR event IN
        SELECT id, operation_id, name, attributes, created_at
        FROM operation_events
        ORDER BY operation_id, id
    LOOP
        IF event.operation_id IS DISTINCT FROM chained_operation THEN
            chained_operation := event.operation_id;
            chain_seq := 0;
            previous := NULL;
        END IF;
        chain_seq := chain_seq + 1;
        link_hash := outbox_event_hash(event.operation_id, event.id, chain_seq, event.name,
                                       event.attributes, event.created_at, previous);
        UPDATE operation_events SET seq = chain_seq, prev_hash = previous, hash = link_hash
        WHERE id = event.id;
        previous := link_hash;
    END LOOP;
    ALTER TABLE operation_events ENABLE TRIGGER operation_events_append_only;
    INSERT INTO operation_event_heads (operation_id, events, prev_hash, last_hash)
    SELECT DISTINCT ON (operation_id) operation_id, seq, prev_hash, hash
    FROM operation_events
    ORDER BY operation_id, seq DESC
    ON CONFLICT (operation_id) DO NOTHING;
END;
$$;

-- A no-op once set (Postgres does not scan again for a column already NOT NULL).
ALTER TABLE operation_events ALTER COLUMN seq SET NOT NULL;
ALTER TABLE operation_events ALTER COLUMN hash SET NOT NULL;

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

-- Version 6: what an agent service reads of operations (roles.sql grants outbox_agent
-- this view, and of the table only the two columns the approval check compares): where
-- each operation stands and what it recorded, never the input (another run's tool input
-- is not the agent's to read; its own it already holds). row_version is the row's xmin,
-- new with every update, which the outcome watcher compares to skip unchanged rows; a
-- system column is readable only through the table, so the view, owned by the tables'
-- owner, reads it on the agent's behalf.
CREATE OR REPLACE VIEW operation_status AS
SELECT id, run_id, decision_key, tool_name, tool_version, side_effect, input_fingerprint,
       requires_approval, state, attempts, reconcile_attempts, lease_token, lease_owner,
       lease_expires_at, next_attempt_at, first_attempt_at, provider_reference, result,
       last_error_class, effect_possible, created_at, updated_at,
       xmin::text::bigint AS row_version
FROM operations;

-- Version 6: what a grant or a denial is, whoever inserts it (an operator's INSERT on
-- approvals is a column grant without created_at). Its time is the database's clock, so
-- no grant can be dated after a later denial and win; it expires within 7 days
-- (outbox/bounds.py MAX_APPROVAL_TTL), never at 'infinity'. And every decision on an
-- approval appends its own event, in the same statement, so the timeline shows each
-- grant the consumer may act on, including one typed by hand.
CREATE OR REPLACE FUNCTION outbox_guard_approval() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.created_at := clock_timestamp();
    -- An expiry already past is harmless (such a grant is never valid); one beyond the
    -- policy, or never, is what a grant must not have.
    IF NOT isfinite(NEW.expires_at) OR NEW.expires_at > NEW.created_at + interval '7 days' THEN
        RAISE EXCEPTION 'an approval expires within 7 days of when it is decided'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'approvals_expiry_bounded';
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS approvals_guard ON approvals;
CREATE TRIGGER approvals_guard
    BEFORE INSERT ON approvals
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_approval();

-- Who decided is evidence (the events table records who did what; log lines carry ids).
-- The intent is not repeated here: the approval id names the row that binds it.
CREATE OR REPLACE FUNCTION outbox_approval_event() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO @schema@.operation_events (operation_id, name, attributes)
    VALUES (NEW.operation_id,
            CASE NEW.decision WHEN 'granted' THEN 'operation.approval_granted'
                              ELSE 'operation.approval_denied' END,
            jsonb_build_object('approval_id', NEW.id, 'by', NEW.approved_by,
                               'expires_at', NEW.expires_at));
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS approvals_event ON approvals;
CREATE TRIGGER approvals_event
    AFTER INSERT ON approvals
    FOR EACH ROW EXECUTE FUNCTION outbox_approval_event();

-- Every outbox row is born unpublished, at the database's clock, routed by its tool's
-- routing key, with no headers but a W3C trace context (the dispatcher copies a valid
-- traceparent into the message, nothing else) and available within 30 days. Writers:
-- outbox_record_decision (headers), the consumer's requeues and the operator's grants
-- (column grants without headers, created_at or the publish columns).
--
-- The headers are checked with jsonb operators, not a query over jsonb_each: a condition
-- without a subquery is one plpgsql evaluates directly, where a subquery started the
-- executor for every row. The CASE keeps `-` away from a scalar, which it cannot delete
-- from (in parentheses: plpgsql ends an IF's condition at the first THEN outside them).
CREATE OR REPLACE FUNCTION outbox_guard_outbox_row() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.created_at := clock_timestamp();
        IF NEW.published_at IS NOT NULL OR NEW.publish_attempts <> 0 OR NEW.last_error IS NOT NULL
           OR NEW.routing_key !~ '^[a-z][a-z0-9_.-]{0,63}\.v[0-9]{1,9}$'
           OR (CASE WHEN jsonb_typeof(NEW.headers) = 'object'
                    THEN NEW.headers - ARRAY['traceparent', 'tracestate'] <> '{}'::jsonb
                         OR jsonb_typeof(NEW.headers -> 'traceparent') <> 'string'
                         OR jsonb_typeof(NEW.headers -> 'tracestate') <> 'string'
                    ELSE true
               END)
           OR (NEW.headers->>'traceparent') !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
           OR length(NEW.headers->>'tracestate') > 512
           OR (NEW.headers->>'tracestate') !~ '^[ -~]*$' THEN
            RAISE EXCEPTION 'an outbox row is born unpublished, routed by its tool, with only a W3C traceparent and tracestate as headers'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'outbox_row_bounded';
        END IF;
    END IF;
    IF NOT @schema@.outbox_plausible_time(NEW.available_at)
       OR NOT @schema@.outbox_plausible_time(NEW.published_at)
       OR length(NEW.last_error) > 1000 THEN
        RAISE EXCEPTION 'an outbox row is available and published within 30 days and keeps at most 1000 characters of its last error'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'outbox_row_bounded';
    END IF;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS outbox_guard_row ON outbox;
CREATE TRIGGER outbox_guard_row
    BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_outbox_row();
-- Updates: the times and the text the dispatcher writes (roles.sql grants it no other
-- column), checked only when one of them changes.
DROP TRIGGER IF EXISTS outbox_guard_update ON outbox;
CREATE TRIGGER outbox_guard_update
    BEFORE UPDATE ON outbox
    FOR EACH ROW
    WHEN (NEW.available_at IS DISTINCT FROM OLD.available_at
          OR NEW.published_at IS DISTINCT FROM OLD.published_at
          OR NEW.last_error IS DISTINCT FROM OLD.last_error)
    EXECUTE FUNCTION outbox_guard_outbox_row();

-- The agent's one write path (roles.sql grants outbox_agent EXECUTE on it and no INSERT
-- on operations or outbox): a prepared operation, its outbox row and its
-- operation.prepared event, in one statement; no row back when (run_id, decision_key)
-- is taken. It runs as the tables' owner with a search_path pinned to pg_catalog and
-- every table named with its schema, so no caller's object can stand in for a table,
-- a function or an operator. What it cannot check (that the
-- fingerprint and the approval flag match the input) the consumer recomputes before
-- any effect; what it writes is bounded by the tables' triggers like any other write.
-- The event's attributes are its own, from its arguments: the caller chooses none of
-- them (before version 6 it passed them, and so could dress its words as the
-- runtime's). PL/pgSQL keeps the statement's plan for the session, where a SQL function
-- with a SET clause is planned again on every call.
--
-- Version 11: it waits at most 5 s for a lock (another session's LOCK TABLE, a
-- transaction holding the same decision key), whatever the caller's own lock_timeout:
-- an agent's decision that cannot be written says so (LockNotAvailable, which
-- record_decision raises as DecisionBlocked) instead of hanging its tool call for as
-- long as the lock is held. Nothing was written; the same decision key retries it.
--
-- Version 12: the bound is the caller's to choose (record_decision's lock_timeout,
-- OUTBOX_DECISION_LOCK_TIMEOUT for `outbox mcp`), from 1 ms to 60 s; 5 s when not
-- given, as before. Set inside the function, so the SET clause below gives the
-- caller's session its own lock_timeout back when the function returns.
DROP FUNCTION IF EXISTS outbox_record_decision(uuid, text, text, text, integer, text, jsonb,
    text, boolean, jsonb, jsonb);
DROP FUNCTION IF EXISTS outbox_record_decision(uuid, text, text, text, integer, text, jsonb,
    text, boolean, jsonb);
CREATE OR REPLACE FUNCTION outbox_record_decision(
    p_id uuid, p_run_id text, p_decision_key text, p_tool_name text,
    p_tool_version integer, p_side_effect text, p_input jsonb,
    p_input_fingerprint text, p_requires_approval boolean, p_headers jsonb,
    p_lock_timeout_ms integer DEFAULT 5000
) RETURNS SETOF operations
LANGUAGE plpgsql SECURITY DEFINER
SET lock_timeout = '5s'
AS $$
BEGIN
    IF p_lock_timeout_ms IS NULL OR p_lock_timeout_ms NOT BETWEEN 1 AND 60000 THEN
        RAISE EXCEPTION 'a decision''s lock timeout is 1 to 60000 ms'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::text || 'ms', true);
    -- Version 13: a decision whose operation moved to history (outbox_history_archive)
    -- is still recorded: its key is in one of the two key generations, and the call
    -- returns the archived operation (without its input) instead of creating a second
    -- one. The caller tells it from a new one by its id, which is not p_id. Two index
    -- probes; a key with no decision key is never looked up.
    IF p_decision_key IS NOT NULL THEN
        RETURN QUERY
        SELECT r.*
        FROM (SELECT @schema@.outbox_history_key_operation(g) AS operation
              FROM @schema@.history_keys_0 g
              WHERE g.run_id = p_run_id AND g.decision_key = p_decision_key
              UNION ALL
              SELECT @schema@.outbox_history_key_operation(g) AS operation
              FROM @schema@.history_keys_1 g
              WHERE g.run_id = p_run_id AND g.decision_key = p_decision_key
              LIMIT 1) AS k
        CROSS JOIN LATERAL jsonb_populate_record(NULL::@schema@.operations, k.operation) AS r;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
    WITH operation AS (
        INSERT INTO @schema@.operations (id, run_id, decision_key, tool_name, tool_version,
                                         side_effect, input, input_fingerprint,
                                         requires_approval, recorded_by)
        VALUES (p_id, p_run_id, p_decision_key, p_tool_name, p_tool_version,
                p_side_effect, p_input, p_input_fingerprint, p_requires_approval,
                session_user)
        ON CONFLICT (run_id, decision_key) DO NOTHING
        RETURNING *
    ), queued AS (
        INSERT INTO @schema@.outbox (operation_id, routing_key, headers)
        SELECT o.id, o.tool_name || '.v' || o.tool_version, p_headers FROM operation o
    ), event AS (
        INSERT INTO @schema@.operation_events (operation_id, name, attributes)
        SELECT o.id, 'operation.prepared',
               jsonb_build_object('tool', o.tool_name, 'tool_version', o.tool_version,
                                  'run_id', o.run_id)
        FROM operation o
    )
    SELECT * FROM operation;
    -- The move may have taken the key between the probe above and this insert: its
    -- delete of the old row let the insert through, and it committed before this
    -- statement looked. Looked for again, with a snapshot taken after the insert, it is
    -- found; the transaction is refused as a serialization failure, and the retry
    -- returns the archived operation. Paid only by a decision that created a row.
    --
    -- Version 14: at REPEATABLE READ and SERIALIZABLE every statement sees the
    -- transaction's first snapshot, so a move that committed after it is invisible to
    -- both looks, and the insert (whose unique check sees only the move's delete) went
    -- through: the key recorded twice. That snapshot still holds the row the move
    -- deleted, though: another operation under this key beside the one just inserted,
    -- which the unique index allows only when it was deleted after the snapshot. Found,
    -- the transaction is refused the same way (SQLSTATE 40001, as Postgres refuses a
    -- snapshot that missed a concurrent change); the retry's snapshot sees the key in
    -- history. One more index probe, for those isolation levels only.
    IF FOUND AND p_decision_key IS NOT NULL
       AND (EXISTS (SELECT 1 FROM @schema@.history_keys_0 g
                    WHERE g.run_id = p_run_id AND g.decision_key = p_decision_key)
            OR EXISTS (SELECT 1 FROM @schema@.history_keys_1 g
                       WHERE g.run_id = p_run_id AND g.decision_key = p_decision_key)
            OR (pg_catalog.current_setting('transaction_isolation') <> 'read committed'
                AND EXISTS (SELECT 1 FROM @schema@.operations o
                            WHERE o.run_id = p_run_id AND o.decision_key = p_decision_key
                              AND o.id <> p_id))) THEN
        RAISE EXCEPTION 'decision key moved to history while it was recorded; retry the transaction'
            USING ERRCODE = 'serialization_failure';
    END IF;
END;
$$;
-- A new function is executable by PUBLIC; roles.sql grants this one to the agent only.
REVOKE ALL ON FUNCTION outbox_record_decision(uuid, text, text, text, integer, text, jsonb,
    text, boolean, jsonb, integer) FROM PUBLIC;

-- Version 7: provider callbacks (docs/design.md section 5, "Callbacks"). A verified
-- webhook is evidence, never a command: kept once per provider and event id, with the
-- operation it names (NULL when the database has none: unmatched), what it reports and
-- the SHA-256 of its body, never the body. Written only through outbox_record_callback
-- (below) by the outbox_callbacks role; the consumer, which holds the contracts, applies
-- it and records its outcome, once.
CREATE TABLE IF NOT EXISTS callbacks (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider            text NOT NULL CHECK (provider ~ '^[a-z][a-z0-9_-]{0,63}$'),
    -- Printable ASCII without a space: ids like evt_1NG8…, msg_2Lw…, UUIDs.
    event_id            text NOT NULL CHECK (event_id ~ '^[!-~]{1,255}$'),
    status              text NOT NULL CHECK (status IN ('committed', 'rejected', 'pending')),
    -- What the callback named (its idempotency key), whether or not it exists here.
    named_operation_id  uuid,
    operation_id        uuid REFERENCES operations (id),
    provider_reference  text CHECK (length(provider_reference) BETWEEN 1 AND 500
                                    AND provider_reference !~ '[[:cntrl:]]'),
    payload_digest      text NOT NULL CHECK (payload_digest ~ '^[0-9a-f]{64}$'),
    received_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    outcome             text CHECK (outcome IN ('settled', 'retry', 'confirmed', 'evidence',
                                                'contradicted', 'unmatched')),
    applied_at          timestamptz,
    CONSTRAINT callbacks_event UNIQUE (provider, event_id),
    CONSTRAINT callbacks_applied_once CHECK ((outcome IS NULL) = (applied_at IS NULL)),
    CONSTRAINT callbacks_matched CHECK ((operation_id IS NULL) = (outcome IS NOT DISTINCT FROM 'unmatched'))
);

-- What the reconciler applies next, and an operation's callbacks in arrival order.
CREATE INDEX IF NOT EXISTS callbacks_pending ON callbacks (id) WHERE applied_at IS NULL;
CREATE INDEX IF NOT EXISTS callbacks_operation ON callbacks (operation_id, id);
-- A callback may name its effect by the provider's reference alone (a refund that failed
-- days later). Partial: an operation gets its entry only with the update that commits it.
CREATE INDEX IF NOT EXISTS operations_provider_reference
    ON operations (provider_reference) WHERE provider_reference IS NOT NULL;

-- A callback is evidence: its times are the database's, and once written only its
-- outcome may be set, once, to what the consumer did with it (applied_at stamped here).
-- For everyone, the tables' owner included.
CREATE OR REPLACE FUNCTION outbox_guard_callback() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.received_at := clock_timestamp();
        NEW.applied_at := CASE WHEN NEW.outcome IS NULL THEN NULL ELSE NEW.received_at END;
        RETURN NEW;
    END IF;
    IF (NEW.id, NEW.provider, NEW.event_id, NEW.status, NEW.named_operation_id,
        NEW.operation_id, NEW.provider_reference, NEW.payload_digest, NEW.received_at)
       IS DISTINCT FROM
       (OLD.id, OLD.provider, OLD.event_id, OLD.status, OLD.named_operation_id,
        OLD.operation_id, OLD.provider_reference, OLD.payload_digest, OLD.received_at) THEN
        RAISE EXCEPTION 'callback %: what a provider reported cannot change', OLD.id
            USING ERRCODE = 'insufficient_privilege', CONSTRAINT = 'callbacks_evidence_frozen';
    END IF;
    IF OLD.outcome IS NOT NULL OR NEW.outcome IS NULL OR NEW.outcome = 'unmatched' THEN
        RAISE EXCEPTION 'callback %: its outcome is set once, when it is applied to its operation', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'callbacks_applied_once';
    END IF;
    NEW.applied_at := clock_timestamp();
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS callbacks_guard ON callbacks;
CREATE TRIGGER callbacks_guard
    BEFORE INSERT OR UPDATE ON callbacks
    FOR EACH ROW EXECUTE FUNCTION outbox_guard_callback();

-- Version 11: the key of the advisory lock that orders a callback's recording against
-- the reconciler's decision on its operation (below). One statement of it, so the
-- function that records and the queries that decide (claim_reconciliation_batch,
-- lock_operation in outbox/sql/queries.sql) cannot disagree.
CREATE OR REPLACE FUNCTION outbox_callback_lock_key(p_operation_id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended('outbox.callback:' || p_operation_id::text, 0);

-- The callbacks role's one write path (roles.sql grants outbox_callbacks EXECUTE on it
-- and nothing else). Finds the operation the callback names, by id or else by the
-- provider's reference, then the inbox row, once per (provider, event id): a redelivery
-- writes nothing and says whether it carried the same body. It moves no operation, and
-- every value is bounded by the table's checks; the times are the database's.
--
-- Version 11: it locks nothing a daemon's write waits for. The caller's transaction is
-- the caller's, open as long as it likes, so it neither takes the operation's row (a
-- share lock there stopped the consumer recording an attempt's outcome until the
-- caller committed) nor appends to the chain (the head stays locked to the commit):
-- the operation.callback_received event is chained when the consumer applies the
-- callback (outbox_chain_callback, below), in the consumer's own short transaction.
-- What keeps the reconciler from deciding around a callback being recorded is a
-- shared advisory lock on the operation (outbox_callback_lock_key), held to the
-- caller's commit: the reconciler's scan (claim_reconciliation_batch) passes over an
-- operation whose key another session holds, and decides it once the callback
-- committed, with it. Nobody waits for that lock. This function only tries it: held
-- exclusively, the reconciler is deciding, and the callback, committed now or later,
-- is applied to what the decision wrote, as one that came a moment later would be.
-- And any login may take an advisory lock, so the scan passes over a held key for at
-- most 10 s of the operation being due: past that, a holder is a stuck or hostile
-- session, not a callback being recorded.
--
-- An operation takes at most 64 callbacks (a provider sends a handful: pending, done, a
-- late failure): each one the consumer reads before it decides, and an operator's page
-- lists them. Past that, a callback is kept, for the operator, as unmatched, naming the
-- operation it named (named_operation_id): a signing secret in the wrong hands cannot
-- grow what every decision on one operation reads. Counted without a lock, so two
-- recorded at the same moment may both pass at 63; bounded all the same.
CREATE OR REPLACE FUNCTION outbox_record_callback(
    p_provider text, p_event_id text, p_status text, p_operation_id uuid,
    p_provider_reference text, p_payload_digest text
) RETURNS TABLE (callback_id bigint, result text, matched_operation_id uuid,
                 same_payload boolean)
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    matched uuid;
    recorded bigint;
    earlier record;
BEGIN
    IF p_operation_id IS NOT NULL THEN
        SELECT o.id INTO matched FROM @schema@.operations o WHERE o.id = p_operation_id;
    END IF;
    IF matched IS NULL AND p_provider_reference IS NOT NULL THEN
        SELECT o.id INTO matched FROM @schema@.operations o
        WHERE o.provider_reference = p_provider_reference
        ORDER BY o.created_at, o.id
        LIMIT 1;
    END IF;
    IF matched IS NOT NULL
       AND (SELECT count(*) FROM (SELECT 1 FROM @schema@.callbacks c
                                  WHERE c.operation_id = matched LIMIT 64) AS kept) >= 64 THEN
        matched := NULL;
    END IF;
    IF matched IS NOT NULL THEN
        PERFORM pg_try_advisory_xact_lock_shared(@schema@.outbox_callback_lock_key(matched));
    END IF;
    INSERT INTO @schema@.callbacks AS c (provider, event_id, status, named_operation_id,
                                         operation_id, provider_reference, payload_digest,
                                         outcome)
    VALUES (p_provider, p_event_id, p_status, p_operation_id, matched, p_provider_reference,
            p_payload_digest, CASE WHEN matched IS NULL THEN 'unmatched' END)
    ON CONFLICT (provider, event_id) DO NOTHING
    RETURNING c.id INTO recorded;
    IF recorded IS NULL THEN
        SELECT c.id, c.operation_id, c.payload_digest INTO earlier
        FROM @schema@.callbacks c WHERE c.provider = p_provider AND c.event_id = p_event_id;
        RETURN QUERY SELECT earlier.id, 'duplicate'::text, earlier.operation_id,
                            earlier.payload_digest = p_payload_digest;
        RETURN;
    END IF;
    RETURN QUERY SELECT recorded, CASE WHEN matched IS NULL THEN 'unmatched' ELSE 'recorded' END,
                        matched, true;
END;
$$;
REVOKE ALL ON FUNCTION outbox_record_callback(text, text, text, uuid, text, text) FROM PUBLIC;

-- Version 11: a matched callback enters its operation's chain as an
-- operation.callback_received event when the consumer applies it (sets its outcome,
-- once: outbox_guard_callback), in the consumer's transaction, before what it does to
-- the operation. Built from the inbox row, which nobody can change, so the consumer
-- chains what the provider reported and nothing it chose; as the tables' owner, since
-- the consumer may not append that event itself (operation_events_by_role).
CREATE OR REPLACE FUNCTION outbox_chain_callback() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO @schema@.operation_events (operation_id, name, attributes)
    VALUES (NEW.operation_id, 'operation.callback_received',
            jsonb_strip_nulls(jsonb_build_object(
                'callback', NEW.id, 'provider', NEW.provider, 'status', NEW.status,
                'provider_reference', NEW.provider_reference,
                'received_at', NEW.received_at)));
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION outbox_chain_callback() FROM PUBLIC;

DROP TRIGGER IF EXISTS callbacks_chain_received ON callbacks;
CREATE TRIGGER callbacks_chain_received
    AFTER UPDATE OF outcome ON callbacks
    FOR EACH ROW
    WHEN (OLD.outcome IS NULL AND NEW.outcome IS NOT NULL AND NEW.operation_id IS NOT NULL)
    EXECUTE FUNCTION outbox_chain_callback();

-- Version 10: what an agent says of an operation (agent.completed) waits here until a
-- consumer chains it. An append to the chain locks the operation's head until its
-- transaction ends, and an agent's transaction is the agent's: open as long as it
-- likes, around as many operations as it likes. So no agent login appends to the chain
-- (roles.sql grants it no INSERT on operation_events); it reports through
-- outbox_report_agent_completed, which writes a row here and locks nothing a daemon
-- takes, and outbox_chain_agent_reports, run by the consumer's reconciler in a short
-- transaction of its own, moves committed reports into their chains. The report is
-- bounded as the event is (outbox_agent_words_refused).
CREATE TABLE IF NOT EXISTS agent_reports (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id  uuid NOT NULL,
    attributes    jsonb NOT NULL CHECK (NOT outbox_agent_words_refused(attributes)),
    reported_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS agent_reports_operation ON agent_reports (operation_id);

-- An agent reports only on an operation its own login recorded (or, for the owner and
-- operators, any), at most 16 times an operation, counting what is chained and what
-- waits. The per-operation advisory lock makes the count exact across concurrent
-- reports; it is held to the caller's commit and stops nobody but another report on
-- the same operation.
CREATE OR REPLACE FUNCTION outbox_report_agent_completed(p_operation_id uuid,
                                                        p_attributes jsonb)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    recorder name;
    reported bigint;
BEGIN
    -- What the chain's own checks (operation_events_by_role) will ask of the event, asked
    -- here first: a report the chain refused would stop every report behind it.
    IF @schema@.outbox_agent_words_refused(p_attributes) THEN
        RAISE EXCEPTION 'agent.completed attributes are the agent''s own: keys agent.<name>, at most 4096 bytes'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'operation_events_agent_namespace';
    END IF;
    -- Version 13: the lock first, then the operation. The history move takes the same
    -- lock (trying, never waiting) before it archives an operation, so a report either
    -- finds its operation still here, and the move passes over it until the report is
    -- chained, or finds it gone: never a report left behind for an archived operation.
    PERFORM pg_advisory_xact_lock(hashtextextended('outbox.agent_reports:' || p_operation_id::text, 0));
    SELECT o.recorded_by INTO recorder FROM @schema@.operations o WHERE o.id = p_operation_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no operation % to report on', p_operation_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'agent_reports_operation';
    END IF;
    IF recorder IS DISTINCT FROM session_user
       AND NOT pg_has_role(session_user, (SELECT c.relowner FROM pg_class c
                                          WHERE c.oid = '@schema@.operations'::regclass),
                           'MEMBER')
       AND (to_regrole('outbox_operator') IS NULL
            OR NOT pg_has_role(session_user, 'outbox_operator', 'MEMBER')) THEN
        RAISE EXCEPTION 'operation % was recorded by another login: an agent reports only on its own', p_operation_id
            USING ERRCODE = 'insufficient_privilege', CONSTRAINT = 'agent_reports_own_operations';
    END IF;
    IF (SELECT count(*) FROM @schema@.agent_reports r WHERE r.operation_id = p_operation_id)
       + (SELECT count(*) FROM @schema@.operation_events e
          WHERE e.operation_id = p_operation_id AND e.name = 'agent.completed') >= 16 THEN
        RAISE EXCEPTION 'operation % has its 16 agent reports already', p_operation_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'agent_reports_bounded';
    END IF;
    INSERT INTO @schema@.agent_reports (operation_id, attributes)
    VALUES (p_operation_id, p_attributes)
    RETURNING id INTO reported;
    RETURN reported;
END;
$$;
REVOKE ALL ON FUNCTION outbox_report_agent_completed(uuid, jsonb) FROM PUBLIC;

-- Move up to p_limit committed reports into their operations' chains, oldest first, as
-- the tables' owner (so the events are the agent's words, not the caller's); returns
-- how many. SKIP LOCKED: two reconcilers never move one report twice, and neither
-- waits for the other. Each head is locked for this short transaction only.
CREATE OR REPLACE FUNCTION outbox_chain_agent_reports(p_limit integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    moved integer;
BEGIN
    WITH taken AS (
        DELETE FROM @schema@.agent_reports r
        WHERE r.id IN (SELECT q.id FROM @schema@.agent_reports q ORDER BY q.id
                       LIMIT greatest(1, least(p_limit, 1000)) FOR UPDATE SKIP LOCKED)
        RETURNING r.id, r.operation_id, r.attributes
    ), chained AS (
        INSERT INTO @schema@.operation_events (operation_id, name, attributes)
        SELECT t.operation_id, 'agent.completed', t.attributes FROM taken t ORDER BY t.id
        RETURNING 1
    )
    SELECT count(*) INTO moved FROM chained;
    RETURN moved;
END;
$$;
REVOKE ALL ON FUNCTION outbox_chain_agent_reports(integer) FROM PUBLIC;

-- Version 13: history retention (docs/design.md section 15). A settled operation
-- leaves the hot tables OUTBOX_HISTORY_HOT after it settled, whole, into one row of
-- history: the operation row, its events (with their chain links, hex), callbacks,
-- approvals and agent reports, and its chain head. history is partitioned by the day
-- (UTC) the operation settled, so a day leaves by DETACH and DROP (outbox history drop,
-- as the tables' owner), never by row deletes. The primary key carries the partition
-- key, as Postgres requires: an operation is found by id in each day's index (an
-- operator's look-up, not the agent's path), and by (run_id, decision_key) likewise.
CREATE TABLE IF NOT EXISTS history (
    settled_on     date NOT NULL,
    operation_id   uuid NOT NULL,
    run_id         text NOT NULL,
    decision_key   text,
    state          text NOT NULL CHECK (state IN ('committed', 'rejected')),
    settled_at     timestamptz NOT NULL,
    archived_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    operation      jsonb NOT NULL,
    -- [{id, seq, name, attributes, created_at (UTC, microseconds), prev_hash, hash}]
    events         jsonb NOT NULL,
    callbacks      jsonb NOT NULL,
    approvals      jsonb NOT NULL,
    agent_reports  jsonb NOT NULL,
    -- The chain head as operation_event_heads held it when the operation left.
    event_count    integer NOT NULL CHECK (event_count >= 0),
    last_hash      text CHECK (last_hash ~ '^[0-9a-f]{64}$'),
    PRIMARY KEY (operation_id, settled_on)
) PARTITION BY RANGE (settled_on);
CREATE INDEX IF NOT EXISTS history_decision_key ON history (run_id, decision_key);

-- What left and its hash: one row per archive batch and day, per export and per dropped
-- day. The digest is SHA-256 over the lines "<operation id> <events> <last hash>" of the
-- day's operations, in id order, joined by newlines (outbox_history_digest): the heads
-- `ops verify` compares, so a file or a partition that lost, gained or changed an
-- operation's chain after the checkpoint no longer matches it. Append-only.
CREATE TABLE IF NOT EXISTS history_checkpoints (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text NOT NULL CHECK (kind IN ('archived', 'exported', 'dropped')),
    settled_on   date NOT NULL,
    operations   integer NOT NULL CHECK (operations >= 0),
    events       bigint NOT NULL CHECK (events >= 0),
    digest       text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    recorded_by  name NOT NULL DEFAULT session_user,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS history_checkpoints_day ON history_checkpoints (settled_on, id);

CREATE OR REPLACE FUNCTION outbox_history_checkpoints_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'history_checkpoints is append-only'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
DROP TRIGGER IF EXISTS history_checkpoints_append_only ON history_checkpoints;
CREATE TRIGGER history_checkpoints_append_only
    BEFORE UPDATE OR DELETE ON history_checkpoints
    FOR EACH ROW EXECUTE FUNCTION outbox_history_checkpoints_append_only();

-- Version 14: the checkpoints are a chain of their own, as an operation's events are
-- (version 5): each row carries its position (seq), the hash of the checkpoint before
-- it (prev_hash, NULL for the first) and its own hash over a canonical form of itself
-- and prev_hash, all written by the insert trigger below whatever the INSERT said. A
-- row deleted or changed, even by the tables' owner with the append-only trigger off,
-- no longer links, and `outbox history verify` names the first such link; the head
-- (history_checkpoint_head) counts the rows and names the last hash, so a deleted
-- newest row shows too. An owner who rewrote the whole chain and its head would still
-- disagree with every export's checkpoint line that carries a hash
-- (`ops verify --archive`): keep those where the owner cannot write.
ALTER TABLE history_checkpoints ADD COLUMN IF NOT EXISTS seq bigint;
ALTER TABLE history_checkpoints ADD COLUMN IF NOT EXISTS prev_hash bytea;
ALTER TABLE history_checkpoints ADD COLUMN IF NOT EXISTS hash bytea;
CREATE UNIQUE INDEX IF NOT EXISTS history_checkpoints_seq ON history_checkpoints (seq);

-- One row: how many checkpoints the chain holds and the hash of the newest. Its UPDATE
-- in the trigger also serializes checkpoint inserts: a second one waits for the first
-- to commit and chains after it. Granted to no login for writing; the operators read
-- it to verify.
CREATE TABLE IF NOT EXISTS history_checkpoint_head (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    checkpoints  bigint NOT NULL CHECK (checkpoints >= 0),
    -- The hash before last_hash: the trigger's one UPDATE returns it as the new row's
    -- prev_hash (RETURNING sees only the new row).
    prev_hash    bytea,
    last_hash    bytea
);

-- The canonical form of a checkpoint, and its hash (the trigger, the migration below and
-- verify_checkpoint_chain in queries.sql all use this one): SHA-256 over the tag
-- "outbox.checkpoint.v1", then id and seq (8 bytes each), kind behind its length,
-- settled_on (4: days since 2000-01-01), operations (4), events (8), the digest's 32
-- bytes, recorded_by behind its length, recorded_at (8: microseconds since
-- 2000-01-01 UTC), then prev_hash behind its length (-1 for none). Fixed widths and
-- lengths, integers big-endian, text as UTF-8: no two checkpoints share one form. A
-- NULL anywhere gives NULL, which matches no stored hash.
CREATE OR REPLACE FUNCTION outbox_checkpoint_hash(
    p_id bigint, p_seq bigint, p_kind text, p_settled_on date, p_operations integer,
    p_events bigint, p_digest text, p_recorded_by name, p_recorded_at timestamptz,
    p_prev_hash bytea
) RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
RETURN sha256(
    'outbox.checkpoint.v1'::bytea
    || int8send(p_id) || int8send(p_seq)
    || int4send(octet_length(convert_to(p_kind, 'UTF8'))) || convert_to(p_kind, 'UTF8')
    || date_send(p_settled_on) || int4send(p_operations) || int8send(p_events)
    || decode(p_digest, 'hex')
    || int4send(octet_length(convert_to(p_recorded_by::text, 'UTF8')))
    || convert_to(p_recorded_by::text, 'UTF8')
    || timestamptz_send(p_recorded_at)
    || int4send(coalesce(octet_length(p_prev_hash), -1)) || coalesce(p_prev_hash, ''::bytea)
);

-- Chain every new checkpoint. Who and when are the database's, whatever the INSERT
-- said: no writer backdates one. SECURITY DEFINER, so the head needs no grant. The id
-- is the column's own (no login but the owner inserts here, and only through the
-- functions below; an owner's INSERT whose chosen id collided would move the head
-- without a row, which verify reports as a missing tail).
CREATE OR REPLACE FUNCTION outbox_chain_checkpoint() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    NEW.recorded_by := session_user;
    NEW.recorded_at := clock_timestamp();
    UPDATE @schema@.history_checkpoint_head h
    SET checkpoints = h.checkpoints + 1,
        prev_hash = h.last_hash,
        last_hash = @schema@.outbox_checkpoint_hash(
            NEW.id, h.checkpoints + 1, NEW.kind, NEW.settled_on, NEW.operations, NEW.events,
            NEW.digest, NEW.recorded_by, NEW.recorded_at, h.last_hash)
    WHERE h.singleton
    RETURNING h.checkpoints, h.prev_hash, h.last_hash INTO NEW.seq, NEW.prev_hash, NEW.hash;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'history_checkpoint_head is missing: run outbox migrate'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN NEW;
END;
$$;
REVOKE ALL ON FUNCTION outbox_chain_checkpoint() FROM PUBLIC;

DROP TRIGGER IF EXISTS history_checkpoints_chain ON history_checkpoints;
CREATE TRIGGER history_checkpoints_chain
    BEFORE INSERT ON history_checkpoints
    FOR EACH ROW EXECUTE FUNCTION outbox_chain_checkpoint();

-- Only the chain trigger moves the head (as for operation_event_heads, version 8).
CREATE OR REPLACE FUNCTION outbox_checkpoint_head_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'history_checkpoint_head is written only by the history_checkpoints chain trigger'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS history_checkpoint_head_guard ON history_checkpoint_head;
CREATE TRIGGER history_checkpoint_head_guard
    BEFORE UPDATE OR DELETE ON history_checkpoint_head
    FOR EACH STATEMENT WHEN (pg_trigger_depth() = 0)
    EXECUTE FUNCTION outbox_checkpoint_head_guard();

-- Chain the checkpoints a version 13 database wrote, in id order, and anchor the head
-- (an empty chain on a new database). Once: version 14 is recorded in this same
-- transaction, and the ADD COLUMNs above hold the table's ACCESS EXCLUSIVE lock until
-- commit, so no checkpoint is written meanwhile; the append-only trigger is off for
-- these UPDATEs only, inside the migration's transaction.
DO $$
DECLARE
    checkpoint record;
    chain_seq bigint := 0;
    previous bytea;
    before_previous bytea;
    link_hash bytea;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_schema_version WHERE version = 14) THEN
        RETURN;
    END IF;
    ALTER TABLE history_checkpoints DISABLE TRIGGER history_checkpoints_append_only;
    FOR checkpoint IN
        SELECT id, kind, settled_on, operations, events, digest, recorded_by, recorded_at
        FROM history_checkpoints
        ORDER BY id
    LOOP
        chain_seq := chain_seq + 1;
        link_hash := outbox_checkpoint_hash(checkpoint.id, chain_seq, checkpoint.kind,
                                            checkpoint.settled_on, checkpoint.operations,
                                            checkpoint.events, checkpoint.digest,
                                            checkpoint.recorded_by, checkpoint.recorded_at,
                                            previous);
        UPDATE history_checkpoints SET seq = chain_seq, prev_hash = previous, hash = link_hash
        WHERE id = checkpoint.id;
        before_previous := previous;
        previous := link_hash;
    END LOOP;
    ALTER TABLE history_checkpoints ENABLE TRIGGER history_checkpoints_append_only;
    INSERT INTO history_checkpoint_head (singleton, checkpoints, prev_hash, last_hash)
    VALUES (true, chain_seq, before_previous, previous)
    ON CONFLICT (singleton) DO NOTHING;
END;
$$;

ALTER TABLE history_checkpoints ALTER COLUMN seq SET NOT NULL;
ALTER TABLE history_checkpoints ALTER COLUMN hash SET NOT NULL;

-- The decision keys of archived operations, in two plain generations (not a partitioned
-- table: a look-up by key cannot be pruned to a day, design section 15), so that
-- outbox_record_decision, with two index probes, returns the archived operation for a
-- retried decision instead of creating a second one. Each key row holds what that
-- answer and the agent's await_outcome read of the operation, never its input (version
-- 16, below): the answer outlives the day's partition. The current
-- generation takes new keys; the other one is truncated, and becomes the current one,
-- once every key in it is older than the retention (outbox_history_rotate_keys): keys
-- are remembered at least as long as the retention, at most twice as long.
CREATE TABLE IF NOT EXISTS history_keys_0 (
    run_id        text NOT NULL,
    decision_key  text NOT NULL,
    operation_id  uuid NOT NULL,
    settled_on    date NOT NULL,
    operation     jsonb NOT NULL,
    PRIMARY KEY (run_id, decision_key)
);
CREATE TABLE IF NOT EXISTS history_keys_1 (
    run_id        text NOT NULL,
    decision_key  text NOT NULL,
    operation_id  uuid NOT NULL,
    settled_on    date NOT NULL,
    operation     jsonb NOT NULL,
    PRIMARY KEY (run_id, decision_key)
);
CREATE TABLE IF NOT EXISTS history_key_generations (
    generation  smallint PRIMARY KEY CHECK (generation IN (0, 1)),
    current     boolean NOT NULL,
    since       timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO history_key_generations (generation, current) VALUES (0, true), (1, false)
ON CONFLICT (generation) DO NOTHING;

-- Version 17: a key row holds the operation's columns, typed, instead of the whole row as
-- jsonb (1,100.1 bytes a key row measured with it, docs/capacity.md): every column of
-- the operation that the agent reads back (a retried decision's Operation, an archived
-- outcome) and that a settled operation can hold a value of its own in, named as in
-- operations, the fingerprint as its 32 bytes. Not kept: the input (never the agent's to
-- read back), lease_owner and lease_expires_at (NULL on every settled operation,
-- operations_lease_consistent), waiting_since (a commit clears it, and a retry answered
-- from the hot tables does not return it either) and recorded_by (read only of hot
-- operations). Rows written before version 17 keep their jsonb, stay readable
-- (outbox_history_key_operation, below) and leave with their generation: nothing is
-- rewritten, since a rewrite would hold the table, and every decision's probe of it,
-- for as long as it takes to copy up to twice the retention's keys. The columns are
-- added NULL without a default (no rewrite, no scan), so the constraint below says what
-- a version 17 row holds; NOT VALID, as every older row holds its jsonb and satisfies it
-- already, and a validation would read the whole table under its lock.
DO $$
DECLARE
    generation text;
BEGIN
    FOREACH generation IN ARRAY ARRAY['history_keys_0', 'history_keys_1'] LOOP
        EXECUTE format(
            'ALTER TABLE %1$I ALTER COLUMN operation DROP NOT NULL, '
            'ADD COLUMN IF NOT EXISTS created_at timestamptz, '
            'ADD COLUMN IF NOT EXISTS updated_at timestamptz, '
            'ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz, '
            'ADD COLUMN IF NOT EXISTS first_attempt_at timestamptz, '
            'ADD COLUMN IF NOT EXISTS lease_token bigint, '
            'ADD COLUMN IF NOT EXISTS tool_version integer, '
            'ADD COLUMN IF NOT EXISTS attempts integer, '
            'ADD COLUMN IF NOT EXISTS reconcile_attempts integer, '
            'ADD COLUMN IF NOT EXISTS requires_approval boolean, '
            'ADD COLUMN IF NOT EXISTS effect_possible boolean, '
            'ADD COLUMN IF NOT EXISTS state text, '
            'ADD COLUMN IF NOT EXISTS tool_name text, '
            'ADD COLUMN IF NOT EXISTS side_effect text, '
            'ADD COLUMN IF NOT EXISTS fingerprint bytea, '
            'ADD COLUMN IF NOT EXISTS provider_reference text, '
            'ADD COLUMN IF NOT EXISTS last_error_class text, '
            'ADD COLUMN IF NOT EXISTS result jsonb', generation);
        IF NOT EXISTS (SELECT 1 FROM pg_constraint c
                       WHERE c.conrelid = to_regclass(generation)
                         AND c.conname = generation || '_row') THEN
            EXECUTE format(
                'ALTER TABLE %1$I ADD CONSTRAINT %2$I CHECK (operation IS NOT NULL OR ('
                'state IN (''committed'', ''rejected'') AND octet_length(fingerprint) = 32 '
                'AND tool_name IS NOT NULL AND tool_version IS NOT NULL '
                'AND side_effect IS NOT NULL AND requires_approval IS NOT NULL '
                'AND attempts IS NOT NULL AND reconcile_attempts IS NOT NULL '
                'AND lease_token IS NOT NULL AND next_attempt_at IS NOT NULL '
                'AND effect_possible IS NOT NULL AND created_at IS NOT NULL '
                'AND updated_at IS NOT NULL)) NOT VALID', generation, generation || '_row');
        END IF;
    END LOOP;
END;
$$;

-- A key row as the operation it names, without the input, as jsonb (what
-- jsonb_populate_record(NULL::operations, ...) reads, as outbox_record_decision and the
-- agent's archived_outcomes do): a version 17 row from its columns, an older one as it
-- was written. One per generation, whose row types differ. SQL-standard bodies: bound
-- here; executable by anyone, as they read nothing but the row they are given.
CREATE OR REPLACE FUNCTION outbox_history_key_operation(k history_keys_0) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce(k.operation, to_jsonb(k) || jsonb_build_object(
    'id', k.operation_id, 'input_fingerprint', encode(k.fingerprint, 'hex')));
CREATE OR REPLACE FUNCTION outbox_history_key_operation(k history_keys_1) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce(k.operation, to_jsonb(k) || jsonb_build_object(
    'id', k.operation_id, 'input_fingerprint', encode(k.fingerprint, 'hex')));

-- The checkpoint digest of a set of chain heads (see history_checkpoints). Python's
-- outbox/history_file.py computes the same from an export.
CREATE OR REPLACE FUNCTION outbox_history_digest_line(p_operation_id uuid, p_events integer,
                                                      p_last_hash text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN p_operation_id::text || ' ' || p_events::text || ' ' || coalesce(p_last_hash, '-');

-- The day's partition of history, created when missing (as the owner: the partition is
-- the owner's, and readable only through history's own grants).
CREATE OR REPLACE FUNCTION outbox_history_partition(p_day date) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    partition_name text := 'history_p' || to_char(p_day, 'YYYYMMDD');
BEGIN
    IF to_regclass('@schema@.' || quote_ident(partition_name)) IS NULL THEN
        EXECUTE format('CREATE TABLE IF NOT EXISTS @schema@.%I PARTITION OF @schema@.history '
                       'FOR VALUES FROM (%L) TO (%L)', partition_name, p_day, p_day + 1);
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox_history_partition(date) FROM PUBLIC;

-- Version 15: whether nothing of an operation waits to be done here: no outbox row to
-- publish (a dispatcher could be about to), no callback to apply, no agent report to
-- chain. The move asks it of each candidate twice (below): before it tries the
-- candidate's locks, and again under them. A SQL-standard body: bound here.
CREATE OR REPLACE FUNCTION outbox_history_quiet(p_operation_id uuid) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN NOT EXISTS (SELECT 1 FROM outbox x
                   WHERE x.operation_id = p_operation_id AND x.published_at IS NULL)
       AND NOT EXISTS (SELECT 1 FROM callbacks c
                       WHERE c.operation_id = p_operation_id AND c.applied_at IS NULL)
       AND NOT EXISTS (SELECT 1 FROM agent_reports r WHERE r.operation_id = p_operation_id);

-- Move one batch of settled operations older than p_hot into history, in the caller's
-- transaction (the command commits each batch on its own). Only committed and rejected
-- operations, which nothing moves again (the transition trigger says terminal), and
-- only quiet ones: no unpublished outbox row, no callback waiting to be applied, no
-- agent report waiting to be chained, and none whose row, callback lock or report lock
-- another session holds (SKIP LOCKED, try-locks: the move waits for nobody and stops
-- nobody). Escalations, waiting and unfinished operations never move. Returns one
-- checkpoint per day the batch touched; nothing when there was nothing to move.
--
-- Version 15: the advisory locks are taken one candidate at a time, in PL/pgSQL, never
-- in a query's WHERE. There the planner chose where they ran: when it sorted (tables
-- not yet analyzed; analyzed, a batch of 2,000 of 20,000 operations), it took both
-- locks for every eligible operation before the sort and the LIMIT, and held them to
-- the commit, one lock-table entry each: a first archive of 18,445 settled operations
-- failed with "out of shared memory" (SQLSTATE 53200). Now a window of the oldest
-- candidates is read without a lock (the index on (updated_at, id), walked on from
-- where the last window stopped); each candidate's two locks are tried in a
-- subtransaction, rolled back when either is held elsewhere, which lets go of the
-- other; the candidates locked are asked again whether they are quiet, and their rows
-- taken (SKIP LOCKED). A batch holds at most two advisory locks for each operation it
-- may move, whatever the plan, and passes over an operation another session holds at
-- no cost, however many there are. At most 1,000 operations: 2,000 locks, under a
-- third of the default lock table (64 locks a transaction times 100 connections,
-- shared by every session).
--
-- Two planner settings, for tables not yet analyzed (a first archive after a restore,
-- or of a backlog written in bulk): no sort, so that each window walks the index
-- rather than sorting every eligible operation for a few hundred (380 ms of a batch's
-- 800 ms at 184,000 eligible; what else the move sorts is a batch at most, and still
-- sorted); and no JIT, whose compiling of the copy, its estimate past the thresholds,
-- took 0.85 s of a batch's 1.1 s.
CREATE OR REPLACE FUNCTION outbox_history_archive(p_hot interval, p_batch integer)
RETURNS TABLE (settled_on date, operations integer, events bigint, digest text)
LANGUAGE plpgsql SECURITY DEFINER
SET lock_timeout = '2s'
SET jit = off
SET enable_sort = off
AS $$
DECLARE
    moving uuid[] := '{}';
    locked uuid[] := '{}';
    window_locked uuid[];
    picked uuid[];
    headed uuid[];
    candidate record;
    after_at timestamptz := '-infinity';
    after_id uuid := '00000000-0000-0000-0000-000000000000';
    cutoff timestamptz;
    wanted integer;
    window_size integer;
    seen integer;
    day date;
    key_generation smallint;
BEGIN
    IF p_hot IS NULL OR p_hot < interval '0' OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'the hot window is a duration of at least 0 and the batch at least 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := now() - p_hot;
    wanted := least(p_batch, 1000);
    -- The current key generation, held against a rotation until this batch commits.
    SELECT g.generation INTO key_generation
    FROM @schema@.history_key_generations g WHERE g.current FOR SHARE;
    LOOP
        -- Each candidate locked counts against the batch, moved or not: the locks are
        -- held to the commit.
        window_size := wanted - cardinality(locked);
        EXIT WHEN window_size < 1;
        seen := 0;
        window_locked := '{}';
        FOR candidate IN
            SELECT o.id, o.updated_at
            FROM @schema@.operations o
            WHERE o.state IN ('committed', 'rejected')
              AND o.updated_at < cutoff
              AND (o.updated_at, o.id) > (after_at, after_id)
              AND @schema@.outbox_history_quiet(o.id)
            ORDER BY o.updated_at, o.id
            LIMIT window_size
        LOOP
            seen := seen + 1;
            after_at := candidate.updated_at;
            after_id := candidate.id;
            BEGIN
                IF NOT pg_try_advisory_xact_lock(
                           hashtextextended('outbox.agent_reports:' || candidate.id::text, 0))
                   OR NOT pg_try_advisory_xact_lock(
                           @schema@.outbox_callback_lock_key(candidate.id)) THEN
                    RAISE EXCEPTION USING ERRCODE = 'lock_not_available';
                END IF;
                window_locked := window_locked || candidate.id;
            EXCEPTION WHEN lock_not_available THEN
                -- Another session holds one of the two: the rollback of this block let
                -- go of the one taken, and the operation waits for a later batch.
                NULL;
            END;
        END LOOP;
        locked := locked || window_locked;
        -- Asked again under the locks: a report or a callback committed since the
        -- window was read keeps its operation here.
        SELECT array_agg(ready.id) INTO picked FROM (
            SELECT o.id
            FROM @schema@.operations o
            WHERE o.id = ANY (window_locked)
              AND o.state IN ('committed', 'rejected')
              AND o.updated_at < cutoff
              AND @schema@.outbox_history_quiet(o.id)
            FOR UPDATE OF o SKIP LOCKED
        ) AS ready;
        -- Version 19: and their heads (SKIP LOCKED again), which an append to an
        -- operation holds until it commits and which no foreign key guards any more: an
        -- append that took one first commits before this batch reads the events; one
        -- that comes after waits, then finds the head gone and the operation with it,
        -- and is refused (outbox_chain_event). An operation without a head (no event was
        -- ever chained for it) has nothing to hold.
        SELECT array_agg(h.operation_id) INTO headed FROM (
            SELECT hd.operation_id
            FROM @schema@.operation_event_heads hd
            WHERE hd.operation_id = ANY (picked)
            FOR UPDATE SKIP LOCKED
        ) AS h;
        SELECT array_agg(p.id) INTO picked
        FROM unnest(picked) AS p (id)
        WHERE p.id = ANY (coalesce(headed, '{}'))
           OR NOT EXISTS (SELECT 1 FROM @schema@.operation_event_heads hd
                          WHERE hd.operation_id = p.id);
        moving := moving || coalesce(picked, '{}');
        -- A short window: nothing older than the hot window is left to look at.
        EXIT WHEN seen < window_size;
    END LOOP;
    IF cardinality(moving) = 0 THEN
        RETURN;
    END IF;
    FOR day IN
        SELECT DISTINCT (o.updated_at AT TIME ZONE 'UTC')::date
        FROM @schema@.operations o WHERE o.id = ANY (moving)
    LOOP
        PERFORM @schema@.outbox_history_partition(day);
    END LOOP;
    -- The next day to become eligible, ahead of time.
    PERFORM @schema@.outbox_history_partition(((now() - p_hot) AT TIME ZONE 'UTC')::date + 1);

    RETURN QUERY
    WITH archived AS (
        INSERT INTO @schema@.history AS h
            (settled_on, operation_id, run_id, decision_key, state, settled_at, operation,
             events, "callbacks", "approvals", "agent_reports", event_count, last_hash)
        SELECT (o.updated_at AT TIME ZONE 'UTC')::date, o.id, o.run_id, o.decision_key,
               o.state, o.updated_at, to_jsonb(o),
               coalesce((SELECT jsonb_agg(jsonb_build_object(
                                    'id', e.id, 'seq', e.seq, 'name', e.name,
                                    'attributes', e.attributes,
                                    'created_at', to_char(e.created_at AT TIME ZONE 'UTC',
                                                          'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                                    'prev_hash', encode(e.prev_hash, 'hex'),
                                    'hash', encode(e.hash, 'hex')) ORDER BY e.seq, e.id)
                         FROM @schema@.operation_events e WHERE e.operation_id = o.id),
                        '[]'::jsonb),
               coalesce((SELECT jsonb_agg(to_jsonb(c) ORDER BY c.id)
                         FROM @schema@.callbacks c WHERE c.operation_id = o.id), '[]'::jsonb),
               coalesce((SELECT jsonb_agg(to_jsonb(a) ORDER BY a.created_at, a.id)
                         FROM @schema@.approvals a WHERE a.operation_id = o.id), '[]'::jsonb),
               coalesce((SELECT jsonb_agg(to_jsonb(r) ORDER BY r.id)
                         FROM @schema@.agent_reports r WHERE r.operation_id = o.id),
                        '[]'::jsonb),
               coalesce(hd.events, 0), encode(hd.last_hash, 'hex')
        FROM @schema@.operations o
        LEFT JOIN @schema@.operation_event_heads hd ON hd.operation_id = o.id
        WHERE o.id = ANY (moving)
        RETURNING h.settled_on, h.operation_id, h.event_count, h.last_hash
    ), checkpoint AS (
        INSERT INTO @schema@.history_checkpoints AS k
            (kind, settled_on, "operations", events, digest)
        SELECT 'archived', a.settled_on, count(*), sum(a.event_count),
               encode(sha256(convert_to(string_agg(
                   @schema@.outbox_history_digest_line(a.operation_id, a.event_count,
                                                       a.last_hash),
                   E'\n' ORDER BY a.operation_id), 'UTF8')), 'hex')
        FROM archived a
        GROUP BY a.settled_on
        RETURNING k.settled_on, k.operations, k.events, k.digest
    )
    SELECT c.settled_on, c.operations, c.events, c.digest FROM checkpoint c;

    IF key_generation = 0 THEN
        INSERT INTO @schema@.history_keys_0
            (run_id, decision_key, operation_id, settled_on, created_at, updated_at,
             next_attempt_at, first_attempt_at, lease_token, tool_version, attempts,
             reconcile_attempts, requires_approval, effect_possible, state, tool_name,
             side_effect, fingerprint, provider_reference, last_error_class, result)
        SELECT o.run_id, o.decision_key, o.id, (o.updated_at AT TIME ZONE 'UTC')::date,
               o.created_at, o.updated_at, o.next_attempt_at, o.first_attempt_at,
               o.lease_token, o.tool_version, o.attempts, o.reconcile_attempts,
               o.requires_approval, o.effect_possible, o.state, o.tool_name, o.side_effect,
               decode(o.input_fingerprint, 'hex'), o.provider_reference, o.last_error_class,
               o.result
        FROM @schema@.operations o
        WHERE o.id = ANY (moving) AND o.decision_key IS NOT NULL
        ON CONFLICT DO NOTHING;
    ELSE
        INSERT INTO @schema@.history_keys_1
            (run_id, decision_key, operation_id, settled_on, created_at, updated_at,
             next_attempt_at, first_attempt_at, lease_token, tool_version, attempts,
             reconcile_attempts, requires_approval, effect_possible, state, tool_name,
             side_effect, fingerprint, provider_reference, last_error_class, result)
        SELECT o.run_id, o.decision_key, o.id, (o.updated_at AT TIME ZONE 'UTC')::date,
               o.created_at, o.updated_at, o.next_attempt_at, o.first_attempt_at,
               o.lease_token, o.tool_version, o.attempts, o.reconcile_attempts,
               o.requires_approval, o.effect_possible, o.state, o.tool_name, o.side_effect,
               decode(o.input_fingerprint, 'hex'), o.provider_reference, o.last_error_class,
               o.result
        FROM @schema@.operations o
        WHERE o.id = ANY (moving) AND o.decision_key IS NOT NULL
        ON CONFLICT DO NOTHING;
    END IF;

    -- The append-only and heads guards let these deletes through (outbox_history_moving),
    -- for this transaction only, and only as the owner this function runs as.
    PERFORM set_config('outbox.history_move', 'on', true);
    DELETE FROM @schema@.outbox x WHERE x.operation_id = ANY (moving);
    DELETE FROM @schema@.operation_events e WHERE e.operation_id = ANY (moving);
    DELETE FROM @schema@.operation_event_heads hd WHERE hd.operation_id = ANY (moving);
    DELETE FROM @schema@.callbacks c WHERE c.operation_id = ANY (moving);
    DELETE FROM @schema@.approvals a WHERE a.operation_id = ANY (moving);
    DELETE FROM @schema@.agent_reports r WHERE r.operation_id = ANY (moving);
    DELETE FROM @schema@.provider_calls p WHERE p.operation_id = ANY (moving);
    DELETE FROM @schema@.operations o WHERE o.id = ANY (moving);
    PERFORM set_config('outbox.history_move', 'off', true);
END;
$$;
REVOKE ALL ON FUNCTION outbox_history_archive(interval, integer) FROM PUBLIC;

-- Version 16: a day's digest in blocks. One string of every line of a day cannot pass
-- Postgres's 1 GB bound on a value: at about 105 bytes a line, a day of more than about
-- ten million operations failed its export's and its drop's checkpoint ("Cannot enlarge
-- string buffer"), so retention stopped at the rates capacity.md sizes for. The lines,
-- in operation id order, are cut into blocks of outbox_history_digest_block() lines. A
-- day of one block keeps the digest it always had (the SHA-256 of its lines, joined by
-- newlines); a longer day's is the SHA-256 of its blocks' digests, hex, joined by
-- newlines (such a line has no space, so it is never an operation's line). An archive
-- batch moves at most 1,000 operations, one block: its checkpoint's digest above is
-- this one's. Python's outbox/history_file.py computes the same from an export.
CREATE OR REPLACE FUNCTION outbox_history_digest_block() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 100000;

-- What one whole day of history holds now, in blocks of p_block lines (a test's small
-- blocks; outbox_history_day below uses the schema's).
CREATE OR REPLACE FUNCTION outbox_history_day_blocks(p_day date, p_block integer)
RETURNS TABLE (operations integer, events bigint, digest text)
LANGUAGE sql STABLE
BEGIN ATOMIC
    WITH numbered AS (
        SELECT h.operation_id, h.event_count, h.last_hash,
               (row_number() OVER (ORDER BY h.operation_id) - 1) / p_block AS block
        FROM history h
        WHERE h.settled_on = p_day
    ), blocks AS (
        SELECT n.block, count(*) AS operations, sum(n.event_count) AS events,
               encode(sha256(convert_to(string_agg(
                   outbox_history_digest_line(n.operation_id, n.event_count, n.last_hash),
                   E'\n' ORDER BY n.operation_id), 'UTF8')), 'hex') AS digest
        FROM numbered n
        GROUP BY n.block
    )
    SELECT coalesce(sum(b.operations), 0)::integer, coalesce(sum(b.events), 0)::bigint,
           CASE WHEN count(*) > 1
                THEN encode(sha256(convert_to(string_agg(b.digest, E'\n' ORDER BY b.block),
                                              'UTF8')), 'hex')
                ELSE coalesce(min(b.digest), encode(sha256(''::bytea), 'hex'))
           END
    FROM blocks b;
END;

-- What one whole day of history holds now, as a checkpoint states it: how many
-- operations and events, and the digest of their heads. Read as the caller (an
-- operator's export compares its snapshot with the checkpoint it recorded), and by the
-- function below. A SQL-standard body: bound here, nothing looked up at run time.
CREATE OR REPLACE FUNCTION outbox_history_day(p_day date)
RETURNS TABLE (operations integer, events bigint, digest text)
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT d.operations, d.events, d.digest
    FROM outbox_history_day_blocks(p_day, outbox_history_digest_block()) d;
END;

-- Version 14: the checkpoint function returns the whole row, its id and place in the
-- chain included (an export's first line carries them, for `ops verify --archive` to
-- find the row again). A function's result type cannot be changed in place: the
-- version 13 one is dropped once, and whoever could execute it may execute the new one
-- (its grants are carried over here, so a migration without --roles keeps them).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc p
               WHERE p.oid = to_regprocedure('outbox_history_checkpoint(date, text)')
                 AND NOT 'seq' = ANY (p.proargnames)) THEN
        PERFORM set_config('outbox.migrate_checkpoint_acl',
                           coalesce((SELECT p.proacl::text FROM pg_proc p WHERE p.oid =
                                         to_regprocedure('outbox_history_checkpoint(date, text)')),
                                    '{}'),
                           true);
        DROP FUNCTION outbox_history_checkpoint(date, text);
    END IF;
END;
$$;

-- A checkpoint of one whole day of history, as it is now: an export's (its first line)
-- and the day's before it is dropped. 'dropped' only for the tables' owner, who alone
-- can drop.
CREATE OR REPLACE FUNCTION outbox_history_checkpoint(p_day date, p_kind text)
RETURNS TABLE (id bigint, seq bigint, kind text, settled_on date, operations integer,
               events bigint, digest text, recorded_by name, recorded_at timestamptz,
               prev_hash text, hash text)
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF p_kind IS DISTINCT FROM 'exported' AND p_kind IS DISTINCT FROM 'dropped' THEN
        RAISE EXCEPTION 'a day''s checkpoint is exported or dropped'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_kind = 'dropped'
       AND NOT pg_has_role(session_user, (SELECT c.relowner FROM pg_class c
                                          WHERE c.oid = '@schema@.history'::regclass),
                           'MEMBER') THEN
        RAISE EXCEPTION 'only the owner of history drops a day of it'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN QUERY
    INSERT INTO @schema@.history_checkpoints AS k (kind, settled_on, "operations", events, digest)
    SELECT p_kind, p_day, d.operations, d.events, d.digest
    FROM @schema@.outbox_history_day(p_day) d
    RETURNING k.id, k.seq, k.kind, k.settled_on, k.operations, k.events, k.digest,
              k.recorded_by, k.recorded_at, encode(k.prev_hash, 'hex'), encode(k.hash, 'hex');
END;
$$;
REVOKE ALL ON FUNCTION outbox_history_checkpoint(date, text) FROM PUBLIC;
DO $$
DECLARE
    held record;
    carried text := coalesce(current_setting('outbox.migrate_checkpoint_acl', true), '');
BEGIN
    IF carried IN ('', '{}') THEN
        RETURN;
    END IF;
    FOR held IN
        SELECT DISTINCT g.rolname
        FROM aclexplode(carried::aclitem[]) a
        JOIN pg_roles g ON g.oid = a.grantee
        WHERE a.privilege_type = 'EXECUTE'
          AND a.grantee <> (SELECT p.proowner FROM pg_proc p
                            WHERE p.oid = to_regprocedure('outbox_history_checkpoint(date, text)'))
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION outbox_history_checkpoint(date, text) TO %I',
                       held.rolname);
    END LOOP;
    PERFORM set_config('outbox.migrate_checkpoint_acl', '', true);
END;
$$;

-- Truncate the older key generation once every key in it is older than p_retention, and
-- make it the current one; returns whether it did. The owner's alone (outbox history
-- drop): forgetting keys is what lets a decision key be used again.
CREATE OR REPLACE FUNCTION outbox_history_rotate_keys(p_retention interval) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET lock_timeout = '1s'
AS $$
DECLARE
    older smallint;
    newest date;
BEGIN
    PERFORM 1 FROM @schema@.history_key_generations g ORDER BY g.generation FOR UPDATE;
    SELECT g.generation INTO older FROM @schema@.history_key_generations g WHERE NOT g.current;
    IF older = 0 THEN
        SELECT max(k.settled_on) INTO newest FROM @schema@.history_keys_0 k;
    ELSE
        SELECT max(k.settled_on) INTO newest FROM @schema@.history_keys_1 k;
    END IF;
    IF newest IS NOT NULL AND newest >= ((now() - p_retention) AT TIME ZONE 'UTC')::date THEN
        RETURN false;
    END IF;
    IF older = 0 THEN
        TRUNCATE @schema@.history_keys_0;
    ELSE
        TRUNCATE @schema@.history_keys_1;
    END IF;
    UPDATE @schema@.history_key_generations g
    SET current = (g.generation = older), since = clock_timestamp();
    RETURN true;
END;
$$;
REVOKE ALL ON FUNCTION outbox_history_rotate_keys(interval) FROM PUBLIC;

-- Pin the search_path of every function of this schema that has a body parsed at run
-- time (plpgsql, or SQL in quotes) to pg_catalog and then pg_temp, where no function or
-- operator is ever looked up and a caller's temporary table can shadow nothing. This
-- schema is not on it: a role that may create objects here (PostgreSQL 14 and older let
-- every role create in public) could otherwise define an operator or function that fits
-- an expression better than the built-in one (text || integer) and have it run as the
-- caller, the tables' owner for a SECURITY DEFINER function. So every name a body
-- resolves at run time in this schema is written qualified, @schema@.operations, and
-- outbox/schema.py puts the schema's quoted name in place of @schema@ when it applies
-- this file (version 10). Functions with SQL-standard bodies were bound when they were
-- created and need no pin. tests/integration/hostile_values walks pg_proc for any
-- function this misses and for any unqualified name in a body.
DO $$
DECLARE
    unpinned regprocedure;
BEGIN
    FOR unpinned IN
        SELECT p.oid::regprocedure
        FROM pg_proc p
        WHERE p.pronamespace = current_schema()::regnamespace
          AND p.proname LIKE 'outbox\_%'
          AND p.prosqlbody IS NULL
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp', unpinned);
    END LOOP;
END;
$$;

-- Version 9: one verdict per provider on whether it can be reached (docs/design.md
-- section 9), shared through this row by every consumer and the reconciler. Closed:
-- calls go through. Open: nobody calls the provider; its operations wait and spend
-- nothing. Half-open: one probe (an attempt or a lookup) is out, under probe_owner
-- until probe_expires_at. A streak of calls that could not reach it, from several
-- operations and with no answer between them, opens it; any answer closes it. Only the
-- consumer writes it (roles.sql); what it decides is outbox/breaker.py's.
CREATE TABLE IF NOT EXISTS provider_health (
    provider            text PRIMARY KEY CHECK (provider ~ '^[a-z][a-z0-9_.-]{0,63}$'),
    state               text NOT NULL DEFAULT 'closed'
                            CHECK (state IN ('closed', 'open', 'half_open')),
    failing_operations  uuid[] NOT NULL DEFAULT '{}'
                            CHECK (cardinality(failing_operations) <= 100),
    failing_since       timestamptz CHECK (outbox_plausible_time(failing_since)),
    last_failure        text CHECK (last_failure ~ '^[a-z0-9][a-z0-9_.-]{0,63}$'),
    outage_started_at   timestamptz CHECK (outbox_plausible_time(outage_started_at)),
    opened_at           timestamptz CHECK (outbox_plausible_time(opened_at)),
    probes              integer NOT NULL DEFAULT 0 CHECK (probes >= 0),
    next_probe_at       timestamptz CHECK (outbox_plausible_time(next_probe_at)),
    probe_owner         text CHECK (length(probe_owner) <= 200),
    probe_expires_at    timestamptz CHECK (outbox_plausible_time(probe_expires_at)),
    -- The provider's Retry-After: no call to it before this, from any process.
    not_before          timestamptz CHECK (outbox_plausible_time(not_before)),
    -- A declared rate (ProviderLimits), as GCRA keeps it: the theoretical arrival time
    -- of the next call. Each call books one interval past it; one whose turn is in the
    -- future waits in hand for it.
    rate_tat            timestamptz CHECK (outbox_plausible_time(rate_tat)),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT provider_health_probe_consistent CHECK (
        (probe_owner IS NULL) = (probe_expires_at IS NULL)
        AND (state = 'half_open') = (probe_owner IS NOT NULL)
        AND (state = 'closed') = (outage_started_at IS NULL)
    )
);

-- What an outage was, for the operator: one provider.unavailable when the breaker
-- opens and one provider.available when it closes (with how long, how many probes and
-- how many operations waited). Appended by the consumer, never changed (no UPDATE or
-- DELETE is granted to anyone).
CREATE TABLE IF NOT EXISTS provider_events (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider    text NOT NULL CHECK (provider ~ '^[a-z][a-z0-9_.-]{0,63}$'),
    name        text NOT NULL CHECK (name IN ('provider.unavailable', 'provider.available')),
    attributes  jsonb NOT NULL DEFAULT '{}'::jsonb
                    CHECK (jsonb_typeof(attributes) = 'object'
                           AND octet_length(attributes::text) <= 4096),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS provider_events_provider ON provider_events (provider, id);

-- The calls out to a provider that declares how many it takes at once
-- (ProviderLimits.concurrent_calls): one row per call, taken under the breaker row's
-- lock and removed when the call ends; a holder that dies leaves a row that counts until
-- it expires (the call's deadline and the lease margin: no call outlives that).
CREATE TABLE IF NOT EXISTS provider_calls (
    provider      text NOT NULL CHECK (provider ~ '^[a-z][a-z0-9_.-]{0,63}$'),
    operation_id  uuid NOT NULL,
    expires_at    timestamptz NOT NULL CHECK (outbox_plausible_time(expires_at)),
    PRIMARY KEY (provider, operation_id)
);

-- Version 12: the record of every dead letter an operator discarded (`outbox dlq
-- discard`, the console's dead-letter page), written and committed before the message
-- is removed from the dead-letter queue: a discard is an audit fact, never a silent
-- purge. The body is kept only as its SHA-256 and size (it may hold anything a
-- publisher chose). What the envelope named, where it parsed: the operations and their
-- tools. Appended by operators, never changed (no UPDATE or DELETE is granted to
-- anyone); who recorded it and when are the database's.
CREATE TABLE IF NOT EXISTS discarded_dead_letters (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id     text CHECK (length(message_id) BETWEEN 1 AND 300),
    operation_ids  uuid[] NOT NULL DEFAULT '{}' CHECK (cardinality(operation_ids) <= 1000),
    tools          text[] NOT NULL DEFAULT '{}'
                       CHECK (cardinality(tools) <= 1000
                              AND octet_length(array_to_string(tools, ',')) <= 65536),
    body_sha256    text NOT NULL CHECK (body_sha256 ~ '^[0-9a-f]{64}$'),
    body_bytes     bigint NOT NULL CHECK (body_bytes >= 0),
    death_reason   text CHECK (length(death_reason) BETWEEN 1 AND 300),
    died_at        timestamptz,
    reason         text NOT NULL CHECK (length(reason) BETWEEN 1 AND 500),
    discarded_by   text NOT NULL CHECK (length(discarded_by) BETWEEN 1 AND 200),
    recorded_as    name NOT NULL DEFAULT current_user,
    discarded_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS discarded_dead_letters_at ON discarded_dead_letters (discarded_at);

INSERT INTO outbox_schema_version (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (2) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (3) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (4) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (5) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (6) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (7) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (8) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (9) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (10) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (11) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (12) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (13) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (14) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (15) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (16) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (17) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (18) ON CONFLICT (version) DO NOTHING;
INSERT INTO outbox_schema_version (version) VALUES (19) ON CONFLICT (version) DO NOTHING;
