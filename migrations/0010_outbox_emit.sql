-- The table-less outbox (SPEC §12): an event written straight into the WAL
-- as a transactional logical decoding message. It commits or rolls back
-- with the caller's transaction and is decoded in commit order with its
-- rows; no heap tuple, no index entry, nothing to vacuum or prune.
-- Bad arguments raise here, in the producer's own transaction.
CREATE OR REPLACE FUNCTION outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    event_version  int         DEFAULT 1,
    subject        text        DEFAULT NULL,
    headers        jsonb       DEFAULT NULL,
    correlation_id uuid        DEFAULT NULL,
    causation_id   uuid        DEFAULT NULL,
    occurred_at    timestamptz DEFAULT now(),
    id             uuid        DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    -- The content goes into the WAL as raw bytes, unconverted (rows are
    -- converted to the relay's UTF8): only a UTF8 database writes what the
    -- relay reads.
    IF current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'outbox_emit: the database encoding is %, and emitted events need UTF8; write outbox_events rows instead', current_setting('server_encoding') USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.aggregate_type IS NULL OR outbox_emit.aggregate_type = '' THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.aggregate_id IS NULL OR outbox_emit.aggregate_id = '' THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_id must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.event_type IS NULL OR outbox_emit.event_type = '' THEN
        RAISE EXCEPTION 'outbox_emit: event_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: payload must not be null (use ''{}''::jsonb for an empty one)' USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.event_version IS NULL OR outbox_emit.event_version < 1 THEN
        RAISE EXCEPTION 'outbox_emit: event_version must be 1 or more, not %', outbox_emit.event_version USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.subject = '' THEN
        RAISE EXCEPTION 'outbox_emit: subject must be NULL (the relay''s template) or a non-empty subject' USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.headers IS NOT NULL AND jsonb_typeof(outbox_emit.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox_emit: headers must be a JSON object, not %', jsonb_typeof(outbox_emit.headers) USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.occurred_at IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: occurred_at must not be null' USING ERRCODE = '22023';
    END IF;
    -- The same bound as outbox_events' CHECK.
    IF outbox_emit.occurred_at > now() + interval '1 minute' THEN
        RAISE EXCEPTION 'outbox_emit: occurred_at % is in the future', outbox_emit.occurred_at USING ERRCODE = '22023';
    END IF;
    IF outbox_emit.id IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: id must not be null' USING ERRCODE = '22023';
    END IF;
    -- Three lines: the fields (a JSON array, by position: no key names in
    -- the WAL), the headers (empty when NULL), the payload. JSON text never
    -- holds a raw newline, and the payload and headers stay the very text
    -- Postgres renders for a row's columns.
    PERFORM pg_logical_emit_message(
        true,
        'outbox-relay:event:v1',
        json_build_array(
            outbox_emit.id,
            outbox_emit.aggregate_type,
            outbox_emit.aggregate_id,
            outbox_emit.event_type,
            outbox_emit.event_version,
            (extract(epoch FROM outbox_emit.occurred_at) * 1000000)::int8,
            outbox_emit.correlation_id,
            outbox_emit.causation_id,
            outbox_emit.subject
        )::text
        || E'\n' || coalesce(outbox_emit.headers::text, '')
        || E'\n' || outbox_emit.payload::text
    );
    RETURN outbox_emit.id;
END
$$;
