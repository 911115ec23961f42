-- no-transaction
-- The audit (SPEC §14) and prune find a window of the outbox by
-- occurred_at: without this index each run reads the whole table, whose
-- size is the retention, not the window. Built CONCURRENTLY so producers
-- keep writing while it builds on a large table; a build that failed
-- leaves an invalid index, which `DROP INDEX CONCURRENTLY
-- outbox_events_occurred_at` clears for the next `migrate`.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_occurred_at
    ON outbox_events (occurred_at);
