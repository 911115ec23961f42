//! The inbox: one row per (consumer, message), the consumer's dedupe record.
//!
//! A delivery runs inside one transaction that holds the inbox row locked:
//! a second consumer instance given the same message waits instead of
//! calling the handler twice, and a Rust handler's writes commit together
//! with `processed_at` (exactly-once effects).

use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

/// Insert the row or count one more attempt; lock it for this transaction.
/// Returns `true` when the message was already processed.
pub async fn begin_delivery(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    id: Uuid,
    subject: &str,
) -> Result<bool, sqlx::Error> {
    let processed: Option<bool> = sqlx::query_scalar(
        "INSERT INTO inbox_messages (consumer, message_id, subject, attempts) VALUES ($1, $2, $3, 1) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = inbox_messages.attempts + CASE WHEN inbox_messages.processed_at IS NULL THEN 1 ELSE 0 END \
         RETURNING processed_at IS NOT NULL",
    )
    .bind(consumer)
    .bind(id)
    .bind(subject)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(processed.unwrap_or(false))
}

/// Mark processed, in the delivery's transaction.
pub async fn mark_processed(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE inbox_messages SET processed_at = greatest(now(), received_at) \
         WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .execute(conn)
    .await?;
    Ok(())
}

/// One attempt that ended outside the delivery's transaction (which was
/// rolled back): its error, and whether the message is done with.
pub struct Attempt<'a> {
    pub consumer: &'a str,
    pub id: Uuid,
    pub subject: &'a str,
    pub error: &'a str,
}

/// Count the attempt and record its error; with `processed` (a dead letter
/// that the DLQ stored) also mark the message done, in the same statement.
pub async fn record_attempt(
    pool: &PgPool,
    a: &Attempt<'_>,
    processed: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, subject, attempts, last_error, processed_at) \
         VALUES ($1, $2, $3, 1, $4, CASE WHEN $5 THEN now() END) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = inbox_messages.attempts + 1, last_error = excluded.last_error, \
               processed_at = CASE WHEN $5 THEN greatest(now(), inbox_messages.received_at) \
                                   ELSE inbox_messages.processed_at END",
    )
    .bind(a.consumer)
    .bind(a.id)
    .bind(a.subject)
    .bind(a.error)
    .bind(processed)
    .execute(pool)
    .await?;
    Ok(())
}
