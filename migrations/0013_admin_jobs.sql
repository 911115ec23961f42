-- The console's replay jobs (SPEC §16): one per idempotency key, so the
-- same key never replays twice; each letter's result as it comes. A
-- letter is replayed at most once whatever the jobs (dlq_replays keys it
-- by its dead-letter stream and sequence).
CREATE TABLE IF NOT EXISTS outbox_admin_jobs (
    id              uuid        PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE,
    kind            text        NOT NULL,
    plan_id         text        NOT NULL,
    selection       jsonb       NOT NULL,
    reason          text        NOT NULL,
    actor           text        NOT NULL,
    -- running, done, cancelled, interrupted (its console stopped)
    state           text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz NULL
);

CREATE TABLE IF NOT EXISTS outbox_admin_job_items (
    job        uuid        NOT NULL REFERENCES outbox_admin_jobs (id),
    ord        int         NOT NULL,
    stream     text        NOT NULL,
    seq        bigint      NOT NULL,
    message_id text        NOT NULL,
    durable    text        NULL,
    -- null until done: replayed, already_replayed, not_replayable, failed, cancelled
    result     text        NULL,
    detail     text        NULL,
    done_at    timestamptz NULL,
    PRIMARY KEY (job, ord)
);
