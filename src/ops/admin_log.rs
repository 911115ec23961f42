//! `outbox_admin_log` (SPEC §16, `migrations/0011_admin_log.sql`): one
//! row per admin action, appended by the database's own trigger, which
//! numbers and hash-chains it. The actor is the database role the command
//! connected as (`session_user`, which a process cannot claim to be
//! otherwise), never `$USER`, which is unset in most containers and
//! anyone can set.

use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::ops::metrics as m;

/// The migration, applied by the CLI itself on a database never migrated
/// (a team's own outbox): an admin action is recorded wherever it runs.
const TABLE: &str = include_str!("../../migrations/0011_admin_log.sql");

/// One action as the log records it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// `dlq.replay`, `dlq.delete`, `consumer.reset`, `prune`,
    /// `audit.repair`, `slot.drop`.
    pub action: &'static str,
    /// What it acted on: a stream, a durable, a table, a slot.
    pub target: String,
    /// How it chose (flags, ids), as JSON.
    pub selection: serde_json::Value,
    pub reason: Option<String>,
}

/// Who the log names for a command: the database role it connected as.
pub async fn actor(pool: &PgPool) -> Result<String> {
    sqlx::query_scalar::<_, String>("SELECT session_user::text")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("reading the database role"))
}

/// Make sure the log exists before an action runs: a database never
/// migrated (a team's own outbox) gets the table from the migration
/// itself. An action that cannot be recorded does not run.
pub async fn ensure(pool: &PgPool, action: &str) -> Result<()> {
    let present: bool = sqlx::query_scalar("SELECT to_regclass('outbox_admin_log') IS NOT NULL")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("looking up outbox_admin_log"))?;
    if present {
        return Ok(());
    }
    sqlx::raw_sql(TABLE).execute(pool).await.map_err(|e| {
        Error::setup(format!(
            "{action} is recorded in outbox_admin_log, which is missing and this role may not create ({e}): run `outbox-relay migrate` as the database's owner first"
        ))
    })?;
    Ok(())
}

/// Append `entry` with its `result` (`done`, or `failed: …`).
pub async fn record(pool: &PgPool, entry: &Entry, result: &str) -> Result<()> {
    let outcome = if result == "done" { "done" } else { "failed" };
    metrics::counter!(m::ADMIN_ACTIONS, "action" => entry.action, "result" => outcome).increment(1);
    insert(pool, entry, result)
        .await
        .map_err(Error::pg("recording the action in outbox_admin_log"))
}

/// Run `act` recorded: the log is made sure of first, and the outcome,
/// whatever it is, appended after. A record that fails once the action
/// has run is a warning (the action did happen).
pub async fn recorded<T>(
    pool: &PgPool,
    entry: Entry,
    act: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    ensure(pool, entry.action).await?;
    let out = act.await;
    let result = match &out {
        Ok(_) => "done".to_owned(),
        Err(e) => format!("failed: {e}"),
    };
    if let Err(e) = record(pool, &entry, &result).await {
        eprintln!("warning: {} ran but is not recorded: {e}", entry.action);
    }
    out
}

async fn insert(pool: &PgPool, entry: &Entry, result: &str) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox_admin_log \
             (seq, at, actor, role, action, target, selection, reason, result, request_id, prev_hash, hash) \
         VALUES (0, now(), 'db:' || session_user, 'cli', $1, $2, $3, $4, $5, $6, '', '')",
    )
    .bind(entry.action)
    .bind(&entry.target)
    .bind(&entry.selection)
    .bind(&entry.reason)
    .bind(result)
    .bind(uuid::Uuid::new_v4().to_string())
    .execute(pool)
    .await
    .map(|_| ())
}

/// What `admin log verify` found.
#[derive(Debug, Serialize)]
pub struct Verified {
    pub rows: i64,
    /// The newest row's hash: keep it elsewhere, and a later verify proves
    /// nothing before it changed (a chain alone cannot show its own tail
    /// cut off).
    pub head: Option<String>,
    /// The first row that does not hold: its sequence and why.
    pub broken: Option<(i64, String)>,
}

/// Recompute every row's hash and link, in order.
pub async fn verify(pool: &PgPool) -> Result<Verified> {
    let rows: Vec<(i64, bool, bool, bool, String)> = sqlx::query_as(
        "SELECT seq, hash = outbox_admin_log_hash(l), \
                prev_hash = coalesce(lag(hash) OVER (ORDER BY seq), ''), \
                seq = row_number() OVER (ORDER BY seq), hash \
         FROM outbox_admin_log l ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .map_err(Error::pg(
        "reading outbox_admin_log (run `outbox-relay migrate`)",
    ))?;
    let broken = rows.iter().find_map(|(seq, sound, linked, numbered, _)| {
        let why = if !sound {
            "its fields do not match its hash (changed)"
        } else if !linked {
            "it does not follow the row before (a row removed or changed before it)"
        } else if !numbered {
            "a row before it is missing"
        } else {
            return None;
        };
        Some((*seq, why.to_owned()))
    });
    Ok(Verified {
        rows: rows.len() as i64,
        head: rows.last().map(|r| r.4.clone()),
        broken,
    })
}
