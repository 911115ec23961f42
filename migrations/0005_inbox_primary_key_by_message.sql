-- Swap the primary key to the index 0004 built: no table scan, only a brief
-- exclusive lock, which waits at most 10 s for running transactions on the
-- inbox (then the migration fails, changes nothing, and can be run again).
SET LOCAL lock_timeout = '10s';
DO $$
DECLARE
    valid boolean;
BEGIN
    SELECT indisvalid INTO valid FROM pg_index
     WHERE indexrelid = to_regclass('inbox_messages_message_consumer');
    IF valid IS NULL THEN
        RETURN; -- already the primary key (renamed to inbox_messages_pkey)
    ELSIF NOT valid THEN
        RAISE EXCEPTION 'index inbox_messages_message_consumer is invalid (its build was interrupted): run DROP INDEX CONCURRENTLY inbox_messages_message_consumer; then migrate again';
    END IF;
    ALTER TABLE inbox_messages
        DROP CONSTRAINT inbox_messages_pkey,
        ADD CONSTRAINT inbox_messages_pkey PRIMARY KEY USING INDEX inbox_messages_message_consumer;
END $$;
