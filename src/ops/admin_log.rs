//! `outbox_admin_log` (SPEC §16, `migrations/0011_admin_log.sql`): one
//! row per admin action, appended through the table's own trigger, which
//! numbers and hash-chains it and names the session's database role
//! (`session_user`: a command cannot claim another), never `$USER`, which
//! is unset in most containers and anyone can set.

use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::metrics as m;

/// The migration, for `migrate --admin-log-only` (a team's own database,
/// which needs no other table of ours).
pub const TABLE: &str = include_str!("../../migrations/0011_admin_log.sql");

/// One action as the log records it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// `dlq.replay`, `dlq.delete`, `consumer.reset`, `prune`,
    /// `audit.repair`, `slot.drop`, `token.create`, `token.revoke`; the
    /// console's requests by route (`dead_letters.read`, …).
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

/// Make sure the action can be recorded before it runs: an action that
/// cannot be does not run. The log is made by `outbox-relay migrate` (or
/// `migrate --admin-log-only`) as the database's owner, never here: whoever
/// made it would own it, and could empty it.
pub async fn ensure(pool: &PgPool, action: &str) -> Result<()> {
    let (present, standby, may_insert): (bool, bool, Option<bool>) = sqlx::query_as(
        "SELECT to_regclass('outbox_admin_log') IS NOT NULL, pg_is_in_recovery(), \
                CASE WHEN to_regclass('outbox_admin_log') IS NOT NULL \
                     THEN has_table_privilege('outbox_admin_log', 'INSERT') END",
    )
    .fetch_one(pool)
    .await
    .map_err(Error::pg("looking up outbox_admin_log"))?;
    if standby {
        return Err(Error::setup(format!(
            "{action} is recorded in outbox_admin_log, and DATABASE_URL is a standby: run it against the primary"
        )));
    }
    if !present {
        return Err(Error::setup(format!(
            "{action} is recorded in outbox_admin_log, which this database does not have: run `outbox-relay migrate` (or `outbox-relay migrate --admin-log-only` on a database with your own outbox table) as the database's owner first"
        )));
    }
    if may_insert != Some(true) {
        return Err(Error::setup(format!(
            "{action} is recorded in outbox_admin_log, and this role may not insert into it: GRANT INSERT ON outbox_admin_log TO {}",
            actor(pool).await.unwrap_or_else(|_| "<this role>".into())
        )));
    }
    Ok(())
}

/// Who acted, when not a command line (whose actor is its database role,
/// set by the table's trigger): the console's caller.
#[derive(Debug, Clone)]
pub struct Actor {
    /// `token:<name>`, or `anonymous` for a request without a valid token.
    pub name: String,
    /// The token's role (`viewer`, `operator`, `admin`), or `anonymous`.
    pub role: &'static str,
    /// The request's id, which the response names too.
    pub request_id: String,
}

/// Append `entry` with its `result` (`done`, or `failed: …`).
pub async fn record(pool: &PgPool, entry: &Entry, result: &str) -> Result<()> {
    record_as(pool, entry, None, result).await
}

/// Append `entry` with its `result` (`done`, `failed: …`, `denied: …`)
/// for `actor` (none: the command line).
pub async fn record_as(
    pool: &PgPool,
    entry: &Entry,
    actor: Option<&Actor>,
    result: &str,
) -> Result<()> {
    metrics::counter!(m::ADMIN_ACTIONS, "action" => entry.action, "result" => outcome(result))
        .increment(1);
    insert(pool, entry, actor, result)
        .await
        .map_err(Error::pg("recording the action in outbox_admin_log"))
}

/// The metric's `result` label of a recorded result: `done`, `done: …`
/// (what it came to) and the rest by their first word.
fn outcome(result: &str) -> &'static str {
    match result.split(':').next().unwrap_or_default() {
        "done" => "done",
        "denied" => "denied",
        _ => "failed",
    }
}

/// Run `act` recorded: the log is made sure of first, and the outcome,
/// whatever it is, appended after. A record that fails once the action
/// has run is a warning (the action did happen).
pub async fn recorded<T>(
    pool: &PgPool,
    entry: Entry,
    act: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    recorded_as(pool, entry, None, act).await
}

