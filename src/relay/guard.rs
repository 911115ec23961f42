//! The outbox stays published while the relay streams. A change to the
//! publication (`ALTER PUBLICATION … DROP TABLE`, `SET (publish = …)`) or
//! to the table under its name (a rename, a swap for a new table) stops
//! the slot carrying the services' inserts: pgoutput leaves them out, even
//! when read again later, and the keepalives would confirm the slot past
//! them without a word. So the slot is confirmed only up to where a check
//! found the outbox still published, and a check that finds it is not
//! stops the relay, saying what to run.

use std::time::Duration;

use pgwire_replication::Lsn;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::postgres::provision::{self, StillPublished};

/// How often the check runs: the slot is confirmed at most this much later
/// than the acks allow (it is not on the path of a publish).
pub(super) const EVERY: Duration = Duration::from_secs(1);

/// What a check found: the outbox published up to a position, or why not.
pub(super) type Found = std::result::Result<Lsn, String>;

/// Check every [`EVERY`] until `stop`; the first check pins the table's
/// oid (another table under the name later is a swap). A check Postgres
/// does not answer says nothing (the slot is not confirmed past the last
/// good one meanwhile).
pub(super) fn watch(
    pool: PgPool,
    publication: String,
    schema: String,
    table: String,
) -> (tokio::sync::mpsc::Receiver<Found>, CancellationToken) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pinned = None;
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            let found = match provision::still_published(&pool, &publication, &schema, &table).await
            {
                Ok(found) => judge(&mut pinned, found, &schema, &table, &publication),
                Err(e) => {
                    tracing::debug!(error = %e, "the outbox's publication not checked");
                    continue;
                }
            };
            let last = found.is_err();
            if tx.send(found).await.is_err() || last {
                return;
            }
        }
    });
    (rx, stop)
}

/// A check's answer, against the oid the first one found.
fn judge(
    pinned: &mut Option<i64>,
    found: std::result::Result<StillPublished, String>,
    schema: &str,
    table: &str,
    publication: &str,
) -> Found {
    let fix = format!("ALTER PUBLICATION {publication} ADD TABLE \"{schema}\".\"{table}\"");
    let p = found?;
    match *pinned.get_or_insert(p.oid) {
        oid if oid == p.oid => Ok(p.upto),
        oid => Err(format!(
            "table {schema}.{table} is another table now (oid {oid}, now {}: swapped for a new one?), which publication {publication} does not publish as the relay read it: run {fix} if it is not in it",
            p.oid
        )),
    }
}

/// The line the relay stops with: what changed, and how the rows written
/// since reach the stream (the slot never carries them).
pub(super) fn stop_line(why: &str) -> String {
    format!(
        "the outbox no longer reaches the slot: {why}. Its inserts since the change are not in the WAL stream, and the slot was not confirmed past them: once the table is published again, start the relay, then run `outbox-relay audit --last 1h --repair` with its flags (a window that covers the change) to publish them"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(oid: i64, at: u64) -> std::result::Result<StillPublished, String> {
        Ok(StillPublished { upto: Lsn(at), oid })
    }

    #[test]
    fn the_first_check_pins_the_table_and_a_swap_is_told() {
        let mut pinned = None;
        assert_eq!(
            judge(&mut pinned, p(7, 10), "public", "o", "pub"),
            Ok(Lsn(10))
        );
        assert_eq!(
            judge(&mut pinned, p(7, 20), "public", "o", "pub"),
            Ok(Lsn(20))
        );
        let swapped = judge(&mut pinned, p(8, 30), "public", "o", "pub").unwrap_err();
        assert!(swapped.contains("oid 7, now 8"), "{swapped}");
        let gone = judge(&mut pinned, Err("gone".into()), "public", "o", "pub");
        assert_eq!(gone, Err("gone".into()));
    }
}
