//! The inbox: one row per (consumer, message), the consumer's dedupe record.
//!
//! A delivery runs inside one transaction that holds the inbox row locked:
//! a second consumer instance given the same message waits instead of
//! calling the handler twice, and a Rust handler's writes commit together
//! with `processed_at` (exactly-once effects).

use sqlx::{PgConnection, Postgres, Transaction};
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

/// After a failed attempt whose transaction was rolled back: record the
/// attempt and its error on their own.
pub async fn record_failure(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
    subject: &str,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, subject, attempts, last_error) VALUES ($1, $2, $3, 1, $4) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = inbox_messages.attempts + 1, last_error = excluded.last_error",
    )
    .bind(consumer)
    .bind(id)
    .bind(subject)
    .bind(error)
    .execute(conn)
    .await?;
    Ok(())
}

/// A dead-lettered message: record the attempt, its reason and mark it
/// processed in one statement (the delivery's transaction was rolled back).
pub async fn finish_dead_lettered(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
    subject: &str,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, subject, attempts, last_error, processed_at) \
         VALUES ($1, $2, $3, 1, $4, now()) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = inbox_messages.attempts + 1, last_error = excluded.last_error, \
               processed_at = greatest(now(), inbox_messages.received_at)",
    )
    .bind(consumer)
    .bind(id)
    .bind(subject)
    .bind(error)
    .execute(conn)
    .await?;
    Ok(())
}
