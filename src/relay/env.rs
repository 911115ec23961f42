//! What every session of one relay shares, and what the relay reports when
//! it stops: a leaf, so the sessions, the first start's backfill and the
//! loop that runs them all see it without seeing each other.

use std::sync::atomic::{AtomicI64, Ordering};

use async_nats::jetstream;
use pgwire_replication::Lsn;

use super::config::RelayConfig;
use super::outbox_row;
use crate::postgres::Dsn;
use crate::readiness::Readiness;

/// What every session of one relay shares (the first start's backfill too).
pub(crate) struct Env<'a> {
    pub cfg: &'a RelayConfig,
    pub dsn: &'a Dsn,
    pub pool: &'a sqlx::PgPool,
    pub js: &'a jetstream::Context,
    pub nats: &'a async_nats::Client,
    pub ready: &'a Readiness,
    pub lag: &'a LagClock,
}

/// The commit time of the oldest event read and not yet acked, shared by
/// every session of the process: a session that ends with events unacked
/// leaves it in place, so the lag keeps growing until a later session
/// publishes them (it reads them again) or finds nothing to publish.
#[derive(Debug, Default)]
pub(crate) struct LagClock {
    /// Postgres-epoch microseconds; 0 when nothing is unacked.
    oldest: AtomicI64,
}

impl LagClock {
    pub(crate) fn set(&self, oldest_pg_micros: Option<i64>) {
        self.oldest
            .store(oldest_pg_micros.unwrap_or(0), Ordering::Relaxed);
    }

    /// Seconds from the oldest unacked commit to `now_unix_micros`; 0 when
    /// nothing is unacked.
    pub(crate) fn seconds_at(&self, now_unix_micros: i64) -> f64 {
        match self.oldest.load(Ordering::Relaxed) {
            0 => 0.0,
            pg => {
                let commit = pg.saturating_add(outbox_row::PG_EPOCH_UNIX_MICROS);
                (now_unix_micros - commit).max(0) as f64 / 1e6
            }
        }
    }
}

/// What the process reports when it stops.
#[derive(Debug, Clone, Copy)]
pub struct Stopped {
    /// The last position this process confirmed to the slot, over all
    /// its sessions (0/0: none).
    pub confirmed: Lsn,
}
