-- Swap the primary key to the index 0004 built: no table scan, only a brief
-- exclusive lock, which waits at most 10 s for running transactions on the
-- inbox (then the migration fails, changes nothing, and can be run again).
SET LOCAL lock_timeout = '10s';
DO $$
DECLARE
    first_column text;
    valid boolean;
BEGIN
    SELECT a.attname INTO first_column
      FROM pg_index i
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
     WHERE i.indexrelid = to_regclass('inbox_messages_pkey');
    IF first_column = 'message_id' THEN
        RETURN; -- swapped already
    END IF;
    SELECT indisvalid INTO valid FROM pg_index
     WHERE indexrelid = to_regclass('inbox_messages_message_consumer');
    IF valid IS NULL OR NOT valid THEN
        RAISE EXCEPTION 'index inbox_messages_message_consumer is missing or invalid (its build was interrupted): run DROP INDEX CONCURRENTLY IF EXISTS inbox_messages_message_consumer; then DELETE FROM _sqlx_migrations WHERE version = 4; and migrate again';
    END IF;
    ALTER TABLE inbox_messages
        DROP CONSTRAINT inbox_messages_pkey,
        ADD CONSTRAINT inbox_messages_pkey PRIMARY KEY USING INDEX inbox_messages_message_consumer;
END $$;
