-- Replayed dead letters (`outbox-relay dlq replay`): who replayed which, and
-- when. The key makes a second replay of the same dead letter a no-op that
-- is reported, not a second handler call.
CREATE TABLE IF NOT EXISTS dlq_replays (
    dlq_stream  text        NOT NULL,
    dlq_seq     bigint      NOT NULL,
    consumer    text        NOT NULL,
    message_id  uuid        NOT NULL,
    replayed_at timestamptz NOT NULL DEFAULT now(),
    replayed_by text        NOT NULL,
    PRIMARY KEY (dlq_stream, dlq_seq)
);
