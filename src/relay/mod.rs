//! The relay: replication stream → decode → route → publish → slot ack.
//!
//! ```text
//!  pgwire-replication ──events──▶ session (decode ▶ route) ──publish──▶ Publisher (window)
//!        ▲                          │   ▲                                     │
//!        └── update_applied_lsn ────┘   └──────── acks, in order ─────────────┘
//!                 (Watermark: commit end LSNs whose events are all acked)
//! ```
//!
//! Files, in the data's order: [`pgoutput`] (wire decode), [`outbox_row`]
//! (columns → row), [`route`] (row → subject, headers, body), [`decode`] (the
//! I/O-free stage that ties them to transactions and the resume point),
//! [`publish`] (JetStream, in order), [`watermark`] (what the slot may
//! confirm) and [`session`] (one replication connection, driving them all).
//!
//! Recovery is crash-only: any transient error ends the session; the next
//! one starts from the slot's confirmed LSN and skips the events the stream
//! already holds ([`publish::stored_tail`], [`readback`]). A kill -9 takes the same path,
//! so the path is exercised, not hoped for.

mod acks;
mod answer;
pub(crate) mod backfill;
pub(crate) mod batch;
pub(crate) mod columns;
pub mod config;
pub(crate) mod decode;
pub(crate) mod emitted;
mod env;
pub(crate) mod fence;
pub(crate) mod guard;
pub(crate) mod heard;
pub(crate) mod link;
pub(crate) mod outbox_row;
pub(crate) mod pgoutput;
pub(crate) mod publish;
pub(crate) mod readback;
pub(crate) mod route;
mod session;
pub(crate) mod watermark;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgwire_replication::Lsn;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::error::{Class, Error, Result};
use crate::metrics as m;
use crate::postgres::Dsn;
use crate::readiness::Readiness;
use config::RelayConfig;
pub use env::Stopped;
use env::{Env, LagClock};
use session::Session;

/// How often a halted relay tries a session again.
const HALTED_RETRY: Duration = Duration::from_secs(30);

/// How long a session waits for a connection of the pool made anew after a
/// silent path (as long as the first pool's).
const POOL_ACQUIRE: Duration = Duration::from_secs(10);

/// A session that streamed this long resets the reconnect backoff.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// How often a standby asks for the slot: a takeover comes within about
/// this long of the active relay's walsender going away.
const STANDBY_POLL: Duration = Duration::from_secs(1);

/// How often `outbox_relay_lag_seconds` is brought up to date.
const LAG_TICK: Duration = Duration::from_secs(1);

/// Keep `outbox_relay_lag_seconds` current, also while no session runs.
async fn lag_gauge(clock: Arc<LagClock>, stop: CancellationToken) {
    let gauge = metrics::gauge!(m::RELAY_LAG_SECONDS);
    let mut tick = tokio::time::interval(LAG_TICK);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => gauge.set(clock.seconds_at(session::unix_micros_now())),
        }
    }
}

