//! One active instance per durable: a Postgres session advisory lock that
//! Postgres itself takes back from a holder gone silent.
//!
//! JetStream hands a durable's messages to whichever instance pulls, so two
//! active instances would run one aggregate's messages at once, and a
//! message pulled by one and lost with it would come back behind later ones
//! the other already ran. Per-aggregate order across instances needs one
//! dispatcher; the others wait (standby, like relays on a slot) and take
//! over when the lock frees.
//!
//! A session lock alone lives as long as its backend, and a backend outlives
//! a frozen client (SIGSTOP, a VM pause: the kernel still answers) or a
//! black-holed one (until TCP keepalive reaps it, about 2 h on Linux). So
//! the lock's connection sets `idle_session_timeout` to [`LEASE_TTL`] and
//! the holder proves itself every [`RENEW`]: a holder silent for
//! [`LEASE_TTL`] loses its backend, and the lock with it, whatever its
//! network or its scheduler does. The holder's own [`Proof`] ends before
//! that ([`MARGIN`] earlier than the server could act, counted from when the
//! last successful ping was *sent*), so a process that thaws after a freeze
//! finds its proof stale and starts nothing, before it has even heard that
//! its connection is gone.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// How long Postgres keeps the lock of a holder that said nothing: the
/// lease connection's `idle_session_timeout`. A standby takes over within
/// this (plus its ask interval and the crew's accounting) of a freeze.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(3);
/// How often the holder proves itself (a ping on the lease connection).
const RENEW: Duration = Duration::from_secs(1);
/// A proof ends this much before the server could free the lock.
const MARGIN: Duration = Duration::from_millis(500);
/// Connecting for the lease waits no longer (a silent Postgres path would
/// otherwise hold a standby's ask for the pool's acquire timeout).
const CONNECT: Duration = Duration::from_secs(5);

/// Until when this process may start work for the durable: handler calls,
/// hand-offs. Renewed by whoever proves the right (the lease's keeper, a
/// helper's beats acknowledged by the dispatcher); read before every start.
#[derive(Clone, Default)]
pub(crate) struct Proof {
    /// Milliseconds since [`origin`], plus one; 0 for none; `u64::MAX`
    /// once revoked, for good (a renewal on its way cannot bring it back).
    until: Arc<AtomicU64>,
}

const REVOKED: u64 = u64::MAX;

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl Proof {
    /// Held until `until` (never moves back: late answers cannot shorten a
    /// newer proof, nor a stale one lengthen it).
    pub fn renew(&self, until: Instant) {
        let ms = until.saturating_duration_since(origin()).as_millis() as u64 + 1;
        let _ = self
            .until
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                (now != REVOKED && ms > now).then_some(ms)
            });
    }

    /// Held until `until`, replacing whatever was held (a helper's proof is
    /// the earlier of two renewals, which may move it back).
    pub fn set(&self, until: Instant) {
        let ms = until.saturating_duration_since(origin()).as_millis() as u64 + 1;
        let _ = self
            .until
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                (now != REVOKED).then_some(ms)
            });
    }

    /// For good: the lease is gone, and a ping answered late must not
    /// revive it.
    pub fn revoke(&self) {
        self.until.store(REVOKED, Ordering::Relaxed);
    }

    /// Whether the proof holds, or comes to hold again within [`REGAIN`]
    /// (a slow ping answered): false once it is revoked, or past that.
    pub async fn regained(&self) -> bool {
        let until = Instant::now() + REGAIN;
        loop {
            if self.holds() {
                return true;
            }
            if self.until.load(Ordering::Relaxed) == REVOKED || Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// When the proof ends, if it holds anything (revoked: `None`).
    pub fn ends(&self) -> Option<Instant> {
        match self.until.load(Ordering::Relaxed) {
            0 | REVOKED => None,
            until => Some(origin() + Duration::from_millis(until - 1)),
        }
    }

    /// Revoked: the lease it proved is gone, and nothing it gated starts.
    pub fn revoked(&self) -> bool {
        self.until.load(Ordering::Relaxed) == REVOKED
    }

    pub fn holds(&self) -> bool {
        let until = self.until.load(Ordering::Relaxed);
        until > 0 && until != REVOKED && (origin().elapsed().as_millis() as u64) < until - 1
    }
}

/// How long a ping sent at `sent` is waited for: until the proof its
/// answer would give ends. The proof of the ping before may end sooner (two
/// slow pings in a row): work then waits ([`Proof::regained`]) instead of
/// ending the period, which costs a takeover and a reset; an answer that
/// comes renews it, and the session that answers still holds the lock.
fn ping_deadline(sent: Instant) -> Instant {
    proof_end(sent)
}

/// How long work waits for a lapsed proof to come back: by then the
/// keeper's ping has been answered, or the lease is lost.
pub(crate) const REGAIN: Duration = LEASE_TTL.saturating_sub(MARGIN);

/// A proof renewed by a ping sent at `sent` ends here.
pub(crate) fn proof_end(sent: Instant) -> Instant {
    sent + LEASE_TTL - MARGIN
}

/// The lease, while held: its keeper pings the connection every [`RENEW`].
pub struct Lease {
    proof: Proof,
    /// Cancelled by the keeper when the lease is lost.
    lost: CancellationToken,
    /// Cancelled to give the lease up.
    stop: CancellationToken,
}

/// The lock's name: one per stream and durable.
fn lock_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay consume {stream}/{durable}")
}

