-- Replayed dead letters (`outbox-relay dlq replay`): who replayed which, and
-- when. The key (the DLQ stream, its creation time, the dead letter's
-- sequence) makes a second replay of the same dead letter a no-op that is
-- reported. A replay is pending until the durable's claim of the message
-- uses it (used_at), which opens the inbox row for one more handler call.
CREATE TABLE IF NOT EXISTS dlq_replays (
    dlq_stream  text        NOT NULL,
    dlq_created timestamptz NOT NULL,
    dlq_seq     bigint      NOT NULL,
    consumer    text        NOT NULL,
    message_id  uuid        NOT NULL,
    replayed_at timestamptz NOT NULL DEFAULT now(),
    replayed_by text        NOT NULL,
    used_at     timestamptz NULL,
    PRIMARY KEY (dlq_stream, dlq_created, dlq_seq)
);
CREATE INDEX IF NOT EXISTS dlq_replays_pending
    ON dlq_replays (consumer, message_id) WHERE used_at IS NULL;
