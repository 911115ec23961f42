//! The outbox stays in the slot while the relay streams. The session
//! streams through the publication the relay keeps (`postgres/kept.rs`),
//! or through `--publication` where it keeps none. An edit of
//! `--publication` then costs nothing and is said in a warning. An edit of
//! the streamed one (`ALTER PUBLICATION … DROP TABLE`, `SET (publish = …)`,
//! the table dropped from it and added back, the publication made again),
//! or a new table under the outbox's name (a swap), stops the slot carrying
//! the services' inserts: pgoutput leaves out what the publication did not
//! publish when it was written, even when read again, so nothing the relay
//! decodes shows it. Each second a check compares the table under its name
//! (its oid) and its membership of each publication with the last check's;
//! a gap stops the relay in one line: what changed, and the audit that
//! publishes the rows written since (from a minute before the last good
//! check). A renamed outbox loses nothing: its rows reach the slot under
//! the new name and are read by its oid (`decode.rs`); the check stops the
//! relay on the name, and a start once it is fixed reads them.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use pgwire_replication::Lsn;

use crate::metrics as m;
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
    /// The slot has passed the making of the kept publication: a session
    /// started over streams through it too.
    KeptReady(String),
}

/// What a check finds of one publication: the table under its name and
/// its membership, or why it does not publish the outbox.
pub(super) type Found = std::result::Result<StillPublished, String>;

/// What the checks compare: the operator's publication, and the kept one
/// when the session streams through it (then through it alone).
#[derive(Debug, Clone)]
pub(super) struct Pin {
    pub named: Found,
    pub kept: Option<Found>,
}

impl Pin {
    /// Whether the slot carries the outbox through the kept publication
    /// alone (the operator's no longer publishes it).
    pub fn kept_only(&self) -> bool {
        self.named.is_err() && matches!(self.kept, Some(Ok(_)))
    }

    fn since(&self) -> Option<&str> {
        fn ok(f: &Found) -> Option<&str> {
            f.as_ref().ok().map(|p| p.since.as_str())
        }
        ok(&self.named).or(self.kept.as_ref().and_then(ok))
    }

    /// The outbox's oid, as a publication that publishes it says.
    pub fn oid(&self) -> Option<i64> {
        let ok = |f: &Found| f.as_ref().ok().map(|p| p.oid);
        ok(&self.named).or(self.kept.as_ref().and_then(ok))
    }
}

/// What the session's publications are called, for its lines.
#[derive(Debug, Clone)]
pub(super) struct Names {
    pub named: String,
    pub kept: Option<String>,
    /// The kept publication the session does not stream through yet, and
    /// the WAL position the slot's `restart_lsn` must pass first.
    pub later: Option<(String, Lsn)>,
    pub slot: String,
}

/// A check's answer against the last one's.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Every row reached the slot; the lines say what changed, if anything.
    Carried(Vec<String>),
    /// Rows may have missed the slot: the line to stop with.
    Stop(String),
}

/// Read what the session's publications publish now.
pub(super) async fn check(
    pool: &PgPool,
    names: &Names,
    schema: &str,
    table: &str,
) -> crate::error::Result<Pin> {
    let named = provision::still_published(pool, &names.named, schema, table).await?;
    let kept = match &names.kept {
        Some(kept) => Some(provision::still_published(pool, kept, schema, table).await?),
        None => None,
    };
    Ok(Pin { named, kept })
}