/// The dispatcher's tag: taken on the lease's own connection, keyed by the
/// holder's crew member id, so `pg_locks` says which member holds the lease
/// *now* (both locks go with that one connection).
fn tag_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay dispatcher {stream}/{durable}")
}

/// Whether crew member `member` holds the lease now.
pub async fn held_by(
    pool: &PgPool,
    stream: &str,
    durable: &str,
    member: i32,
) -> sqlx::Result<bool> {
    Ok(holders(pool, &tag_name(stream, durable))
        .await?
        .contains(&member))
}

/// Who holds a two-key advisory lock named `name` in this database now: the
/// objid each took it with (a crew member id). The lease's tag and the
/// crew's member locks are read this one way.
pub(super) async fn holders(pool: &PgPool, name: &str) -> sqlx::Result<HashSet<i32>> {
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT objid::text::bigint FROM pg_locks \
         WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND classid = hashtext($1)::oid",
    )
    .bind(name)
    .fetch_all(pool)
    .await?;
    Ok(ids
        .into_iter()
        .filter_map(|i| i32::try_from(i).ok())
        .collect())
}

/// A connection whose session Postgres ends after [`LEASE_TTL`] without a
/// statement: what holds a session lock on it is time-bounded.
pub(crate) async fn bounded_session(pool: &PgPool, what: &'static str) -> Result<PgConnection> {
    let mut conn = tokio::time::timeout(CONNECT, pool.acquire())
        .await
        .map_err(|_| Error::pg(what)(sqlx::Error::PoolTimedOut))?
        .map_err(Error::pg(what))?
        .detach();
    tokio::time::timeout(
        RENEW,
        sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
            .bind(format!("{}ms", LEASE_TTL.as_millis()))
            .execute(&mut conn),
    )
    .await
    .map_err(|_| Error::pg(what)(sqlx::Error::PoolTimedOut))?
    .map_err(Error::pg(
        "setting idle_session_timeout (PostgreSQL 14 or newer)",
    ))?;
    Ok(conn)
}

impl Lease {
    /// Take the lock if free, tagged with crew member `member` (see
    /// [`held_by`]), on `asking`: the connection a standby asks on, kept
    /// between asks (made here when there is none; dropped on an error).
    /// Taken, the connection becomes the lease's.
    pub async fn try_acquire(
        pool: &PgPool,
        asking: &mut Option<PgConnection>,
        stream: &str,
        durable: &str,
        member: Option<i32>,
    ) -> Result<Option<Lease>> {
        let mut conn = match asking.take() {
            Some(c) => c,
            None => bounded_session(pool, "connecting for the consumer lease").await?,
        };
        let sent = Instant::now();
        // With the backend that took it: a proxy that moved this
        // connection to another (transaction pooling) has lost it.
        let (got, backend): (bool, i32) = tokio::time::timeout(
            RENEW,
            sqlx::query_as(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0)), pg_backend_pid()",
            )
            .bind(lock_name(stream, durable))
            .fetch_one(&mut conn),
        )
        .await
        .map_err(|_| Error::pg("pg_try_advisory_lock")(sqlx::Error::PoolTimedOut))?
        .map_err(Error::pg("pg_try_advisory_lock"))?;
        if !got {
            *asking = Some(conn);
            return Ok(None);
        }
        if let Some(member) = member {
            // Only a connection of this process's could hold it (a member id
            // is this process's own lock): not waited for.
            let tagged: bool = tokio::time::timeout(
                RENEW,
                sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1), $2)")
                    .bind(tag_name(stream, durable))
                    .bind(member)
                    .fetch_one(&mut conn),
            )
            .await
            .map_err(|_| Error::pg("tagging the consumer lease")(sqlx::Error::PoolTimedOut))?
            .map_err(Error::pg("tagging the consumer lease"))?;
            if !tagged {
                let _ = conn.close().await;
                return Ok(None);
            }
        }
        let proof = Proof::default();
        proof.renew(proof_end(sent));
        let (lost, stop) = (CancellationToken::new(), CancellationToken::new());
        tokio::spawn(keep(
            conn,
            backend,
            proof.clone(),
            lost.clone(),
            stop.clone(),
        ));
        Ok(Some(Lease { proof, lost, stop }))
    }

    /// Whether (and until when) this process may start work as dispatcher.
    pub fn proof(&self) -> Proof {
        self.proof.clone()
    }

    /// Fires when the lease is lost (its connection failed or went silent).
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }
}

