//! The console's bearer tokens (SPEC §16): named, scoped to a role,
//! expiring, revocable, and stored as a digest of the secret only
//! (`migrations/0012_admin_tokens.sql`). `outbox-relay admin token
//! create|list|revoke` manages them; the console checks them.

use std::fmt;
use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// The migration, for `migrate --admin-log-only`.
pub const TABLE: &str = include_str!("../../migrations/0012_admin_tokens.sql");

/// Every secret starts so: a leaked one is recognisable (secret scanners,
/// a grep of logs), and a bearer value without it is not ours.
const PREFIX: &str = "oxr_";

/// The longest a token may live: a forgotten one expires.
pub const MAX_TTL: Duration = Duration::from_secs(366 * 24 * 3600);

/// What a token may do; each role may do all the roles below it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything; payloads masked.
    Viewer,
    /// Dry runs, and replays of the classes the playbook allows.
    Operator,
    /// Everything.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        [Role::Viewer, Role::Operator, Role::Admin]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A token as stored (never its secret).
#[derive(Debug, Clone, Serialize)]
pub struct Token {
    pub name: String,
    pub role: Role,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// The database role that made it.
    pub created_by: String,
    pub expires_at: String,
    pub revoked_at: Option<String>,
    /// `active`, `expired` or `revoked`, as of the read.
    pub state: &'static str,
    /// `token` (one of the table's), or `oidc` (a JWT's subject).
    pub kind: &'static str,
}

impl Token {
    /// How the log names its holder: `token:<name>`, `oidc:<sub>`.
    pub fn actor(&self) -> String {
        format!("{}:{}", self.kind, self.name)
    }
}

/// What a bearer value turned out to be.
#[derive(Debug)]
pub enum Checked {
    Valid(Token),
    /// Not one of ours (or not a token at all).
    Unknown,
    Expired(Token),
    Revoked(Token),
}

/// `ROLE=VALUE` items (`--oidc-role`, `--admin-cert-role`): the role a
/// claim's or a certificate's value gives.
pub fn parse_role_map(flag: &str, items: &[String]) -> Result<Vec<(String, Role)>> {
    items
        .iter()
        .map(|item| {
            let (role, value) = item.split_once('=').ok_or_else(|| {
                Error::Config(format!(
                    "{flag} {item:?}: give ROLE=VALUE (e.g. admin=platform-admins)"
                ))
            })?;
            let role = Role::parse(role.trim()).ok_or_else(|| {
                Error::Config(format!(
                    "{flag} {item:?}: {role:?} is not a role (viewer, operator, admin)"
                ))
            })?;
            let value = value.trim();
            if value.is_empty() {
                return Err(Error::Config(format!("{flag} {item:?}: no value")));
            }
            Ok((value.to_owned(), role))
        })
        .collect()
}

/// Whether `name` is a token name: lowercase letters, digits, `.`, `_`,
/// `-`, at most 63, starting with a letter or digit (the table checks too).
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.len() <= 63
        && chars
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
}

