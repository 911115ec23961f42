-- Deletions of dead letters through the console (SPEC §16): a request
-- with its reason, kept (and its letters with it) until a second admin
-- approves it, or a first one where the console allows one approval. One
-- per idempotency key.
CREATE TABLE IF NOT EXISTS outbox_admin_deletions (
    id               uuid        PRIMARY KEY,
    idempotency_key  text        NOT NULL UNIQUE,
    plan_id          text        NOT NULL,
    selection        jsonb       NOT NULL,
    reason           text        NOT NULL,
    requested_by     text        NOT NULL,
    requested_at     timestamptz NOT NULL DEFAULT now(),
    -- pending, deleted, rejected, failed
    state            text        NOT NULL,
    decided_by       text        NULL,
    decided_at       timestamptz NULL,
    -- each letter's result, once deleted
    result           jsonb       NULL
);
