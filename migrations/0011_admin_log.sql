-- Every admin action from the CLI (and the console): who (the database
-- role it ran as; a token's name once the console is built; never $USER),
-- what, on what, why, with what result (SPEC §16). Append-only: UPDATE,
-- DELETE and TRUNCATE are refused. Each row's hash covers its fields and
-- the hash of the row before; `outbox-relay admin log verify` recomputes
-- them itself. `outbox-relay migrate --admin-log-only` applies this file
-- alone (a team's own database, which needs no other table of ours), so
-- it runs twice safely.
CREATE TABLE IF NOT EXISTS outbox_admin_log (
    seq        bigint      PRIMARY KEY,
    at         timestamptz NOT NULL,
    -- Set by the trigger: the session's role, whatever the row claims.
    db_role    text        NOT NULL,
    actor      text        NOT NULL,
    role       text        NOT NULL,
    action     text        NOT NULL,
    target     text        NOT NULL,
    selection  jsonb       NOT NULL DEFAULT '{}'::jsonb,
    reason     text        NULL,
    result     text        NOT NULL,
    request_id text        NOT NULL,
    prev_hash  text        NOT NULL,
    hash       text        NOT NULL
);

-- The fields as one JSON array: jsonb's text is canonical, and no
-- separator can be forged inside a field. `verify` reads the same text
-- and hashes it in its own code, so replacing these functions fools no one.
CREATE OR REPLACE FUNCTION outbox_admin_log_canonical(l outbox_admin_log) RETURNS text
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT pg_catalog.jsonb_build_array(
        l.prev_hash, l.seq, (EXTRACT(epoch FROM l.at) * 1000000)::bigint,
        l.db_role, l.actor, l.role, l.action, l.target, l.selection, l.reason,
        l.result, l.request_id)::text
$$;

-- One writer at a time (the lock lasts until commit), so the sequence and
-- the chain follow commit order. Runs as the table's owner: a role that
-- may only insert still chains its row.
CREATE OR REPLACE FUNCTION outbox_admin_log_chain() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('outbox_admin_log'));
    SELECT l.seq + 1, l.hash INTO NEW.seq, NEW.prev_hash
        FROM outbox_admin_log l ORDER BY l.seq DESC LIMIT 1;
    NEW.seq := coalesce(NEW.seq, 1);
    NEW.prev_hash := coalesce(NEW.prev_hash, '');
    NEW.at := pg_catalog.clock_timestamp();
    NEW.db_role := session_user;
    -- The CLI's actor is its role: no row names another.
    IF NEW.role = 'cli' THEN
        NEW.actor := 'db:' || session_user;
    END IF;
    NEW.hash := pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
        outbox_admin_log_canonical(NEW), 'UTF8')), 'hex');
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION outbox_admin_log_refuse() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox_admin_log is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;

DROP TRIGGER IF EXISTS outbox_admin_log_chain ON outbox_admin_log;
CREATE TRIGGER outbox_admin_log_chain BEFORE INSERT ON outbox_admin_log
    FOR EACH ROW EXECUTE FUNCTION outbox_admin_log_chain();
DROP TRIGGER IF EXISTS outbox_admin_log_no_change ON outbox_admin_log;
CREATE TRIGGER outbox_admin_log_no_change BEFORE UPDATE OR DELETE ON outbox_admin_log
    FOR EACH ROW EXECUTE FUNCTION outbox_admin_log_refuse();
DROP TRIGGER IF EXISTS outbox_admin_log_no_truncate ON outbox_admin_log;
CREATE TRIGGER outbox_admin_log_no_truncate BEFORE TRUNCATE ON outbox_admin_log
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_admin_log_refuse();
