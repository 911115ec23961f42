//! The relay: replication stream → decode → route → publish → slot ack.
//!
//! ```text
//!  pgwire-replication ──events──▶ session loop ──publish──▶ Publisher (window)
//!        ▲                          │   ▲                          │
//!        └── update_applied_lsn ────┘   └──── acks, in order ──────┘
//!                 (Watermark: commit end LSNs whose events are all acked)
//! ```
//!
//! One `biased` select per session, in priority order: shutdown, then acks
//! (draining acks before reading more keeps memory bounded), then new WAL,
//! read only while the publish window has room. The replication worker keeps
//! answering the server's keepalives while we hold back, so backpressure never
//! trips `wal_sender_timeout`.
//!
//! Recovery is crash-only: any transient error ends the session; the next
//! one starts from the slot's confirmed LSN and skips the events the stream
//! already holds ([`crate::publish::stored_tail`]). A kill -9 takes the same
//! path, so the path is exercised, not hoped for.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgwire_replication::{Lsn, ReplicationClient};
use tokio_util::sync::CancellationToken;

use crate::config::RelayConfig;
use crate::endpoint::Readiness;
use crate::error::{Class, Error, Result};
use crate::events::{Stage, Step};
use crate::metrics as m;
use crate::postgres::{self, Dsn};
use crate::publish::{self, Publisher, StreamSettings};
use crate::route::Router;
use crate::watermark::Watermark;

/// Events buffered between the replication worker and the loop. Small: the
/// publish window is where events wait, and a large XLogData buffer would let
/// big payloads multiply memory.
const REPLICATION_BUFFER: usize = 512;

/// A session that streamed this long resets the reconnect backoff.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// What the process reports when it stops.
#[derive(Debug, Clone, Copy)]
pub struct Stopped {
    pub confirmed: Lsn,
}

/// Run until `shutdown`, reconnecting after transient failures. Errors that
/// retrying cannot fix (configuration, privileges) end the run; so does any
/// error before the first session streamed, so a wrong URL fails at once.
///
/// `ready` is told the phase: ready only while streaming from the slot.
pub async fn run(
    cfg: RelayConfig,
    ready: Readiness,
    shutdown: CancellationToken,
) -> Result<Stopped> {
    m::register_relay();
    let dsn = Dsn::parse(&cfg.database_url)?;
    let pool = dsn.pool(2).await?;
    let nats = crate::nats::connect(&cfg.nats, format!("outbox-relay:{}", cfg.slot)).await?;
    ready.watch_nats(nats.clone());
    let js = jetstream::ContextBuilder::new()
        .timeout(cfg.publish_timeout)
        .max_ack_inflight(cfg.max_inflight + 16)
        .backpressure_on_inflight(true)
        .build(nats.clone());

    let mut backoff = Duration::from_millis(100);
    let mut streamed_once = false;
    loop {
        let started = Instant::now();
        let mut session = Session::new(&cfg, &dsn, &pool, &js, &nats, &ready);
        let result = session.run(&shutdown).await;
        streamed_once |= session.streaming;
        metrics::gauge!(m::STREAMING).set(0.0);
        match &result {
            Ok(_) => ready.not_ready("shutting down"),
            Err(e) => ready.not_ready(format!("not streaming: {e}")),
        }
        match result {
            Ok(stopped) => {
                nats.flush().await.ok();
                return Ok(stopped);
            }
            Err(e) if e.class() == Class::Transient && streamed_once => {
                metrics::counter!(m::SESSION_RESTARTS).increment(1);
                if started.elapsed() > HEALTHY_SESSION {
                    backoff = Duration::from_millis(100);
                }
                tracing::warn!(error = %e, retry_in = ?backoff, "relay session ended; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        return Ok(Stopped { confirmed: session.watermark.confirmed() });
                    }
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(cfg.max_backoff);
            }
            Err(e) => return Err(e),
        }
    }
}

struct Session<'a> {
    cfg: &'a RelayConfig,
    dsn: &'a Dsn,
    pool: &'a sqlx::PgPool,
    js: &'a jetstream::Context,
    nats: &'a async_nats::Client,
    ready: &'a Readiness,
    watermark: Watermark,
    streaming: bool,
}

impl<'a> Session<'a> {
    fn new(
        cfg: &'a RelayConfig,
        dsn: &'a Dsn,
        pool: &'a sqlx::PgPool,
        js: &'a jetstream::Context,
        nats: &'a async_nats::Client,
        ready: &'a Readiness,
    ) -> Self {
        Self {
            cfg,
            dsn,
            pool,
            js,
            nats,
            ready,
            watermark: Watermark::new(Lsn::ZERO),
            streaming: false,
        }
    }

