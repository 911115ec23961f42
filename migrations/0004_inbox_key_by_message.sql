-- no-transaction
-- The inbox's key, message id first (made the primary key by 0005). With
-- the consumer first, a durable new to a large inbox is estimated at one
-- row until the next ANALYZE, and the planner then finds its completions
-- by scanning all of that durable's rows (`consumer = $1` as the only index
-- condition): each batch gets slower as the inbox grows. With the message
-- id first, `message_id = ANY($2)` is always the index condition. Built
-- without blocking writers to a large inbox.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS inbox_messages_message_consumer
    ON inbox_messages (message_id, consumer);
