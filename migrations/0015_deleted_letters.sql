-- Relay dead letters an operator deleted (`dlq delete`, the console's
-- approved deletions), one row per letter, with the relay that wrote it
-- (`Outbox-Source`): the audit (SPEC §14) does not call a row whose relay
-- dead letter was deleted on purpose "missing", nor repair it (the
-- documented procedure inserts a fixed copy as a new row). Keyed with the
-- id too: a stream made again numbers its messages from 1.
CREATE TABLE IF NOT EXISTS outbox_deleted_letters (
    stream      text        NOT NULL,
    seq         bigint      NOT NULL,
    id          text        NOT NULL,
    source      text        NOT NULL,
    deleted_at  timestamptz NOT NULL DEFAULT now(),
    db_role     text        NOT NULL DEFAULT session_user,
    PRIMARY KEY (stream, seq, id)
);
CREATE INDEX IF NOT EXISTS outbox_deleted_letters_id ON outbox_deleted_letters (id);
