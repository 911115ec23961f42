//! Delete with sign-off (SPEC §16, seed 001: "poison is deleted with an
//! operator's sign-off and an audit record"): an admin asks, with a reason
//! and a dry run's plan; the letters stay until a second admin approves
//! (one, where `--delete-approvals 1` says a small team has no second);
//! the approval reads the letters again and deletes only if they are still
//! the plan's.

use serde_json::Value;
use sqlx::PgPool;

use super::replay::Selection;

/// The migration, for `migrate --admin-log-only`.
pub const TABLE: &str = include_str!("../../migrations/0014_admin_deletions.sql");

/// A deletion request as kept.
pub type Request = Value;

const AT: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'";

fn columns() -> String {
    format!(
        "jsonb_build_object('id', id, 'plan_id', plan_id, 'selection', selection, 'reason', reason, \
         'requested_by', requested_by, 'requested_at', to_char(requested_at AT TIME ZONE 'UTC', {AT}), \
         'state', state, 'decided_by', decided_by, \
         'decided_at', to_char(decided_at AT TIME ZONE 'UTC', {AT}), 'result', result)"
    )
}

/// Make a pending request: false when its key was taken (by another
/// request, made first).
pub async fn create(
    pool: &PgPool,
    id: uuid::Uuid,
    key: &str,
    plan: &str,
    selection: &Selection,
    reason: &str,
    by: &str,
) -> sqlx::Result<bool> {
    let made = sqlx::query(
        "INSERT INTO outbox_admin_deletions (id, idempotency_key, plan_id, selection, reason, requested_by, state) \
         VALUES ($1, $2, $3, $4, $5, $6, 'pending') ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(id)
    .bind(key)
    .bind(plan)
    .bind(serde_json::to_value(selection).unwrap_or_default())
    .bind(reason)
    .bind(by)
    .execute(pool)
    .await?;
    Ok(made.rows_affected() == 1)
}

pub async fn by_key(pool: &PgPool, key: &str) -> sqlx::Result<Option<Request>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM outbox_admin_deletions WHERE idempotency_key = $1",
        columns()
    )))
    .bind(key)
    .fetch_optional(pool)
    .await
}

pub async fn get(pool: &PgPool, id: uuid::Uuid) -> sqlx::Result<Option<Request>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM outbox_admin_deletions WHERE id = $1",
        columns()
    )))
    .bind(id)
    .fetch_optional(pool)
    .await
}

/// Requests, pending first, then the newest.
pub async fn recent(pool: &PgPool, limit: i64) -> sqlx::Result<Vec<Request>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {} FROM outbox_admin_deletions \
         ORDER BY state = 'pending' DESC, requested_at DESC LIMIT $1",
        columns()
    )))
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Take a pending request for deciding: true for the one caller that
/// moves it out of `pending` (two admins approving at once decide once).
pub async fn decide(
    pool: &PgPool,
    id: uuid::Uuid,
    state: &str,
    by: &str,
    result: Option<&Value>,
) -> sqlx::Result<bool> {
    let done = sqlx::query(
        "UPDATE outbox_admin_deletions SET state = $2, decided_by = $3, decided_at = now(), result = $4 \
         WHERE id = $1 AND state = 'pending'",
    )
    .bind(id)
    .bind(state)
    .bind(by)
    .bind(result)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Record what the deletion did (after [`decide`] took it).
pub async fn finish(
    pool: &PgPool,
    id: uuid::Uuid,
    state: &str,
    result: &Value,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE outbox_admin_deletions SET state = $2, result = $3 WHERE id = $1")
        .bind(id)
        .bind(state)
        .bind(result)
        .execute(pool)
        .await?;
    Ok(())
}

/// Requests a console left `deleting` when it stopped (none of the running
/// consoles has touched them for 10 minutes): said so.
pub async fn interrupted(pool: &PgPool) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "UPDATE outbox_admin_deletions SET state = 'interrupted' \
         WHERE state = 'deleting' AND decided_at < now() - interval '10 minutes'",
    )
    .execute(pool)
    .await?
    .rows_affected())
}
