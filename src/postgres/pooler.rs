//! A transaction-pooling proxy (PgBouncer's `pool_mode = transaction` or
//! `statement`) between the consumer and Postgres breaks the crew: its
//! lease and member locks are session advisory locks, which such a proxy
//! leaves on a server connection it then hands to other clients, so two
//! dispatchers could each believe they hold the lease. Told at start by
//! whether each of two client connections keeps one backend.
//!
//! The probe, on two connections `a` and `b` (simple-protocol queries,
//! which a pooler passes whatever its prepared-statement support): `a`
//! holds a transaction open while `b` asks, so the two run on different
//! backends; then `a`, `a`, `b`, `b` ask one after the other. Direct, or
//! through a session pool, each connection sees one backend throughout.
//! Through a transaction pool every query takes an idle backend: handed
//! out last-released first (PgBouncer's default) the four run on `a`'s,
//! so `b` moves; oldest first, `a` gets `b`'s at once. A pool of one backend
//! makes `b` wait for `a`'s transaction: that too is a pool. Other clients
//! of the pool only move backends more; nothing makes a direct connection
//! move, so the probe never refuses one.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool, Row};

use crate::error::{Error, Result};

/// How long `b` may wait for a backend while `a` holds one.
const WAIT: Duration = Duration::from_secs(3);

/// Refuse a connection that does not keep its backend (see the module doc).
pub async fn check_session_pinned(pool: &PgPool) -> Result<()> {
    // Connections of its own: the pool may be smaller than two.
    let options = pool.connect_options();
    let mut a = PgConnection::connect_with(&options)
        .await
        .map_err(Error::pg("connecting for the pooler check"))?;
    let mut b = PgConnection::connect_with(&options)
        .await
        .map_err(Error::pg("connecting for the pooler check"))?;
    let verdict = probe(&mut a, &mut b).await;
    let _ = a.close().await;
    let _ = b.close().await;
    verdict
}

async fn probe(a: &mut PgConnection, b: &mut PgConnection) -> Result<()> {
    let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
    if let Err(why) = run(a, "BEGIN").await {
        return Err(refusal(&format!("a transaction block was refused ({why})")));
    }
    seen_a.push(pid(a).await?);
    match tokio::time::timeout(WAIT, pid(b)).await {
        Ok(p) => seen_b.push(p?),
        Err(_) => {
            return Err(refusal(&format!(
                "a second connection waited over {WAIT:?} for a backend while the first held a transaction open"
            )))
        }
    }
    run(a, "COMMIT")
        .await
        .map_err(|e| Error::setup(format!("the pooler check: COMMIT: {e}")))?;
    seen_a.push(pid(a).await?);
    seen_a.push(pid(a).await?);
    seen_b.push(pid(b).await?);
    seen_b.push(pid(b).await?);
    match verdict(&seen_a, &seen_b) {
        None => Ok(()),
        Some(why) => Err(refusal(&why)),
    }
}

/// Pure: `None` when each connection kept one backend, else what moved.
fn verdict(a: &[i32], b: &[i32]) -> Option<String> {
    let moved = |name: &str, pids: &[i32]| {
        pids.windows(2)
            .any(|w| w[0] != w[1])
            .then(|| format!("one connection's queries ran on backends {pids:?} ({name})"))
    };
    moved("first", a).or_else(|| moved("second", b))
}

fn refusal(why: &str) -> Error {
    Error::setup(format!(
        "DATABASE_URL reaches Postgres through a transaction-pooling proxy (PgBouncer with pool_mode = transaction or statement?): {why}. The consumer's lease and member locks are session advisory locks, which such a proxy leaves to other clients; connect the consumer to Postgres directly, or through a pool in session mode"
    ))
}

async fn run(conn: &mut PgConnection, sql: &'static str) -> std::result::Result<(), sqlx::Error> {
    sqlx::raw_sql(sql).execute(conn).await.map(|_| ())
}

async fn pid(conn: &mut PgConnection) -> Result<i32> {
    let row = sqlx::raw_sql("SELECT pg_backend_pid()::text")
        .fetch_one(conn)
        .await
        .map_err(Error::pg("the pooler check: pg_backend_pid()"))?;
    let text: String = row
        .try_get(0)
        .map_err(Error::pg("the pooler check: pg_backend_pid()"))?;
    text.parse()
        .map_err(|_| Error::setup(format!("pg_backend_pid() answered {text:?}")))
}

#[cfg(test)]
mod tests {
    use super::verdict;

    #[test]
    fn a_connection_that_changes_backend_is_a_pool() {
        assert_eq!(verdict(&[7, 7, 7], &[9, 9, 9]), None);
        // Last released first: `b` lands on `a`'s backend.
        assert!(verdict(&[7, 7, 7], &[9, 7, 7]).unwrap().contains("second"));
        // Oldest first: `a` lands on `b`'s at once.
        assert!(verdict(&[7, 9, 7], &[9, 7, 9]).unwrap().contains("first"));
    }
}
