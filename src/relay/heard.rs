//! Postgres still hears the replication connection. A path that goes
//! silent without a reset (a host that vanished, a route dropped, a
//! firewall that forgets the flow) leaves the socket open and quiet: the
//! relay would wait on it until TCP gives up (about 15 minutes of
//! retransmissions, never behind a proxy that keeps the socket open),
//! "ready", with lag 0, while events commit. Quiet is normal (an idle
//! database sends nothing), so silence is told from the server's side: the
//! walsender records the send time of every status update the relay sends
//! (`pg_stat_replication.reply_time`), and the relay sends one at least
//! every second whatever it is doing (backpressure included). A check on a
//! connection of its own, every [`EVERY`], that sees it stand still for
//! [`SILENT_AFTER`] (or the walsender gone) proves the path silent: the
//! session ends, the silent walsender is ended too (it would hold the slot
//! until `wal_sender_timeout`), and the next session streams on a new
//! connection. A check Postgres does not answer proves nothing; after
//! [`UNPROVEN_AFTER`] without one, `/readyz` says the relay cannot tell.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};
use tokio_util::sync::CancellationToken;

use super::guard::Notice;
use crate::metrics as m;

/// How often the check runs.
const EVERY: Duration = Duration::from_secs(2);
/// A check (or its connection) slower than this says nothing.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// The server's record of the relay standing still this long (and over
/// [`MIN_CHECKS`] checks: a thawed process's first check proves nothing)
/// is a silent path.
pub(super) const SILENT_AFTER: Duration = Duration::from_secs(15);
const MIN_CHECKS: u32 = 4;
/// Without a good check this long, readiness says the relay cannot tell.
const UNPROVEN_AFTER: Duration = Duration::from_secs(30);

/// One check's answer: whether the walsender is still there, and what
/// Postgres shows of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Seen {
    /// Not a walsender any more (ended: by the server, or never ours).
    Gone,
    /// The role may not read the walsender's details (it needs
    /// `pg_read_all_stats`): nothing can be told.
    Hidden,
    /// Busy (decoding, reading WAL or spill files): a walsender reads
    /// replies only while it waits, or every `wal_sender_timeout / 2` while
    /// it replays one large transaction, so a still record proves nothing.
    Busy,
    /// The send time of the last status update Postgres received.
    Reply(Option<String>),
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Heard,
    Waiting,
    Hidden,
    Silent(Duration),
}

/// The pure rule: how long the server's record has stood still.
#[derive(Debug)]
pub(super) struct Judge {
    last: Option<Seen>,
    since: Instant,
    checks: u32,
    /// Checks in a row that found the walsender gone.
    gone: u32,
}

/// Found gone this many checks in a row, the walsender is not coming back
/// and the connection did not say so: silent. (The first may race the
/// connection's own error, which ends the session anyway.)
const GONE_CHECKS: u32 = 2;

impl Judge {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            last: None,
            since: now,
            checks: 0,
            gone: 0,
        }
    }

    pub(super) fn on_check(&mut self, now: Instant, seen: Seen) -> Verdict {
        let still = |since: Instant| now.saturating_duration_since(since);
        match seen {
            Seen::Hidden => Verdict::Hidden,
            // The server ended it (`wal_sender_timeout`, a restart): this
            // end heard nothing of that either.
            Seen::Gone => {
                self.gone += 1;
                if self.gone >= GONE_CHECKS {
                    Verdict::Silent(still(self.since))
                } else {
                    Verdict::Waiting
                }
            }
            Seen::Busy => {
                self.since = now;
                self.checks = 0;
                self.gone = 0;
                Verdict::Waiting
            }
            Seen::Reply(_) if self.last.as_ref() != Some(&seen) => {
                self.last = Some(seen);
                self.since = now;
                self.checks = 0;
                self.gone = 0;
                Verdict::Heard
            }
            Seen::Reply(_) => {
                self.gone = 0;
                self.checks += 1;
                if still(self.since) >= SILENT_AFTER && self.checks >= MIN_CHECKS {
                    Verdict::Silent(still(self.since))
                } else {
                    Verdict::Waiting
                }
            }
        }
    }
}

