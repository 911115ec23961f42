-- Every admin action, allowed or denied, from the CLI (and the console):
-- who (the database role, or a token's name; never $USER), what, on what,
-- why, with what result (SPEC §16). Append-only: UPDATE, DELETE and
-- TRUNCATE are refused. Each row's hash covers its fields and the hash of
-- the row before, so a row changed or removed behind the triggers' back
-- breaks the chain (`outbox-relay admin log verify`). The CLI applies this
-- file itself on a database never migrated, so it runs twice safely.
CREATE TABLE IF NOT EXISTS outbox_admin_log (
    seq        bigint      PRIMARY KEY,
    at         timestamptz NOT NULL,
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

-- The fields as one JSON array (jsonb's text is canonical: no separator
-- can be forged inside a field), hashed with the row before's hash.
CREATE OR REPLACE FUNCTION outbox_admin_log_hash(l outbox_admin_log) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT encode(sha256(convert_to(jsonb_build_array(
        l.prev_hash, l.seq, (extract(epoch FROM l.at) * 1000000)::bigint,
        l.actor, l.role, l.action, l.target, l.selection, l.reason, l.result,
        l.request_id)::text, 'UTF8')), 'hex')
$$;

-- One writer at a time (the lock lasts until commit), so the sequence and
-- the chain follow commit order.
CREATE OR REPLACE FUNCTION outbox_admin_log_chain() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('outbox_admin_log'));
    SELECT l.seq + 1, l.hash INTO NEW.seq, NEW.prev_hash
        FROM outbox_admin_log l ORDER BY l.seq DESC LIMIT 1;
    NEW.seq := coalesce(NEW.seq, 1);
    NEW.prev_hash := coalesce(NEW.prev_hash, '');
    NEW.at := clock_timestamp();
    NEW.hash := outbox_admin_log_hash(NEW);
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
