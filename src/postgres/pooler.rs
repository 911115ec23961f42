//! A transaction-pooling proxy (PgBouncer's `pool_mode = transaction` or
//! `statement`) between the consumer and Postgres breaks the crew: its
//! lease and member locks are session advisory locks, which such a proxy
//! leaves on a server connection it then hands to other clients, so two
//! dispatchers could each believe they hold the lease. Told at start by
//! whether each of two client connections keeps one backend.
//!
//! The probe, on two connections `a` and `b` (simple-protocol queries,
//! which a pooler passes whatever its prepared-statement support), one
//! query at a time: `b`, `a`, `a`, `b`, `a`, `b`. Direct, or through a
//! session pool, each connection keeps its own backend, and two live
//! connections never share one. Through a transaction pool each query
//! takes an idle backend: handed out last-released first (PgBouncer's
//! default), `a` gets the one `b` just used; oldest first, the backends
//! rotate under each connection. Nothing here waits for a backend, so a
//! session pool that is briefly full is not taken for a transaction pool.
//! Two proxies behind one address (replicas) can still each keep a
//! connection on one backend: the lease's keeper checks its backend at
//! every renewal too (`consumer/lease.rs`).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool, Row};

use crate::error::{Error, Result};

/// The whole check, connections included.
const WITHIN: Duration = Duration::from_secs(10);

/// Refuse a connection that does not keep its backend (see the module doc).
pub async fn check_session_pinned(pool: &PgPool) -> Result<()> {
    check_session_pinned_for(pool, CONSUMER).await
}

/// What the consumer needs of a session.
const CONSUMER: &str = "The consumer's lease and member locks are session advisory locks, which such a proxy leaves to other clients; connect the consumer to Postgres directly, or through a pool in session mode";

/// Refuse a connection that does not keep its backend, saying what of the
/// session `needs` (a sentence, and what to do).
pub async fn check_session_pinned_for(pool: &PgPool, needs: &str) -> Result<()> {
    match tokio::time::timeout(WITHIN, check(pool, needs)).await {
        Ok(verdict) => verdict,
        Err(_) => Err(Error::setup(format!(
            "Postgres did not answer the start-up check of its sessions within {WITHIN:?}"
        ))),
    }
}

async fn check(pool: &PgPool, needs: &str) -> Result<()> {
    // Connections of its own: the pool may be smaller than two.
    let options = pool.connect_options();
    let mut a = PgConnection::connect_with(&options)
        .await
        .map_err(Error::pg("connecting for the pooler check"))?;
    let mut b = PgConnection::connect_with(&options)
        .await
        .map_err(Error::pg("connecting for the pooler check"))?;
    let seen = probe(&mut a, &mut b).await;
    let _ = a.close().await;
    let _ = b.close().await;
    let (seen_a, seen_b) = seen?;
    match verdict(&seen_a, &seen_b) {
        None => Ok(()),
        Some(why) => Err(refusal(&why, needs)),
    }
}

async fn probe(a: &mut PgConnection, b: &mut PgConnection) -> Result<(Vec<i32>, Vec<i32>)> {
    let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
    seen_b.push(pid(b).await?);
    seen_a.push(pid(a).await?);
    seen_a.push(pid(a).await?);
    seen_b.push(pid(b).await?);
    seen_a.push(pid(a).await?);
    seen_b.push(pid(b).await?);
    Ok((seen_a, seen_b))
}

/// Pure: `None` when each connection kept a backend of its own, else
/// what moved or was shared.
fn verdict(a: &[i32], b: &[i32]) -> Option<String> {
    let moved = |name: &str, pids: &[i32]| {
        pids.windows(2)
            .any(|w| w[0] != w[1])
            .then(|| format!("one connection's queries ran on backends {pids:?} ({name})"))
    };
    moved("first", a)
        .or_else(|| moved("second", b))
        .or_else(|| {
            a.iter()
                .any(|p| b.contains(p))
                .then(|| format!("two connections ran on one backend ({a:?} and {b:?})"))
        })
}

fn refusal(why: &str, needs: &str) -> Error {
    Error::setup(format!(
        "DATABASE_URL reaches Postgres through a transaction-pooling proxy (PgBouncer with pool_mode = transaction or statement?): {why}. {needs}"
    ))
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
        // Last released first: every query on the one `b` used first.
        assert!(verdict(&[9, 9, 9], &[9, 9, 9])
            .unwrap()
            .contains("one backend"));
        // Oldest first: the backends rotate.
        assert!(verdict(&[7, 9, 7], &[9, 7, 9]).unwrap().contains("first"));
        assert!(verdict(&[7, 7, 7], &[9, 7, 9]).unwrap().contains("second"));
    }
}