    async fn run(&mut self, shutdown: &CancellationToken) -> Result<Stopped> {
        let cfg = self.cfg;
        self.ready.not_ready(format!(
            "not streaming yet: preparing slot {} and publication {}",
            cfg.slot, cfg.publication
        ));
        let confirmed = postgres::prepare(
            self.pool,
            &cfg.schema,
            &cfg.table,
            &cfg.publication,
            &cfg.slot,
        )
        .await?;
        self.watermark = Watermark::new(confirmed);
        publish::ensure_stream(
            self.js,
            &StreamSettings {
                name: &cfg.stream,
                subjects: format!("{}.>", cfg.context),
                replicas: cfg.stream_replicas,
                max_age: cfg.stream_max_age,
                max_bytes: cfg.stream_max_bytes,
                duplicate_window: cfg.duplicate_window,
            },
        )
        .await?;

        // Feedback well inside the server's timeout (Materialize's rule:
        // min(1 s, timeout / 2); we take a quarter for slack under load).
        let sender_timeout: String = sqlx::query_scalar("SHOW wal_sender_timeout")
            .fetch_one(self.pool)
            .await
            .map_err(Error::pg("SHOW wal_sender_timeout"))?;
        let status_interval = postgres::parse_pg_duration(&sender_timeout)
            .map_or(Duration::from_secs(1), |t| {
                (t / 4).min(Duration::from_secs(1))
            });

        self.ready.not_ready(format!(
            "not streaming yet: starting replication from slot {}",
            cfg.slot
        ));
        let repl = self
            .dsn
            .replication_config(&cfg.slot, &cfg.publication)
            .with_start_lsn(confirmed)
            .with_ack_lsn(confirmed)
            .with_binary(cfg.binary)
            .with_buffer_size(REPLICATION_BUFFER)
            .with_status_interval(status_interval)
            .with_wakeup_interval(status_interval);
        let mut client = ReplicationClient::connect_gated(repl).await?;
        let system = client.identify_system().await?;
        let source = crate::route::source_id(
            &system.system_id,
            system.timeline,
            &self.dsn.database,
            &cfg.slot,
        );
        let resume = publish::stored_tail(self.js, &cfg.stream, &source).await?;
        client.start().await?;
        client.wait_started().await?;
        self.streaming = true;
        self.ready.ready();
        metrics::gauge!(m::STREAMING).set(1.0);
        tracing::info!(
            slot = %cfg.slot, from = %confirmed, stream = %cfg.stream,
            resume_after = ?resume.map(|p| format!("{}#{}", p.commit_lsn, p.index)),
            "streaming"
        );
        metrics::gauge!(m::CONFIRMED_LSN).set(confirmed.as_u64() as f64);

        let router = Router::new(
            &cfg.context,
            cfg.template.clone(),
            cfg.partitions,
            cfg.envelope,
            source,
        );
        let mut publisher = Publisher::new(self.js.clone(), cfg.max_inflight);
        // Read once per session: server_info() clones the whole INFO block.
        let max_payload = self.nats.server_info().max_payload;
        // Handles resolved once: the per-event path does no registry lookups.
        let published = metrics::counter!(m::EVENTS_PUBLISHED);
        let inflight = metrics::gauge!(m::INFLIGHT_EVENTS);
        let commit_to_ack = metrics::histogram!(m::COMMIT_TO_ACK_SECONDS);
        let mut stage = Stage::new(&cfg.schema, &cfg.table, router, max_payload, resume);

        let outcome: Result<()> = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some((ticket, commit_micros, result)) = publisher.next_ack(), if publisher.in_flight() > 0 => {
                    if let Err(e) = result {
                        break Err(e);
                    }
                    published.increment(1);
                    inflight.set(publisher.in_flight() as f64);
                    let age = unix_micros_now() - pg_to_unix_micros(commit_micros);
                    commit_to_ack.record(age.max(0) as f64 / 1e6);
                    if let Some(lsn) = self.watermark.ack(ticket) {
                        confirm(&client, lsn);
                    }
                }
                event = client.recv(), if publisher.has_room() => {
                    let step = match event {
                        Ok(Some(ev)) => stage.on_event(ev, &mut self.watermark),
                        Ok(None) => Err(Error::StreamEnded),
                        Err(e) => Err(e.into()),
                    };
                    match step {
                        Ok(Step::Nothing) => {}
                        Ok(Step::Confirm(lsn)) => confirm(&client, lsn),
                        Ok(Step::Publish { ticket, commit_micros, msg }) => {
                            if let Err(e) = publisher.publish(ticket, commit_micros, msg).await {
                                break Err(e);
                            }
                            inflight.set(publisher.in_flight() as f64);
                        }
                        Err(e) => break Err(e),
                    }
                }
            }
        };

        if let Err(e) = outcome {
            client.abort();
            return Err(e);
        }

        self.ready
            .not_ready("shutting down: waiting for in-flight acks");
        // Graceful stop: read nothing more, wait (bounded) for the acks of
        // what is in flight, confirm, and let the worker send that position.
        tracing::info!(
            in_flight = publisher.in_flight(),
            "stopping: waiting for in-flight acks"
        );
        let drain = async {
            while let Some((ticket, _, result)) = publisher.next_ack().await {
                match result {
                    Ok(_) => {
                        published.increment(1);
                        if let Some(lsn) = self.watermark.ack(ticket) {
                            confirm(&client, lsn);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "publish failed during shutdown; it will be replayed");
                        break;
                    }
                }
            }
        };
        if tokio::time::timeout(cfg.shutdown_timeout, drain)
            .await
            .is_err()
        {
            tracing::warn!("shutdown timeout: unacked events will be replayed on the next start");
        }
        // The worker sends a raised position within one status interval.
        tokio::time::sleep(status_interval + Duration::from_millis(200)).await;
        let _ = client.shutdown().await;
        Ok(Stopped {
            confirmed: self.watermark.confirmed(),
        })
    }
}

fn confirm(client: &ReplicationClient, lsn: Lsn) {
    client.update_applied_lsn(lsn);
    metrics::gauge!(m::CONFIRMED_LSN).set(lsn.as_u64() as f64);
}

fn pg_to_unix_micros(pg: i64) -> i64 {
    pg.saturating_add(crate::outbox::PG_EPOCH_UNIX_MICROS)
}

fn unix_micros_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
