-- The outbox written by services, in the same transaction as their domain rows.
-- The WAL relay only reads it (through the replication slot); it never updates it.
CREATE TABLE IF NOT EXISTS outbox_events (
    id               uuid        PRIMARY KEY,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    event_type       text        NOT NULL,
    event_version    int         NOT NULL DEFAULT 1,
    payload          jsonb       NOT NULL,
    occurred_at      timestamptz NOT NULL DEFAULT now()
                     CONSTRAINT outbox_events_occurred_at_not_future
                     CHECK (occurred_at <= now() + interval '1 minute'),
    correlation_id   uuid        NULL,
    causation_id     uuid        NULL,
    subject          text        NULL,
    headers          jsonb       NULL,
    -- Kept for schema compatibility with polling relays; the WAL relay does not write them.
    published_at     timestamptz NULL,
    publish_attempts int         NOT NULL DEFAULT 0,
    publish_error    text        NULL
);

-- Consumer-side dedupe: one row per (consumer, message).
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer     text        NOT NULL,
    message_id   uuid        NOT NULL,
    subject      text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz NULL,
    attempts     int         NOT NULL DEFAULT 0,
    last_error   text        NULL,
    PRIMARY KEY (consumer, message_id),
    CONSTRAINT inbox_messages_processed_after_received
        CHECK (processed_at IS NULL OR processed_at >= received_at)
);