/// [`recorded`], naming `actor` (a command run with `--admin-token`) as
/// well as the database role.
pub async fn recorded_as<T>(
    pool: &PgPool,
    entry: Entry,
    actor: Option<&Actor>,
    act: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    ensure(pool, entry.action).await?;
    let out = act.await;
    let result = match &out {
        Ok(_) => "done".to_owned(),
        Err(e) => format!("failed: {e}"),
    };
    if let Err(e) = record_as(pool, &entry, actor, &result).await {
        eprintln!("warning: {} ran but is not recorded: {e}", entry.action);
    }
    out
}

async fn insert(
    pool: &PgPool,
    entry: &Entry,
    actor: Option<&Actor>,
    result: &str,
) -> sqlx::Result<()> {
    // Read committed whatever the role's default: the trigger must see the
    // row committed before the one it waited for.
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO outbox_admin_log \
             (seq, at, db_role, actor, role, action, target, selection, reason, result, request_id, prev_hash, hash) \
         VALUES (0, now(), '', $7, $8, $1, $2, $3, $4, $5, $6, '', '')",
    )
    .bind(entry.action)
    .bind(&entry.target)
    .bind(&entry.selection)
    .bind(&entry.reason)
    .bind(result)
    .bind(actor.map_or_else(|| uuid::Uuid::new_v4().to_string(), |a| a.request_id.clone()))
    .bind(actor.map_or("", |a| a.name.as_str()))
    .bind(actor.map_or("cli", |a| a.role))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// What `admin log verify` found.
#[derive(Debug, Serialize)]
pub struct Verified {
    pub rows: i64,
    /// The newest row's hash. Keep it elsewhere: whoever can disable the
    /// table's triggers can rewrite every row after one they change, and
    /// only a head kept outside shows that (`--expect-head`).
    pub head: Option<String>,
    /// The first row that does not hold: its sequence and why.
    pub broken: Option<(i64, String)>,
}

/// Recompute every row's hash and link, in order, here rather than in a
/// function of the database (whose owner could replace it). `expect_head`:
/// a head kept from an earlier run, which must still be in the chain.
pub async fn verify(pool: &PgPool, expect_head: Option<&str>) -> Result<Verified> {
    // The canonical text from built-in functions only (schema-qualified):
    // as the trigger builds it.
    let rows: Vec<(i64, String, String, String)> = sqlx::query_as(
        "SELECT seq, pg_catalog.jsonb_build_array( \
                    prev_hash, seq, (EXTRACT(epoch FROM at) * 1000000)::bigint, \
                    db_role, actor, role, action, target, selection, reason, result, request_id)::text, \
                prev_hash, hash \
         FROM outbox_admin_log ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .map_err(Error::pg("reading outbox_admin_log (run `outbox-relay migrate`)"))?;
    let mut broken = None;
    let mut before = String::new();
    for (i, (seq, canonical, prev, hash)) in rows.iter().enumerate() {
        let why = if *seq != i as i64 + 1 {
            Some("a row before it is missing")
        } else if *prev != before {
            Some("it does not follow the row before (a row removed or changed before it)")
        } else if hex(&Sha256::digest(canonical.as_bytes())) != *hash {
            Some("its fields do not match its hash (changed)")
        } else {
            None
        };
        if let Some(why) = why {
            broken = Some((*seq, why.to_owned()));
            break;
        }
        before = hash.clone();
    }
    if let (None, Some(kept)) = (&broken, expect_head) {
        if !rows.iter().any(|r| r.3 == kept) {
            broken = Some((
                0,
                format!("the head kept from before ({kept}) is not in the chain: rows were rewritten or removed"),
            ));
        }
    }
    Ok(Verified {
        rows: rows.len() as i64,
        head: rows.last().map(|r| r.3.clone()),
        broken,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan, a job or a request that was made is recorded as
    /// `done: …`; the metric counted those as failed.
    #[test]
    fn a_result_with_what_it_came_to_is_counted_by_its_first_word() {
        assert_eq!(outcome("done"), "done");
        assert_eq!(outcome("done: job 7, 3 letters to replay"), "done");
        assert_eq!(outcome("denied: 403 token t is viewer"), "denied");
        assert_eq!(outcome("failed: stream gone"), "failed");
        assert_eq!(outcome("done-ish"), "failed");
    }
}
