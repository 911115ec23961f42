//! What the console's handlers share: the pools, the streams it reads,
//! and the bound on refusals recorded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::triage::Class;

use async_nats::jetstream;
use sqlx::PgPool;
use tokio::sync::Semaphore;

/// Refusals recorded in `outbox_admin_log` per second, at most (a flood of
/// bad tokens must not become a flood of rows, nor wait on the log's
/// lock): past it they are counted in `outbox_admin_actions_total` alone,
/// and the next recorded one says how many were not.
const DENIALS_PER_SECOND: u32 = 100;

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct Console(pub(super) Arc<Inner>);

pub(crate) struct Inner {
    pub pool: PgPool,
    pub js: jetstream::Context,
    pub busy: Arc<Semaphore>,
    /// Token checks at once.
    pub checks: Semaphore,
    /// Listings of dead letters at once (each holds many letters' headers).
    pub listings: Semaphore,
    pub settings: Settings,
    /// The replay jobs this console runs, to cancel.
    pub jobs: Mutex<HashMap<uuid::Uuid, CancellationToken>>,
    /// OIDC, when the console takes JWTs (`--oidc-issuer`).
    pub oidc: Option<super::oidc::Oidc>,
    /// Held while a durable is reset (its key looked up, the reset done
    /// and recorded): the same key twice at once resets once.
    pub resets: tokio::sync::Mutex<()>,
    /// This second's refusals recorded, and those not since the last one.
    denials: Mutex<Denials>,
}

/// What the console is told at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The streams read for dead letters; empty: every stream of the
    /// account but key-value and object stores.
    pub streams: Vec<String>,
    /// Classes an `operator` may replay (seed 001: replay is `admin`'s).
    pub operator_classes: Vec<Class>,
    /// Letters a replay job sends a second, at most.
    pub replay_rate: f64,
    /// Admins who sign a deletion off: 2 (one asks, another approves), or
    /// 1 for a team of one.
    pub delete_approvals: u8,
    /// OIDC bearer JWTs taken beside the console's tokens.
    pub oidc: Option<super::oidc::Config>,
    /// HTTPS, and client certificates.
    pub tls: Option<super::tls::Config>,
}

#[derive(Default)]
struct Denials {
    second: Option<Instant>,
    recorded: u32,
    unrecorded: u64,
}

impl Console {
    pub fn new(
        pool: PgPool,
        js: jetstream::Context,
        settings: Settings,
        busy: Arc<Semaphore>,
    ) -> crate::error::Result<Console> {
        let oidc = settings
            .oidc
            .clone()
            .map(super::oidc::Oidc::new)
            .transpose()?;
        Ok(Console(Arc::new(Inner {
            pool,
            js,
            busy,
            checks: Semaphore::new(8),
            listings: Semaphore::new(2),
            settings,
            jobs: Mutex::new(HashMap::new()),
            resets: tokio::sync::Mutex::new(()),
            oidc,
            denials: Mutex::new(Denials::default()),
        })))
    }

    /// Whether this refusal is recorded, and how many before it were not.
    pub fn admit_denial(&self) -> Option<u64> {
        let mut d = self.0.denials.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if d.second
            .is_none_or(|s| now.duration_since(s) >= Duration::from_secs(1))
        {
            d.second = Some(now);
            d.recorded = 0;
        }
        if d.recorded < DENIALS_PER_SECOND {
            d.recorded += 1;
            Some(std::mem::take(&mut d.unrecorded))
        } else {
            d.unrecorded += 1;
            None
        }
    }
}
