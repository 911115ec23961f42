-- How many times a processed message was opened again for one more handler
-- call (a `consumer reset` or a `dlq replay`). It tells one dead-lettering
-- of a message from the next: the dead letter's Nats-Msg-Id carries it, so
-- the DLQ's duplicate window drops a retried publish of the same dead letter
-- but never the dead letter of a later failure.
ALTER TABLE inbox_messages ADD COLUMN IF NOT EXISTS reopened int NOT NULL DEFAULT 0;
