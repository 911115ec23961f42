-- Explicit resets of a durable (`outbox-relay consumer reset`). A message of
-- that stream between from_seq and to_seq (the stream's end at the reset)
-- whose inbox row was processed before reset_at goes to the handler once
-- more; an ordinary redelivery, or a later copy of it, stays a duplicate.
-- Also the audit trail: who reset what, and when.
CREATE TABLE IF NOT EXISTS inbox_resets (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer  text        NOT NULL,
    stream    text        NOT NULL,
    from_seq  bigint      NOT NULL CHECK (from_seq >= 1),
    to_seq    bigint      NOT NULL,
    reset_at  timestamptz NOT NULL DEFAULT now(),
    reset_by  text        NOT NULL
);
CREATE INDEX IF NOT EXISTS inbox_resets_consumer ON inbox_resets (consumer, stream);