/// Check every [`EVERY`] until `stop`, against `pin` (the session's first
/// check), and send the line to stop with once one finds a gap. A check
/// Postgres does not answer says nothing; a warning says so every
/// [`UNCHECKED_WARNING`].
pub(super) fn watch(
    pool: PgPool,
    names: Names,
    schema: String,
    table: String,
    pin: Pin,
    tx: tokio::sync::mpsc::Sender<Notice>,
) -> CancellationToken {
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        // The session checked once as it began (`pin`): the first check
        // here is one period on.
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let kept_gauge = metrics::gauge!(m::PUBLICATION_KEPT);
        kept_gauge.set(if pin.kept_only() { 1.0 } else { 0.0 });
        let (mut pin, mut good, mut warned) = (pin, Instant::now(), Instant::now());
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            let found =
                match tokio::time::timeout(CHECK_TIMEOUT, check(&pool, &names, &schema, &table))
                    .await
                {
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
            good = Instant::now();
            match judge(&names, &pin, &found) {
                Verdict::Stop(line) => {
                    let _ = tx.send(Notice::Unpublished(line)).await;
                    return;
                }
                Verdict::Carried(lines) => {
                    for line in lines {
                        tracing::warn!("{line}");
                    }
                    kept_gauge.set(if found.kept_only() { 1.0 } else { 0.0 });
                    pin = found;
                }
            }
            if let Some((kept, ready)) = &names.later {
                if let Ok(Ok(Some(at))) = tokio::time::timeout(
                    CHECK_TIMEOUT,
                    crate::postgres::kept::restart_lsn(&pool, &names.slot),
                )
                .await
                {
                    if at >= *ready {
                        let _ = tx.send(Notice::KeptReady(kept.clone())).await;
                        return;
                    }
                }
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

/// What a check found of one publication, to compare: the table's oid and
/// the membership row, or why it does not publish.
fn key(f: &Found) -> std::result::Result<(i64, &str), &str> {
    match f {
        Ok(p) => Ok((p.oid, p.membership.as_str())),
        Err(why) => Err(why.as_str()),
    }
}

/// Whether a publication published the outbox all the time between two
/// checks: it did at both, through the same membership row (dropped and
/// added back between, the row is a new one).
fn carried(before: &Found, now: &Found) -> bool {
    matches!((key(before), key(now)), (Ok(a), Ok(b)) if a == b)
}

/// A check's answer (`found`) against the last one's (`pin`): rows missed
/// the slot only if the publication it streams through did not carry the
/// outbox all the while, or if the outbox's name is another table's now.
pub(super) fn judge(names: &Names, pin: &Pin, found: &Pin) -> Verdict {
    let since = pin.since();
    if let (Some(then), Some(now)) = (pin.oid(), found.oid()) {
        if then != now {
            return Verdict::Stop(stop_line(
                &format!(
                    "the outbox's name is another table's now (oid {then}, then {now}: swapped for a new one?), and rows written to it before it joined the publication never reached the slot"
                ),
                since,
            ));
        }
    }
    // What the slot streams through: the kept publication, or the
    // operator's where there is none.
    let (streamed, before, now) = match (&names.kept, &pin.kept, &found.kept) {
        (Some(kept), Some(before), Some(now)) => (kept.as_str(), before, now),
        _ => (names.named.as_str(), &pin.named, &found.named),
    };
    if !carried(before, now) {
        let why = match now {
            Err(why) => why.clone(),
            Ok(_) => format!("the outbox left publication {streamed} and joined it again (or the publication was made again), and rows written between never reached the slot"),
        };
        return Verdict::Stop(stop_line(&why, since));
    }
    let mut lines = Vec::new();
    if let Some(kept) = &names.kept {
        if key(&pin.named) != key(&found.named) {
            lines.push(match &found.named {
                Err(why) => format!(
                    "publication {} no longer publishes the outbox ({why}); the slot streams through publication {kept}, which the relay keeps for this: nothing is lost",
                    names.named
                ),
                Ok(_) => format!("publication {} publishes the outbox again", names.named),
            });
        }
    }
    Verdict::Carried(lines)
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

    fn p(oid: i64, membership: &str) -> Found {
        Ok(StillPublished {
            oid,
            membership: membership.into(),
            since: "2026-11-29T00:00:00Z".into(),
        })
    }

    fn names(kept: bool) -> Names {
        Names {
            named: "outbox_relay_x".into(),
            kept: kept.then(|| "outbox_relay_x_keep".into()),
            later: None,
            slot: "outbox_relay_x".into(),
        }
    }

    fn pin(named: Found, kept: Option<Found>) -> Pin {
        Pin { named, kept }
    }

    fn stops(v: Verdict) -> String {
        match v {
            Verdict::Stop(line) => line,
            other => panic!("carried: {other:?}"),
        }
    }

    #[test]
    fn without_a_kept_publication_any_change_stops() {
        let n = names(false);
        let was = pin(p(7, "1:10"), None);
        assert_eq!(
            judge(&n, &was, &pin(p(7, "1:10"), None)),
            Verdict::Carried(vec![])
        );
        let swapped = stops(judge(&n, &was, &pin(p(8, "1:11"), None)));
        assert!(swapped.contains("oid 7, then 8"), "{swapped}");
        let readded = stops(judge(&n, &was, &pin(p(7, "1:12"), None)));
        assert!(readded.contains("joined it again"), "{readded}");
        let gone = stops(judge(
            &n,
            &was,
            &pin(Err("publication x is gone".into()), None),
        ));
        assert!(gone.contains("publication x is gone"), "{gone}");
        assert!(
            gone.contains("audit --since 2026-11-29T00:00:00Z --repair"),
            "{gone}"
        );
    }

    #[test]
    fn an_edit_of_the_operators_publication_is_carried_by_the_kept_one() {
        let n = names(true);
        let both = pin(p(7, "1:10"), Some(p(7, "2:20")));
        let out = pin(
            Err("publication outbox_relay_x does not publish".into()),
            Some(p(7, "2:20")),
        );
        let Verdict::Carried(lines) = judge(&n, &both, &out) else {
            panic!("stopped")
        };
        assert!(
            lines.len() == 1
                && lines[0].contains("no longer publishes")
                && lines[0].contains("outbox_relay_x_keep"),
            "{lines:?}"
        );
        assert!(out.kept_only());
        // Added back: a new membership row.
        let back = pin(p(7, "1:11"), Some(p(7, "2:20")));
        let Verdict::Carried(lines) = judge(&n, &out, &back) else {
            panic!("stopped")
        };
        assert!(lines[0].contains("publishes the outbox again"), "{lines:?}");
        // Dropped and added back between two checks, or gone.
        assert!(matches!(
            judge(&n, &both, &pin(p(7, "1:12"), Some(p(7, "2:20")))),
            Verdict::Carried(_)
        ));
        assert!(matches!(
            judge(
                &n,
                &both,
                &pin(
                    Err("publication outbox_relay_x is gone".into()),
                    Some(p(7, "2:20"))
                )
            ),
            Verdict::Carried(_)
        ));
    }

    #[test]
    fn an_edit_of_the_streamed_publication_or_a_swap_stops() {
        let n = names(true);
        let both = pin(p(7, "1:10"), Some(p(7, "2:20")));
        let line = stops(judge(&n, &both, &pin(p(7, "1:10"), Some(p(7, "2:21")))));
        assert!(
            line.contains("left publication outbox_relay_x_keep and joined it again"),
            "{line}"
        );
        let line = stops(judge(
            &n,
            &both,
            &pin(p(7, "1:10"), Some(Err("kept out".into()))),
        ));
        assert!(line.contains("kept out"), "{line}");
        let line = stops(judge(&n, &both, &pin(p(8, "1:10"), Some(p(8, "2:20")))));
        assert!(line.contains("oid 7, then 8"), "{line}");
        let out = pin(Err("named out".into()), Some(p(7, "2:20")));
        let line = stops(judge(
            &n,
            &out,
            &pin(Err("named out".into()), Some(p(8, "2:22"))),
        ));
        assert!(line.contains("oid 7, then 8"), "{line}");
    }
}
