-- no-transaction
-- The parked rows of one consumer, per aggregate, oldest first: small (a
-- partial index), and built without blocking writers to a large inbox.
CREATE INDEX CONCURRENTLY IF NOT EXISTS inbox_messages_parked
    ON inbox_messages (consumer, aggregate_key, stream_seq)
    WHERE parked_until IS NOT NULL AND processed_at IS NULL;
