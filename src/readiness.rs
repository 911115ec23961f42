//! What `/readyz` reports, kept by the service that is (or is not) ready:
//! its phase, a note and a caution it sets, and the NATS connection and
//! Postgres pool it asks to be watched. The components below the
//! operations layer update it; the endpoint ([`crate::ops::endpoint`])
//! only asks.
//!
//! Postgres is checked with a bounded `SELECT 1` shared by every probe
//! within [`PG_CHECK_FRESH`]: a probe storm must not take the working
//! pool's connections (review E1).

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sqlx::PgPool;

/// How long `/readyz` waits for Postgres before calling it unreachable.
const PG_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one Postgres check answers every probe.
const PG_CHECK_FRESH: Duration = Duration::from_secs(1);
/// One check's answer shared by every asker within a freshness: askers
/// while it runs wait for it rather than start their own.
#[derive(Default)]
struct Shared {
    last: tokio::sync::Mutex<Option<(Instant, Option<String>)>>,
}

impl Shared {
    async fn get<F, Fut>(&self, fresh: Duration, check: F) -> Option<String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Option<String>>,
    {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = &*last {
            if at.elapsed() < fresh {
                return answer.clone();
            }
        }
        let answer = check().await;
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}

/// What `/readyz` reports. Cheap to clone; the service updates its phase.
#[derive(Clone, Default)]
pub struct Readiness(Arc<ReadyInner>);

#[derive(Default)]
struct ReadyInner {
    /// `None` when the service is doing its job; otherwise why not.
    phase: Mutex<Option<String>>,
    /// Said beside "ready": what this process does now.
    note: Mutex<Option<String>>,
    /// Said beside "ready" for the process's life: a standing risk found
    /// at start (the note changes with what the process does).
    caution: Mutex<Option<String>>,
    nats: OnceLock<async_nats::Client>,
    postgres: OnceLock<PgPool>,
    pg_check: Shared,
}

impl Readiness {
    pub fn new(phase: impl Into<String>) -> Self {
        let r = Self::default();
        r.not_ready(phase);
        r
    }

    pub fn ready(&self) {
        if let Ok(mut p) = self.0.phase.lock() {
            *p = None;
        }
    }

    /// One line `/readyz` adds to "ready" (what this process does).
    pub fn note(&self, text: impl Into<String>) {
        if let Ok(mut n) = self.0.note.lock() {
            *n = Some(text.into());
        }
    }

    /// A standing risk `/readyz` says beside "ready" (still 200), or
    /// none any more.
    pub fn caution(&self, text: Option<String>) {
        if let Ok(mut c) = self.0.caution.lock() {
            *c = text;
        }
    }

    pub(crate) fn noted(&self) -> Option<String> {
        let note = self.0.note.lock().ok().and_then(|n| n.clone());
        let caution = self.0.caution.lock().ok().and_then(|c| c.clone());
        match (note, caution) {
            (Some(n), Some(c)) => Some(format!("{n}; {c}")),
            (n, c) => n.or(c),
        }
    }

    pub fn not_ready(&self, why: impl Into<String>) {
        if let Ok(mut p) = self.0.phase.lock() {
            *p = Some(why.into());
        }
    }

    /// Also require this NATS connection to be up.
    pub fn watch_nats(&self, client: async_nats::Client) {
        let _ = self.0.nats.set(client);
    }

    /// Also require this pool to answer `SELECT 1`.
    pub fn watch_postgres(&self, pool: PgPool) {
        let _ = self.0.postgres.set(pool);
    }

    /// Empty when ready; otherwise one line per problem.
    pub async fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        match self.0.phase.lock() {
            Ok(p) => out.extend(p.clone()),
            Err(_) => out.push("internal state poisoned".to_owned()),
        }
        if let Some(nats) = self.0.nats.get() {
            let state = nats.connection_state();
            if state != async_nats::connection::State::Connected {
                out.push(format!("NATS: {state}"));
            }
        }
        if let Some(pool) = self.0.postgres.get() {
            let check = || async {
                let ping = sqlx::query("SELECT 1").execute(pool);
                match tokio::time::timeout(PG_CHECK_TIMEOUT, ping).await {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(format!("Postgres: {e}")),
                    Err(_) => Some(format!(
                        "Postgres: no answer within {}s",
                        PG_CHECK_TIMEOUT.as_secs()
                    )),
                }
            };
            out.extend(self.0.pg_check.get(PG_CHECK_FRESH, check).await);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Review E1: every probe ran its own `SELECT 1` on the working pool.
    #[tokio::test]
    async fn a_probe_storm_makes_one_check_a_freshness() {
        let shared = Arc::new(Shared::default());
        let checks = Arc::new(AtomicUsize::new(0));
        let probes = (0..200).map(|_| {
            let (shared, checks) = (shared.clone(), checks.clone());
            tokio::spawn(async move {
                shared
                    .get(Duration::from_secs(60), || async {
                        checks.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Some("Postgres: down".to_owned())
                    })
                    .await
            })
        });
        for p in probes {
            assert_eq!(p.await.unwrap().as_deref(), Some("Postgres: down"));
        }
        assert_eq!(checks.load(Ordering::Relaxed), 1);
        // Past its freshness, the next probe checks again.
        let again = shared
            .get(Duration::ZERO, || async {
                checks.fetch_add(1, Ordering::Relaxed);
                None
            })
            .await;
        assert_eq!((again, checks.load(Ordering::Relaxed)), (None, 2));
    }
}