fn digest(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// 244 random bits (two v4 UUIDs, from the OS's generator), as hex.
fn new_secret() -> String {
    format!(
        "{PREFIX}{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

const COLUMNS: &str = "name, role, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), created_by, \
    to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
    to_char(revoked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
    CASE WHEN revoked_at IS NOT NULL THEN 'revoked' \
         WHEN expires_at <= now() THEN 'expired' ELSE 'active' END";

type Row = (
    String,
    String,
    String,
    String,
    String,
    Option<String>,
    String,
);

fn token((name, role, created_at, created_by, expires_at, revoked_at, state): Row) -> Token {
    Token {
        name,
        // The table's check allows these three only.
        role: Role::parse(&role).unwrap_or(Role::Viewer),
        created_at,
        created_by,
        expires_at,
        revoked_at,
        state: match state.as_str() {
            "revoked" => "revoked",
            "expired" => "expired",
            _ => "active",
        },
        kind: "token",
    }
}

/// Make token `name` for `role`, valid for `ttl`: the secret is returned
/// once and stored only as its digest.
pub async fn create(
    pool: &PgPool,
    name: &str,
    role: Role,
    ttl: Duration,
) -> Result<(Token, String)> {
    if !valid_name(name) {
        return Err(Error::Config(format!(
            "token name {name:?}: use lowercase letters, digits, '.', '_' and '-' (at most 63, starting with a letter or digit)"
        )));
    }
    if ttl.is_zero() || ttl > MAX_TTL {
        return Err(Error::Config(format!(
            "--expires-in {}: a token lives more than 0 and at most 366 days",
            humantime::format_duration(ttl)
        )));
    }
    let secret = new_secret();
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO outbox_admin_tokens (name, role, digest, expires_at) \
         VALUES ($1, $2, $3, now() + make_interval(secs => $4)) \
         ON CONFLICT (name) DO NOTHING RETURNING {COLUMNS}"
    )))
    .bind(name)
    .bind(role.as_str())
    .bind(digest(&secret))
    .bind(ttl.as_secs_f64())
    .fetch_optional(pool)
    .await
    .map_err(table_error("creating the token"))?;
    match row {
        Some(row) => Ok((token(row), secret)),
        None => Err(Error::Config(format!(
            "a token named {name:?} exists (revoked ones too: names are not reused, so the log's names stay unambiguous); choose another name"
        ))),
    }
}

/// Every token, newest first.
pub async fn list(pool: &PgPool) -> Result<Vec<Token>> {
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM outbox_admin_tokens ORDER BY created_at DESC, name"
    )))
    .fetch_all(pool)
    .await
    .map_err(table_error("listing tokens"))?;
    Ok(rows.into_iter().map(token).collect())
}

/// Revoke `name`: false when there is none (or it was revoked before).
pub async fn revoke(pool: &PgPool, name: &str) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE outbox_admin_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL",
    )
    .bind(name)
    .execute(pool)
    .await
    .map_err(table_error("revoking the token"))?;
    Ok(done.rows_affected() == 1)
}

/// What `secret` is.
pub async fn check(pool: &PgPool, secret: &str) -> Result<Checked> {
    if !secret.starts_with(PREFIX) || secret.len() > 128 {
        return Ok(Checked::Unknown);
    }
    // By digest: a lookup's timing says nothing of the secret.
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM outbox_admin_tokens WHERE digest = $1"
    )))
    .bind(digest(secret))
    .fetch_optional(pool)
    .await
    .map_err(table_error("checking a token"))?;
    Ok(match row.map(token) {
        None => Checked::Unknown,
        Some(t) if t.state == "revoked" => Checked::Revoked(t),
        Some(t) if t.state == "expired" => Checked::Expired(t),
        Some(t) => Checked::Valid(t),
    })
}

fn table_error(what: &'static str) -> impl FnOnce(sqlx::Error) -> Error {
    move |e| {
        let missing = e
            .as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|c| c == "42P01");
        if missing {
            Error::setup(format!(
                "{what}: this database has no outbox_admin_tokens: run `outbox-relay migrate` (or `migrate --admin-log-only`) as the database's owner first"
            ))
        } else {
            Error::pg(what)(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_and_roles_are_ordered() {
        for ok in ["ci", "alice.oncall", "team-a_1", "0ps"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "Alice", "-x", "a b", "a/b", &"x".repeat(64), "é"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(Role::Viewer < Role::Operator && Role::Operator < Role::Admin);
        for r in [Role::Viewer, Role::Operator, Role::Admin] {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("root"), None);
    }

    #[test]
    fn secrets_are_prefixed_long_and_differ() {
        let (a, b) = (new_secret(), new_secret());
        assert!(a.starts_with(PREFIX) && a.len() == PREFIX.len() + 64);
        assert_ne!(a, b);
        assert_ne!(digest(&a), digest(&b));
        assert_eq!(digest(&a).len(), 64);
    }
}
