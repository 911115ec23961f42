//! The outbox stays published while the relay streams. A change to the
//! publication (`ALTER PUBLICATION … DROP TABLE`, `SET (publish = …)`, the
//! table dropped from it and added back, the publication made again) or a
//! new table under the outbox's name (a swap) stops the slot carrying the
//! services' inserts: pgoutput leaves out what the publication did not
//! publish when it was written, even when read again, so nothing the relay
//! decodes shows it. Each second a check compares the table under its name
//! (its oid) and its membership of the publication with what the session
//! began with; a change stops the relay in one line: what changed, and the
//! audit that publishes the rows written since (from a minute before the
//! last good check). A renamed outbox loses nothing: its rows reach the
//! slot under the new name and are read by its oid (`decode.rs`); the
//! check stops the relay on the name, and a start once it is fixed reads
//! them.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::postgres::provision::{self, StillPublished};

/// How often the check runs.
pub(super) const EVERY: Duration = Duration::from_secs(1);
/// A check slower than this says nothing.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// Without a good check this long, a change would go unseen: said this often.
const UNCHECKED_WARNING: Duration = Duration::from_secs(30);

/// What the session's watchers (this check, and [`super::heard`]) tell its
/// pump, on one channel: one more branch in the loop every event passes
/// through costs each event its poll.
#[derive(Debug)]
pub(super) enum Notice {
    /// The outbox no longer reaches the slot: the line to stop with.
    Unpublished(String),
    /// Postgres no longer hears the replication connection.
    Silent(String),
    /// Whether Postgres can be asked at all: the line for `/readyz` while
    /// not, `None` once it can again.
    Unproven(Option<String>),
}

/// Check every [`EVERY`] until `stop`, against `pin` (the session's first
/// check), and send the line to stop with once one finds a change. A check
/// Postgres does not answer says nothing; a warning says so every
/// [`UNCHECKED_WARNING`].
pub(super) fn watch(
    pool: PgPool,
    publication: String,
    schema: String,
    table: String,
    pin: StillPublished,
    tx: tokio::sync::mpsc::Sender<Notice>,
) -> CancellationToken {
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        // The session checked once as it began (`pin`): the first check
        // here is one period on.
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut since, mut good, mut warned) = (pin.since.clone(), Instant::now(), Instant::now());
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            let check = provision::still_published(&pool, &publication, &schema, &table);
            let found = match tokio::time::timeout(CHECK_TIMEOUT, check).await {
                Ok(Ok(found)) => found,
                Ok(Err(e)) => {
                    unchecked(&mut warned, good, &e.to_string());
                    continue;
                }
                Err(_) => {
                    unchecked(&mut warned, good, "no answer in time");
                    continue;
                }
            };
            if let Ok(p) = &found {
                since = p.since.clone();
                good = Instant::now();
            }
            if let Err(line) = judge(&pin, found, Some(&since)) {
                let _ = tx.send(Notice::Unpublished(line)).await;
                return;
            }
        }
    });
    stop
}

fn unchecked(warned: &mut Instant, good: Instant, error: &str) {
    if good.elapsed() >= UNCHECKED_WARNING && warned.elapsed() >= UNCHECKED_WARNING {
        *warned = Instant::now();
        tracing::warn!(
            unchecked_for = ?good.elapsed(),
            error,
            "cannot check that the publication still publishes the outbox: a change to it would go unseen meanwhile"
        );
    }
}

/// A check's answer against the session's first: the line to stop with
/// when something changed (`since`: the audit window's start, from the
/// last good check).
pub(super) fn judge(
    pin: &StillPublished,
    found: std::result::Result<StillPublished, String>,
    since: Option<&str>,
) -> std::result::Result<(), String> {
    let p = found.map_err(|why| stop_line(&why, since))?;
    if p.oid != pin.oid {
        return Err(stop_line(
            &format!(
                "the outbox's name is another table's now (oid {}, then {}: swapped for a new one?), and rows written to it before it joined the publication never reached the slot",
                pin.oid, p.oid
            ),
            since,
        ));
    }
    if p.membership != pin.membership {
        return Err(stop_line(
            "the outbox left the publication and joined it again (or the publication was made again), and rows written between never reached the slot",
            since,
        ));
    }
    Ok(())
}

/// The line the relay stops with: what changed, and how the rows written
/// since reach the stream (the slot never carries them).
pub(super) fn stop_line(why: &str, since: Option<&str>) -> String {
    let window = since.map_or("--last 1h".to_owned(), |s| format!("--since {s}"));
    format!(
        "the outbox's inserts no longer reach the slot: {why}. Once the publication publishes the table, start the relay, then run `outbox-relay audit {window} --repair` with its flags: it publishes the rows written meanwhile, which the slot does not carry"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(oid: i64, membership: &str) -> StillPublished {
        StillPublished {
            oid,
            membership: membership.into(),
            since: "2026-11-29T00:00:00Z".into(),
        }
    }

    #[test]
    fn a_check_passes_only_the_table_and_membership_the_session_began_with() {
        let pin = p(7, "1:10");
        let since = Some("2026-11-29T00:00:00Z");
        assert_eq!(judge(&pin, Ok(p(7, "1:10")), since), Ok(()));
        let swapped = judge(&pin, Ok(p(8, "1:11")), since).unwrap_err();
        assert!(swapped.contains("oid 7, then 8"), "{swapped}");
        let readded = judge(&pin, Ok(p(7, "1:12")), since).unwrap_err();
        assert!(readded.contains("joined it again"), "{readded}");
        let gone = judge(&pin, Err("publication x is gone".into()), since).unwrap_err();
        assert!(gone.contains("publication x is gone"), "{gone}");
        assert!(
            gone.contains("audit --since 2026-11-29T00:00:00Z --repair"),
            "{gone}"
        );
    }
}