/// Check every [`EVERY`] until `stop` that Postgres hears the walsender
/// `pid`, and send the line to end the session with once it does not
/// (having ended that walsender); and, while no check has answered for
/// [`UNPROVEN_AFTER`], the line for `/readyz` (`None` once one answers
/// again). The session owns its readiness: it says what it is told.
pub(super) fn watch(
    options: PgConnectOptions,
    pid: i32,
    slot: String,
    tx: tokio::sync::mpsc::Sender<Notice>,
) -> CancellationToken {
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut judge = Judge::new(Instant::now());
        let mut conn: Option<PgConnection> = None;
        let (mut good, mut hidden_said, mut unproven) = (Instant::now(), false, false);
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            let seen = tokio::select! {
                _ = stopped.cancelled() => return,
                seen = check(&options, &mut conn, pid) => seen,
            };
            let seen = match seen {
                Ok(seen) => seen,
                Err(e) => {
                    // A connection that did not answer may be the silent
                    // path itself: the next check opens another.
                    conn = None;
                    if !unproven && good.elapsed() >= UNPROVEN_AFTER {
                        unproven = true;
                        let line = format!(
                            "cannot tell whether Postgres still hears the replication connection: no check answered for {} s ({e})",
                            good.elapsed().as_secs()
                        );
                        tracing::warn!("{line}");
                        let _ = tx.send(Notice::Unproven(Some(line))).await;
                    }
                    continue;
                }
            };
            good = Instant::now();
            if unproven {
                unproven = false;
                let _ = tx.send(Notice::Unproven(None)).await;
            }
            match judge.on_check(Instant::now(), seen) {
                Verdict::Heard | Verdict::Waiting => {}
                Verdict::Hidden => {
                    if !hidden_said {
                        hidden_said = true;
                        tracing::warn!(
                            "this role cannot read pg_stat_replication's details, so a silent path to Postgres (a vanished host, a dropped route) is noticed only when TCP gives up, after about 15 minutes: GRANT pg_read_all_stats TO the relay's role"
                        );
                    }
                }
                Verdict::Silent(still) => {
                    metrics::counter!(m::REPLICATION_SILENCES).increment(1);
                    let ended = match conn.as_mut() {
                        Some(c) => end_walsender(c, pid, &slot).await,
                        None => false,
                    };
                    let line = format!(
                        "the replication connection went silent: Postgres has heard nothing from it for {} s (a vanished host, a dropped route); {} and streaming again on a new connection",
                        still.as_secs(),
                        if ended {
                            "ended its walsender"
                        } else {
                            "its walsender is gone, or ends by itself (wal_sender_timeout)"
                        }
                    );
                    let _ = tx.send(Notice::Silent(line)).await;
                    return;
                }
            }
        }
    });
    stop
}

async fn check(
    options: &PgConnectOptions,
    conn: &mut Option<PgConnection>,
    pid: i32,
) -> std::result::Result<Seen, String> {
    let run = async {
        if conn.is_none() {
            *conn = Some(options.connect().await.map_err(|e| e.to_string())?);
        }
        let Some(c) = conn.as_mut() else {
            return Err("no connection".to_owned());
        };
        // `state` is NULL exactly when the details are hidden from this
        // role. The wait events are those in which a walsender reads what
        // the relay sends (its main loop, waiting for WAL, waiting to write).
        let row: Option<(Option<String>, Option<String>, bool)> = sqlx::query_as(
            "SELECT r.state, r.reply_time::text, \
                    coalesce(a.wait_event IN ('WalSenderMain', 'WalSenderWaitForWAL', 'WalSenderWriteData'), false) \
             FROM pg_stat_replication r LEFT JOIN pg_stat_activity a ON a.pid = r.pid \
             WHERE r.pid = $1",
        )
        .bind(pid)
        .fetch_optional(&mut *c)
        .await
        .map_err(|e| e.to_string())?;
        Ok(match row {
            None => Seen::Gone,
            Some((None, _, _)) => Seen::Hidden,
            Some((Some(_), _, false)) => Seen::Busy,
            Some((Some(_), reply, true)) => Seen::Reply(reply),
        })
    };
    match tokio::time::timeout(CHECK_TIMEOUT, run).await {
        Ok(r) => r,
        Err(_) => Err("no answer in time".to_owned()),
    }
}

