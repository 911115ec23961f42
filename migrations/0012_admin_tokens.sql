-- The operator console's tokens (SPEC §16): named, scoped to a role,
-- expiring, stored as a SHA-256 digest of the secret (the secret itself is
-- shown once, by `outbox-relay admin token create`, and kept nowhere).
-- `outbox-relay migrate --admin-log-only` applies this file too, so it
-- runs twice safely.
CREATE TABLE IF NOT EXISTS outbox_admin_tokens (
    name       text        PRIMARY KEY
                           CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    role       text        NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    -- hex SHA-256 of the whole secret
    digest     text        NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The database role that made it, whatever the row claims.
    created_by text        NOT NULL DEFAULT session_user,
    expires_at timestamptz NOT NULL,
    revoked_at timestamptz NULL,
    CHECK (expires_at > created_at)
);