/// Run until `shutdown`, reconnecting after transient failures. Errors that
/// retrying cannot fix (configuration, privileges) end the run; so does any
/// error before the first session streamed or found the slot held, so a
/// wrong URL fails at once.
///
/// A slot held by another process is not an error but standby (SPEC §9):
/// relays with the same settings coordinate through the slot, which only one
/// walsender can hold. This one waits, says so on `/readyz` and
/// `outbox_relay_standby`, and takes over when the slot frees; a relay
/// restarted at once after a kill -9 takes the same path while the old
/// walsender lingers.
///
/// `ready` is told the phase: ready only while streaming from the slot.
pub async fn run(
    cfg: RelayConfig,
    ready: Readiness,
    shutdown: CancellationToken,
) -> Result<Stopped> {
    m::register_relay();
    let dsn = Dsn::parse(&cfg.database_url)?;
    let mut pool = dsn.pool(2).await?;
    // Set-up, tail scans and a batch's look-up; every publish (event by
    // event, and atomic batches with their commits) goes on a connection
    // of its own (`link`).
    let nats = crate::nats::connect(&cfg.nats, format!("outbox-relay:{}", cfg.slot)).await?;
    ready.watch_nats(nats.clone());
    let js = jetstream::ContextBuilder::new()
        .timeout(cfg.publish_timeout)
        // Nothing is published through this context now (the link carries
        // every publish); the bound stays as a guard should that change.
        .max_ack_inflight(cfg.max_inflight * 2 + 16)
        .backpressure_on_inflight(true)
        .build(nats.clone());
    let lag = Arc::new(LagClock::default());
    // Stops the process-wide watchers (lag, dead-letter depth) on return.
    let lag_stop = CancellationToken::new();
    tokio::spawn(lag_gauge(lag.clone(), lag_stop.clone()));
    tokio::spawn(crate::nats::watch_depth(
        js.clone(),
        cfg.stream.clone(),
        crate::wire::relay_dlq_subject(&cfg.context),
        lag_stop.clone(),
    ));
    let _lag_stop = lag_stop.drop_guard();

    let mut backoff = Backoff::jittered(Duration::from_millis(100), cfg.max_backoff);
    // Streamed, or found the slot held by another relay: the settings work,
    // so a transient error from here on is ridden out, never an exit (a
    // standby must survive what the active relay survives).
    let mut proven = false;
    let mut standby_logged = false;
    // The line the relay halted on (said in `/readyz` until it streams
    // again: a later retry's error may only be a consequence), and the
    // latest, each logged once.
    let mut halted: Option<String> = None;
    let mut latest = String::new();
    // The outbox's oid as the first session that streamed found it: a
    // later session of this process refuses another table under the name
    // (one made while it was halted, by a `migrate` say), whose rows would
    // be read instead of the real outbox's.
    let mut outbox_oid: Option<i64> = None;
    // What this process confirmed, over all its sessions: one stopped
    // while opening has confirmed nothing itself. LSNs only grow.
    let mut confirmed = Lsn::ZERO;
    loop {
        let started = Instant::now();
        let env = Env {
            cfg: &cfg,
            dsn: &dsn,
            pool: &pool,
            js: &js,
            nats: &nats,
            ready: &ready,
            lag: &lag,
        };
        let mut session = Session::new(&env).expecting(outbox_oid);
        let result = session.run(&shutdown).await;
        confirmed = confirmed.max(session.confirmed());
        proven |= session.streamed();
        standby_logged &= !session.streamed();
        if session.streamed() {
            outbox_oid = outbox_oid.or(session.outbox_oid());
            halted = None;
        }
        drop(session);
        // Counted whether or not the relay has streamed yet (a first
        // start's backfill meets a full stream too).
        if result.as_ref().is_err_and(Error::is_stream_full) {
            metrics::counter!(m::STREAM_FULL).increment(1);
        }
        if let Err(Error::ReplicationSilent(_)) = &result {
            // The pool's connections went silent with the replication
            // connection, and a query on one waits for ever (sqlx has no
            // socket timeout): the next session gets new ones.
            pool = dsn.lazy_pool(2, POOL_ACQUIRE)?;
        }
        metrics::gauge!(m::STREAMING).set(0.0);
        metrics::gauge!(m::PUBLICATION_KEPT).set(0.0);
        // What the session had in flight is no one's now: the next session
        // publishes it again.
        metrics::gauge!(m::INFLIGHT_EVENTS).set(0.0);
        metrics::gauge!(m::INFLIGHT_BYTES).set(0.0);
        match (&result, &halted) {
            (Ok(_), _) => ready.not_ready("shutting down"),
            // What it halted on stays said until it streams again.
            (Err(e), Some(first)) => ready.not_ready(format!("halted: {first} (now: {e})")),
            (Err(e), None) => ready.not_ready(format!("not streaming: {e}")),
        }
        match result {
            Ok(stopped) => {
                crate::nats::flush_on_exit(&nats).await;
                return Ok(Stopped {
                    confirmed: confirmed.max(stopped.confirmed),
                });
            }
            Err(e) if e.is_slot_busy() => {
                proven = true;
                // Another relay streams: what this one halted on is not
                // this one's to report.
                metrics::gauge!(m::HALTED).set(0.0);
                halted = None;
                metrics::gauge!(m::STANDBY).set(1.0);
                // The relay holding the slot publishes (and reports) them.
                lag.set(None);
                if !standby_logged {
                    tracing::info!(reason = %e, "standby: waiting for the slot");
                    standby_logged = true;
                }
                ready.not_ready(format!("standby: {e}; taking over when it frees"));
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        return Ok(Stopped { confirmed });
                    }
                    _ = tokio::time::sleep(STANDBY_POLL) => {}
                }
            }
            // The relay streamed, then met what it cannot go past by
            // itself (a migration that broke the column map, the outbox
            // out of the publication, a lost slot): it stays up, not
            // ready, saying what to run where operators look (`/readyz`,
            // `outbox_relay_halted`, its log), and tries again now and then
            // in case the fix needs no restart (the table published again).
            Err(e) if e.class() == Class::Permanent && proven => {
                metrics::gauge!(m::HALTED).set(1.0);
                let line = e.to_string();
                match &halted {
                    None => {
                        metrics::counter!(m::HALTS).increment(1);
                        tracing::error!("halted: {line}");
                        ready.not_ready(format!("halted: {line}"));
                        halted = Some(line.clone());
                        latest = line;
                    }
                    Some(_) if latest != line => {
                        tracing::error!("still halted: {line}");
                        latest = line;
                    }
                    Some(_) => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        return Ok(Stopped { confirmed });
                    }
                    _ = tokio::time::sleep(HALTED_RETRY) => {}
                }
            }
            // Planned: no pause, no restart counted.
            Err(e @ Error::StartOver(_)) => {
                tracing::info!("{e}");
            }
            Err(e) if e.class() == Class::Transient && proven => {
                metrics::counter!(m::SESSION_RESTARTS).increment(1);
                if started.elapsed() > HEALTHY_SESSION {
                    backoff.reset();
                }
                let pause = backoff.next_pause();
                tracing::warn!(error = %e, retry_in = ?pause, "relay session ended; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        return Ok(Stopped { confirmed });
                    }
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}