/// End the silent walsender, which holds the slot until
/// `wal_sender_timeout`; only while it still holds the relay's slot (the
/// pid may be reused by then).
async fn end_walsender(conn: &mut PgConnection, pid: i32, slot: &str) -> bool {
    let ended = sqlx::query_scalar::<_, bool>(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
         WHERE slot_name = $1 AND active_pid = $2",
    )
    .bind(slot)
    .bind(pid)
    .fetch_optional(&mut *conn);
    match tokio::time::timeout(CHECK_TIMEOUT, ended).await {
        Ok(Ok(Some(true))) => true,
        Ok(Ok(_)) => false,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, pid, "could not end the silent walsender");
            false
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(t: &str) -> Seen {
        Seen::Reply(Some(t.to_owned()))
    }

    #[test]
    fn a_record_that_stands_still_long_enough_and_over_enough_checks_is_silence() {
        let t0 = Instant::now();
        let mut j = Judge::new(t0);
        assert_eq!(j.on_check(t0, reply("a")), Verdict::Heard);
        let s = Duration::from_secs;
        // Moving: heard, however long it runs.
        for i in 1..20u64 {
            let v = j.on_check(t0 + s(i * 2), reply(&i.to_string()));
            assert_eq!(v, Verdict::Heard);
        }
        let t1 = t0 + s(40);
        assert_eq!(j.on_check(t1, reply("x")), Verdict::Heard);
        // Standing still: waiting until SILENT_AFTER and MIN_CHECKS.
        for i in 1..MIN_CHECKS {
            assert_eq!(
                j.on_check(t1 + s(2 * i as u64), reply("x")),
                Verdict::Waiting
            );
        }
        // A thawed process: one check, long after the last, proves nothing.
        let mut thawed = Judge::new(t0);
        thawed.on_check(t0, reply("x"));
        assert_eq!(thawed.on_check(t0 + s(60), reply("x")), Verdict::Waiting);
        assert_eq!(
            j.on_check(t1 + SILENT_AFTER, reply("x")),
            Verdict::Silent(SILENT_AFTER)
        );
    }

    #[test]
    fn a_busy_walsender_proves_nothing_however_long_its_record_stands_still() {
        // Replaying one large transaction, a walsender reads replies only
        // every wal_sender_timeout / 2 (30 s by default).
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut j = Judge::new(t0);
        j.on_check(t0, reply("a"));
        for i in 1..=40u64 {
            let seen = if i % 5 == 0 { reply("a") } else { Seen::Busy };
            assert_eq!(j.on_check(t0 + s(i), seen), Verdict::Waiting, "{i}");
        }
        // Waiting (it reads replies) with the record still: silence.
        let t1 = t0 + s(41);
        let mut last = Verdict::Waiting;
        for i in 0..=(SILENT_AFTER.as_secs() / 2 + 1) {
            last = j.on_check(t1 + s(2 * i), reply("a"));
        }
        assert!(matches!(last, Verdict::Silent(_)), "{last:?}");
    }

    #[test]
    fn a_walsender_found_gone_twice_is_silence_and_hidden_details_tell_nothing() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut j = Judge::new(t0);
        j.on_check(t0, reply("a"));
        assert_eq!(j.on_check(t0 + s(2), Seen::Gone), Verdict::Waiting);
        // Back (a check that raced a restart of the record): heard.
        assert_eq!(j.on_check(t0 + s(4), reply("b")), Verdict::Heard);
        assert_eq!(j.on_check(t0 + s(6), Seen::Gone), Verdict::Waiting);
        assert_eq!(j.on_check(t0 + s(8), Seen::Gone), Verdict::Silent(s(4)));
        let mut h = Judge::new(t0);
        for i in 0..30 {
            assert_eq!(h.on_check(t0 + s(i), Seen::Hidden), Verdict::Hidden);
        }
    }
}
