//! This process's place in the crew: its member lock (a session advisory
//! lock Postgres ends with the session), who else holds one, and the
//! transactions of processes taken for lost, ended.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use super::rule::{LIVENESS, LIVENESS_WAIT, PING};
use crate::error::{Error, Result};
use crate::metrics as m;

pub(super) fn lock_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay crew {stream}/{durable}")
}

/// Which processes' transactions [`end_transactions`] ends.
pub(super) enum Fenced<'a> {
    /// These, taken for lost.
    Members(&'a HashSet<i32>),
    /// All but these (the processes that answered a takeover, this one
    /// included).
    AllBut(&'a HashSet<i32>),
}

/// End the inbox transactions of processes whose jobs the crew takes for
/// lost, before their messages run again elsewhere. A frozen process (a VM
/// pause, SIGSTOP) keeps its group transaction open, and with it the row
/// locks of up to [`MAX_GROUP`](crate::consumer::transaction::MAX_GROUP) messages,
/// until Postgres ends it as idle past the handler's call timeout (30 s
/// and more): each claim elsewhere that names one of them waits as long,
/// with the unrelated messages of its own group. Nothing of an ended
/// transaction commits, so the handler's effects stay exactly-once; the
/// thawed process finds its connection gone. Needs the right to signal
/// the processes' backends (the same role, or `pg_signal_backend`); without
/// it, the wait is Postgres's.
pub(super) async fn end_transactions(pool: &PgPool, stream: &str, durable: &str, who: Fenced<'_>) {
    let (ids, all_but): (Vec<i32>, bool) = match who {
        Fenced::Members(m) => (m.iter().copied().collect(), false),
        Fenced::AllBut(m) => (m.iter().copied().collect(), true),
    };
    let ending = async {
        let marked: Vec<(i32, i64)> = sqlx::query_as(
            "SELECT DISTINCT pid, objid::text::bigint FROM pg_locks \
             WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND classid = hashtext($1)::oid AND pid <> pg_backend_pid() \
               AND (objid::text::bigint = ANY($2)) <> $3",
        )
        .bind(crate::consumer::transaction::mark_name(stream, durable))
        .bind(&ids)
        .bind(all_but)
        .fetch_all(pool)
        .await?;
        // One by one, so a session this role may not signal (another
        // role's, a superuser's) does not keep the others; each waited for
        // (up to 1 s) to exit, so its locks are gone when the messages are
        // delivered again.
        let ends = marked.into_iter().map(|(pid, member)| async move {
            let ended = sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1, 1000)")
                .bind(pid)
                .fetch_one(pool)
                .await;
            match ended {
                Ok(true) => {
                    metrics::counter!(m::CONSUMER_CREW_TRANSACTIONS_ENDED).increment(1);
                    tracing::warn!(pid, member, "ended an inbox transaction of a process whose jobs run elsewhere now (taken for lost, or silent at a takeover)");
                }
                Ok(false) => tracing::warn!(pid, member, "an inbox transaction of a process whose jobs run elsewhere now did not end within 1 s"),
                Err(e) => tracing::warn!(pid, member, error = %e, "cannot end an inbox transaction of a process whose jobs run elsewhere now: its messages wait until Postgres ends it (idle past the handler's call timeout); grant the consumer's role pg_signal_backend"),
            }
        });
        futures::future::join_all(ends).await;
        Ok::<_, sqlx::Error>(())
    };
    match tokio::time::timeout(END_WAIT, ending).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot look for the inbox transactions of a process whose jobs run elsewhere now: its messages wait until Postgres ends them (idle past the handler's call timeout)"),
        Err(_) => tracing::warn!(
            "ending the inbox transactions of a process whose jobs run elsewhere now took over {END_WAIT:?}"
        ),
    }
}

/// Bounds [`end_transactions`]: each backend is given a second to exit.
pub(super) const END_WAIT: Duration = Duration::from_secs(3);

/// This process's place in the crew: a session advisory lock that lives as
/// long as its connection.
pub(crate) struct Member {
    pub(super) conn: PgConnection,
    pub id: i32,
}

impl Member {
    pub async fn join(pool: &PgPool, stream: &str, durable: &str) -> Result<Member> {
        // Time-bounded like the lease: a frozen or cut-off process's lock
        // goes within LEASE_TTL, and with it the crew's wait for its jobs.
        let mut conn =
            crate::consumer::lease::bounded_session(pool, "connecting for the crew membership")
                .await?;
        loop {
            // Positive, so pg_locks shows it as written.
            let id = (uuid::Uuid::new_v4().as_u128() as u32 >> 1) as i32;
            if id != 0 && lock_as(&mut conn, stream, durable, id).await? {
                return Ok(Member { conn, id });
            }
        }
    }

    /// Take the lock under `id` again (its connection failed): `None` while
    /// another session (this process's old one, alive still) holds it.
    pub async fn join_as(
        pool: &PgPool,
        stream: &str,
        durable: &str,
        id: i32,
    ) -> Result<Option<Member>> {
        let mut conn =
            crate::consumer::lease::bounded_session(pool, "connecting for the crew membership")
                .await?;
        let got = lock_as(&mut conn, stream, durable, id).await?;
        Ok(got.then_some(Member { conn, id }))
    }

    /// The lock is still ours: its connection answers within [`PING`]. A
    /// connection cut off without a reset would otherwise hang the check.
    /// Postgres's clock as it answered (see [`rule::clock_stood_still`]).
    pub async fn held(&mut self) -> Option<f64> {
        let now = sqlx::query_scalar::<_, f64>(SERVER_CLOCK).fetch_one(&mut self.conn);
        match tokio::time::timeout(PING, now).await {
            Ok(Ok(t)) => Some(t),
            _ => None,
        }
    }
}

/// Postgres's clock, in seconds since the epoch.
pub(super) const SERVER_CLOCK: &str = "SELECT extract(epoch FROM clock_timestamp())::float8";

/// Take the member lock `id` on `conn`, if no other session holds it.
pub(super) async fn lock_as(
    conn: &mut PgConnection,
    stream: &str,
    durable: &str,
    id: i32,
) -> Result<bool> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1), $2)")
        .bind(lock_name(stream, durable))
        .bind(id)
        .fetch_one(conn)
        .await
        .map_err(Error::pg("pg_try_advisory_lock"))
}

/// The members alive now (their lock is held), this one included.
pub(super) async fn alive(
    pool: &PgPool,
    stream: &str,
    durable: &str,
) -> sqlx::Result<HashSet<i32>> {
    crate::consumer::lease::holders(pool, &lock_name(stream, durable)).await
}

/// Ask Postgres who is alive each [`LIVENESS`], off the loop that reads the
/// crew's beats: an answer may take its whole timeout (a slow or far
/// database), and beats queued behind it would be acknowledged late, their
/// senders' proofs lapsing while they were heard all along. Each answer is
/// dated when it came (a lock seen gone ages from later than Postgres saw
/// it: the safe side); none in time is `None` (silence still counts).
pub(super) async fn poll_liveness(
    pool: PgPool,
    stream: String,
    durable: String,
    answers: tokio::sync::mpsc::Sender<(Option<HashSet<i32>>, Instant, Instant)>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(LIVENESS);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let asked = Instant::now();
        let alive = tokio::time::timeout(LIVENESS_WAIT, alive(&pool, &stream, &durable))
            .await
            .ok()
            .and_then(Result::ok);
        if answers.send((alive, asked, Instant::now())).await.is_err() {
            return;
        }
    }
}