/// Dropping the lease gives the lock up: the keeper closes the connection
/// (at once, or by dropping it when the server does not answer).
impl Drop for Lease {
    fn drop(&mut self) {
        self.proof.revoke();
        self.stop.cancel();
    }
}

/// Prove the lease every [`RENEW`] until `stop`, or until a ping fails or
/// does not answer while the proof it would renew still holds: then the
/// lease is lost (the server frees the lock within [`LEASE_TTL`] of the
/// last ping at the latest). A slow answer that comes while that proof
/// holds is no loss (a loss costs a takeover and a reset).
async fn keep(
    mut conn: PgConnection,
    backend: i32,
    proof: Proof,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(RENEW);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                let _ = tokio::time::timeout(RENEW, conn.close()).await;
                return;
            }
            _ = tick.tick() => {}
        }
        let sent = Instant::now();
        // The simple protocol: one round trip, the first ping too (a
        // statement prepared first costs two on a slow path).
        let same_backend = async {
            let row = sqlx::raw_sql("SELECT pg_backend_pid()")
                .fetch_one(&mut conn)
                .await?;
            sqlx::Row::try_get::<i32, _>(&row, 0)
        };
        let deadline = ping_deadline(sent);
        match tokio::time::timeout_at(deadline.into(), same_backend).await {
            Ok(Ok(pid)) if pid == backend => proof.renew(proof_end(sent)),
            _ => {
                proof.revoke();
                lost.cancel();
                // Dropped, not closed: a silent server would hold the close.
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_until_its_end_and_not_after_a_revoke() {
        let p = Proof::default();
        assert!(!p.holds(), "a new proof holds nothing");
        p.renew(Instant::now() + Duration::from_secs(5));
        assert!(p.holds());
        p.renew(Instant::now() - Duration::from_secs(1));
        assert!(p.holds(), "a late, older renewal does not shorten it");
        p.set(Instant::now() - Duration::from_millis(1));
        assert!(!p.holds(), "set moves it back");
        p.renew(Instant::now() + Duration::from_secs(5));
        p.revoke();
        assert!(!p.holds());
        p.renew(Instant::now() + Duration::from_secs(5));
        p.set(Instant::now() + Duration::from_secs(5));
        assert!(!p.holds(), "a revoked proof stays revoked");
    }

    #[test]
    fn a_slow_ping_is_waited_for_until_the_proof_it_gives_ends() {
        // Review N8: one ping slower than its 1 s interval ended the period;
        // then two in a row, 1.3 s each, outlived the first one's proof.
        let sent = Instant::now();
        let next = sent + Duration::from_millis(1_300);
        assert!(ping_deadline(next) > next + Duration::from_millis(1_300));
        assert!(ping_deadline(next) > proof_end(sent));
        assert!(
            ping_deadline(next) < next + LEASE_TTL,
            "never past the server's own"
        );
    }

    #[tokio::test]
    async fn a_lapsed_proof_is_waited_for_until_renewed_or_revoked() {
        let p = Proof::default();
        p.renew(Instant::now() - Duration::from_millis(1));
        let renewer = p.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            renewer.renew(Instant::now() + Duration::from_secs(5));
        });
        assert!(p.regained().await, "renewed by a late answer");
        let q = Proof::default();
        let revoker = q.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            revoker.revoke();
        });
        assert!(!q.regained().await, "revoked: the lease is lost");
    }

    #[test]
    fn a_proof_ends_before_the_server_frees_the_lock() {
        let sent = Instant::now();
        assert!(proof_end(sent) < sent + LEASE_TTL);
        assert!(proof_end(sent) > sent + RENEW * 2, "room for a late ping");
        assert!(proof_end(sent) < sent + super::super::crew::GRACE);
    }
}
