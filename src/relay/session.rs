//! One replication session: open (slot, publication, stream, resume point),
//! pump (WAL in, publishes out, acks back to the slot), drain (on shutdown,
//! wait for what is in flight).
//!
//! The pump is one `biased` select, in priority order: shutdown, then acks
//! (draining acks before reading more keeps memory bounded), then new WAL,
//! read only while the publish window has room. A turn takes every ack, or
//! every event, already waiting (up to `TURN`): the select's branches are
//! set up once per wait, not once per message. The replication worker keeps
//! answering the server's keepalives while we hold back, so backpressure
//! never trips `wal_sender_timeout`.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, ReplicationClient};
use tokio_util::sync::CancellationToken;

use super::backfill;
use super::batch::Batcher;
use super::decode::{Stage, Step};
use super::env::{Env, Stopped};
use super::fence::{self, Fence};
use super::guard;
use super::heard;
use super::link::Dialer;
use super::publish::{self, Ack, Publisher, Refusals, StreamSettings};
use super::readback::ReadBack;
use super::route::Router;
use super::watermark::Watermark;
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::postgres;
use crate::postgres::kept::Kept;
use crate::postgres::provision::{self, SlotState, Unreplicated};
use crate::wire;

/// Events buffered between the replication worker and the loop.
/// pgwire-replication bounds this buffer by count only, so the count comes
/// from bytes: `--max-inflight-bytes` over the largest message the stream
/// takes (a bigger row is dead-lettered, never published), so the rows
/// buffered to be published fit in that many bytes; at least 4 (a
/// deployment whose largest message is over a quarter of the bound buffers
/// four), at most 512.
fn replication_buffer(max_inflight_bytes: usize, max_message: usize) -> usize {
    (max_inflight_bytes / max_message.max(1)).clamp(4, 512)
}

pub(super) struct Session<'a> {
    env: &'a Env<'a>,
    watermark: Watermark,
    /// The session's publications, and the table and its membership of
    /// each the session began with ([`guard`]).
    pin: Option<(guard::Names, guard::Pin)>,
    /// The outbox's oid an earlier session of this process streamed from.
    expected_oid: Option<i64>,
    /// The session ended on a publish or an ack that failed: what follows
    /// it is not sent.
    publish_failed: bool,
    streamed: bool,
    metrics: Handles,
}

/// A streaming session's moving parts.
struct Open {
    client: ReplicationClient,
    stage: Stage,
    publisher: Batcher,
    status_interval: Duration,
    /// Samples for [`wire::XID_HORIZON`]; the sampler stops with the session.
    horizons: tokio::sync::mpsc::Receiver<(Lsn, u64)>,
    _sampler: tokio_util::sync::DropGuard,
    /// Breaks when the process was paused long enough to lose the slot.
    fence: Fence,
    /// The line to stop with, once a check finds the outbox out of the
    /// slot ([`guard`]); the checks stop with the session.
    notices: tokio::sync::mpsc::Receiver<guard::Notice>,
    _guard: tokio_util::sync::DropGuard,
    /// A stream `--streams` names that was missing and exists now.
    found: tokio::sync::mpsc::Receiver<String>,
    _finder: tokio_util::sync::DropGuard,
    /// And once Postgres no longer hears the replication connection
    /// ([`heard`]); while no check answers, the line `/readyz` says.
    _heard: tokio_util::sync::DropGuard,
    /// What the replay compares against, read as it goes.
    readback: ReadBack,
}

/// How often the transaction horizon is sampled: what a resync after a lost
/// slot republishes beyond `occurred_at` is what ran within this of the
/// last stored event.
const HORIZON_EVERY: Duration = Duration::from_secs(1);

/// Events, or acks, the pump takes in one turn of its select when they are
/// already waiting. Bounded so shutdown, a pause and the guard's notices
/// are seen between turns.
const TURN: usize = 64;

/// Sample, every [`HORIZON_EVERY`], the oldest transaction still running
/// (the statement's snapshot, taken first) and the WAL insert position read
/// after it: every transaction below the sample had written its commit
/// record before that position.
fn sample_horizons(
    pool: sqlx::PgPool,
) -> (tokio::sync::mpsc::Receiver<(Lsn, u64)>, CancellationToken) {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(HORIZON_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            let sample = sqlx::query_as::<_, (String, String)>(
                // On a standby, the snapshot is of what it replayed.
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, \
                        (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                         ELSE pg_current_wal_insert_lsn() END)::text",
            )
            .fetch_one(&pool);
            // A sample on a path gone silent would wait for ever, and
            // outlive its session.
            let sample = tokio::select! {
                _ = stopped.cancelled() => return,
                s = tokio::time::timeout(HORIZON_EVERY * 5, sample) => s,
            };
            match sample {
                Err(_) => tracing::debug!("transaction horizon not sampled: no answer in time"),
                Ok(Ok((xid, lsn))) => {
                    if let (Ok(xid), Ok(lsn)) = (xid.parse::<u64>(), Lsn::parse(&lsn)) {
                        // A busy loop skips a sample; the next one serves.
                        let _ = tx.try_send((lsn, xid));
                    }
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "transaction horizon not sampled"),
            }
        }
    });
    (rx, stop)
}

/// Metric handles resolved once: the per-event path does no registry lookups.
struct Handles {
    published: metrics::Counter,
    /// Acked as duplicates: stored before (a replay the read-back missed).
    skipped: metrics::Counter,
    inflight: metrics::Gauge,
    inflight_bytes: metrics::Gauge,
    commit_to_ack: metrics::Histogram,
    confirmed: metrics::Gauge,
    /// Publishes and acks since the in-flight gauges were last set.
    unreported: u32,
}

/// The in-flight gauges are set at every commit, confirm and empty window,
/// and at least every this many publishes and acks in between (a large
/// transaction): setting them per event cost 2 % of the relay's CPU for
/// values a scrape reads every few seconds.
const GAUGES_EVERY: u32 = 64;

impl Handles {
    fn in_flight(&mut self, publisher: &Batcher, settled: bool) {
        self.unreported += 1;
        let in_flight = publisher.in_flight();
        if settled || in_flight == 0 || self.unreported >= GAUGES_EVERY {
            self.unreported = 0;
            self.inflight.set(in_flight as f64);
            self.inflight_bytes.set(publisher.in_flight_bytes() as f64);
        }
    }
}

impl<'a> Session<'a> {
    pub fn new(env: &'a Env<'a>) -> Self {
        Self {
            env,
            watermark: Watermark::new(Lsn::ZERO),
            pin: None,
            expected_oid: None,
            publish_failed: false,
            streamed: false,
            metrics: Handles {
                published: metrics::counter!(m::EVENTS_PUBLISHED),
                skipped: metrics::counter!(m::EVENTS_SKIPPED),
                inflight: metrics::gauge!(m::INFLIGHT_EVENTS),
                inflight_bytes: metrics::gauge!(m::INFLIGHT_BYTES),
                commit_to_ack: metrics::histogram!(m::COMMIT_TO_ACK_SECONDS),
                confirmed: metrics::gauge!(m::CONFIRMED_LSN),
                unreported: 0,
            },
        }
    }

    /// Refuse to stream from a table other than `oid` under the outbox's
    /// name (see `relay/mod.rs`).
    pub fn expecting(mut self, oid: Option<i64>) -> Self {
        self.expected_oid = oid;
        self
    }

    /// The outbox's oid, as this session found it.
    pub fn outbox_oid(&self) -> Option<i64> {
        self.pin.as_ref().and_then(|(_, p)| p.oid())
    }

    /// Whether this session reached the streaming state.
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// The last LSN this session confirmed to the slot.
    pub fn confirmed(&self) -> Lsn {
        self.watermark.confirmed()
    }

    pub async fn run(&mut self, shutdown: &CancellationToken) -> Result<Stopped> {
        // Opening can wait without end: a backfill of millions of rows, or
        // a stream lookup while NATS is gone and the client's command queue
        // is full (async-nats bounds a request's answer, not its sending).
        // A stop ends it where it is, as a crash would, which every step of
        // opening survives (see `backfill`).
        let mut open = tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                return Ok(Stopped { confirmed: self.watermark.confirmed() });
            }
            open = self.open() => open?,
        };
        if let Err(e) = self.pump(&mut open, shutdown).await {
            // A halt on what was read (a change the relay cannot go past by
            // itself) first settles what it sent before the change: acked
            // and confirmed, a restart with the fixed flags begins after
            // it, instead of reading it again under the new map. So does a
            // planned start over. Not a publish that failed: what follows
            // it must not be sent. A stop, or a pause long enough to lose
            // the slot, ends the settling.
            if !self.publish_failed && matches!(e, Error::Setup { .. } | Error::StartOver(_)) {
                self.env
                    .ready
                    .not_ready(format!("stopping: {e}; settling what was sent first"));
                let fence = open.fence.clone();
                let status = open.status_interval;
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => {}
                    _ = fence.broken() => {}
                    _ = async {
                        self.settle(&mut open).await;
                        tokio::time::sleep(status + Duration::from_millis(200)).await;
                    } => {}
                }
            }
            open.client.abort();
            return Err(e);
        }
        Ok(self.drain(open).await)
    }

    async fn open(&mut self) -> Result<Open> {
        let Env {
            cfg,
            dsn,
            pool,
            js,
            nats,
            ready,
            ..
        } = *self.env;
        ready.not_ready(format!(
            "not streaming yet: preparing slot {} and publication {}",
            cfg.slot, cfg.publication
        ));
        let prepared = postgres::provision::prepare(
            pool,
            &cfg.schema,
            &cfg.table,
            &cfg.publication,
            &cfg.slot,
        )
        .await?;
        if let Some(SlotState {
            active_pid: Some(pid),
            ..
        }) = prepared.slot
        {
            // Before any NATS work: a standby asks again every second.
            return Err(Error::SlotBusy {
                slot: cfg.slot.clone(),
                pid: Some(pid),
            });
        }
        // What the table and its membership of the publications are now: a
        // gap in the one streamed through stops the relay (`guard`).
        let names = guard::Names {
            named: cfg.publication.clone(),
            kept: prepared.kept.streamed().map(str::to_owned),
            later: match &prepared.kept {
                Kept::Later { name, ready } => Some((name.clone(), *ready)),
                _ => None,
            },
            slot: cfg.slot.clone(),
        };
        let pin = guard::check(pool, &names, &cfg.schema, &cfg.table).await?;
        let outbox = match (&pin.named, &pin.kept) {
            // Edited since `prepare` looked: the next session looks again.
            (_, Some(Err(why))) => {
                return Err(Error::StartOver(format!(
                    "the kept publication changed as the session began ({why}); starting over"
                )))
            }
            (Ok(p), _) | (Err(_), Some(Ok(p))) => p.clone(),
            (Err(why), None) => return Err(Error::setup(guard::stop_line(why, None))),
        };
        if let Some(oid) = self.expected_oid.filter(|oid| *oid != outbox.oid) {
            return Err(Error::setup(format!(
                "table {}.{} is another table now (oid {oid} when this relay streamed, {} now): a table made under its name while the relay was stopped, or a swap. Rows written to the old one since are not read from here: restart the relay once the outbox is the right table, then run `outbox-relay audit --repair` with its flags over the window of the change",
                cfg.schema, cfg.table, outbox.oid
            )));
        }
        // What the flags ask of the table (SPEC §13), before anything is
        // published: one line naming what does not fit.
        let table = format!("{}.{}", cfg.schema, cfg.table);
        let columns = postgres::provision::table_columns(pool, &cfg.schema, &cfg.table).await?;
        let extra = cfg
            .columns
            .check(
                &table,
                &columns,
                &cfg.template.roles(),
                &cfg.template.columns(),
                &cfg.header_columns,
                &cfg.streams,
            )
            .map_err(Error::setup)?;
        let resolved = cfg
            .columns
            .resolve(&table, &columns)
            .map_err(Error::setup)?;
        // A generated column (before PostgreSQL 18, or unless the
        // publication publishes them), or one outside the publication's
        // column list, is not in the rows logical replication sends:
        // mapped, every streamed row would lack it.
        let streamed = names.kept.as_deref().unwrap_or(&cfg.publication);
        let unreplicated =
            postgres::provision::unreplicated_columns(pool, &cfg.schema, &cfg.table, streamed)
                .await?;
        let mapped = crate::relay::columns::Role::ALL
            .iter()
            .filter_map(|r| {
                resolved
                    .source(*r)
                    .map(|s| (s.column().to_owned(), format!("role {}", r.name())))
            })
            .chain(
                extra
                    .iter()
                    .map(|c| (c.clone(), "a subject or header column".to_owned())),
            );
        for (column, plays) in mapped {
            let Some((_, why)) = unreplicated.iter().find(|(c, _)| *c == column) else {
                continue;
            };
            return Err(Error::setup(match why {
                Unreplicated::Generated => format!(
                    "column {column} of table {table} ({plays}) is generated, and logical replication leaves it out of the rows it sends (before PostgreSQL 18, or unless the publication publishes generated columns: ALTER PUBLICATION {} SET (publish_generated_columns = stored) on 18, which the relay then streams through): map a column that is written, or compute it in the subject template",
                    cfg.publication
                ),
                Unreplicated::NotListed => format!(
                    "column {column} of table {table} ({plays}) is not in publication {streamed}'s column list, and logical replication leaves it out of the rows it sends: add it to the list (ALTER PUBLICATION {streamed} SET TABLE {table} (…, {column})), or map a column the list has"
                ),
            }));
        }
        // A template or header column of a type binary tuples carry in a
        // form of its own (an enum, numeric, date, a domain...) is read as
        // Postgres's text for it, the backfill's: the session asks for text
        // tuples then.
        let textual: Vec<&str> = extra
            .iter()
            .filter(|name| {
                columns
                    .iter()
                    .any(|(n, ty)| n == *name && !crate::relay::outbox_row::binary_text(*ty))
            })
            .map(String::as_str)
            .collect();
        let binary = cfg.binary && textual.is_empty();
        // Roles the subject template needs keep their columns while the
        // relay runs (see `ColumnMap::pinned`).
        let needed: Vec<crate::relay::columns::Role> = cfg
            .template
            .roles()
            .iter()
            .filter_map(|r| crate::relay::columns::Role::parse(r))
            .collect();
        if cfg.binary && !binary {
            tracing::info!(
                columns = ?textual,
                "streaming text tuples: these subject or header columns are read as Postgres's text for their types"
            );
        }
        if cfg.envelope {
            // The envelope embeds the payload as JSON, byte for byte.
            let payload = resolved.source(crate::relay::columns::Role::Payload);
            let ty = payload.and_then(|p| columns.iter().find(|(n, _)| n == p.column()));
            if let Some((name, ty)) = ty.filter(|(_, ty)| {
                ![
                    crate::relay::pgoutput::oid::JSON,
                    crate::relay::pgoutput::oid::JSONB,
                ]
                .contains(ty)
            }) {
                return Err(Error::setup(format!(
                    "--envelope embeds the payload as JSON, and column {name} of table {table} (role payload) is not json or jsonb (type oid {ty}): drop --envelope, or map a json column"
                )));
            }
        }
        let keys: Vec<(String, String, String)> = resolved
            .keys()
            .map(|(role, column, key)| (role.to_string(), column.to_owned(), key.to_owned()))
            .collect();
        postgres::provision::check_keys(pool, &cfg.schema, &cfg.table, &keys).await?;
        if let Some(predicate) = &cfg.unpublished {
            postgres::provision::check_predicate(pool, &cfg.schema, &cfg.table, predicate).await?;
        }
        // Read once per session: server_info() clones the whole INFO block.
        let info = nats.server_info();
        if let Some(warning) = crate::nats::check_version(&info.version)? {
            tracing::warn!("{warning}");
        }
        let dlq_subject = wire::relay_dlq_subject(&cfg.context);
        let shape = publish::ensure_stream(
            js,
            &StreamSettings {
                name: &cfg.stream,
                default_name: &wire::stream_name(&cfg.context),
                dlq_subject: &dlq_subject,
                subjects: wire::stream_subjects(&cfg.context),
                replicas: cfg.stream_replicas,
                max_age: cfg.stream_max_age,
                max_bytes: cfg.stream_max_bytes,
                duplicate_window: cfg.duplicate_window,
                mode: cfg.publish_mode,
                server_batches: publish::server_batches(&info.version),
            },
        )
        .await?;

        // Multi-stream routing (SPEC §13): the streams rows may name. Each
        // keeps its own order chain; an atomic batch lands in one stream,
        // so these rows go event by event.
        let routed = if cfg.streams.is_empty() {
            None
        } else {
            Some(publish::routed_streams(js, &cfg.streams, &cfg.stream).await?)
        };
        // Is an acked event durable? (SPEC §14.) Said once per session, for
        // every stream an event may be acked by (review U1), each judged by
        // the server holding it (review U2).
        let servers = crate::durability::read_servers(&cfg.nats_monitor_url).await;
        for failed in &servers.failed {
            tracing::warn!(error = %failed, "cannot read a server's sync_interval");
        }
        let routed_placements = routed
            .iter()
            .flat_map(|(_, _, shapes)| shapes.iter())
            .filter(|p| p.stream != cfg.stream);
        let durability =
            crate::durability::judge_all(&shape.placement, routed_placements, &servers);
        if !durability.durable && cfg.require_durable && !servers.failed.is_empty() {
            metrics::gauge!(m::STREAM_DURABLE).set(0.0);
            // Unknown is not "not durable": a monitoring port down for a
            // moment must not stop a relay for good.
            return Err(Error::Nats {
                context: "--require-durable needs the server's sync_interval".into(),
                source: Box::new(Error::setup(durability.why)),
            });
        }
        metrics::gauge!(m::STREAM_DURABLE).set(if durability.durable { 1.0 } else { 0.0 });
        if !durability.durable {
            if cfg.require_durable {
                return Err(Error::Config(format!(
                    "--require-durable: {}",
                    durability.why
                )));
            }
            tracing::warn!("acked events are not durable: {}", durability.why);
        }
        // Judged again each session: a stream fixed since is said no more.
        ready.caution(
            (!durability.durable)
                .then(|| format!("acked events are not durable: {}", durability.why)),
        );

        let batches = shape.batches && routed.is_none();

        // Feedback well inside the server's timeout (Materialize's rule:
        // min(1 s, timeout / 2); we take a quarter for slack under load).
        let sender_timeout = postgres::wal_sender_timeout(pool).await?;
        let status_interval = sender_timeout.map_or(Duration::from_secs(1), |t| {
            (t / 4).min(Duration::from_secs(1))
        });

        // A message must fit the server and the stream.
        let max_payload = info
            .max_payload
            .min(shape.max_msg_size.unwrap_or(usize::MAX))
            .min(routed.as_ref().and_then(|r| r.1).unwrap_or(usize::MAX))
            // What the publisher adds (the order chain, the batch headers)
            // must fit too: a row that only fits without them is too large.
            .saturating_sub(publish::HEADER_RESERVE);
        let dialer = Dialer::new(&cfg.nats, format!("outbox-relay:{}:publish", cfg.slot))
            .map_err(|e| Error::Config(e.to_string()))?;
        let mut publisher = Batcher::new(
            Publisher::new(
                js.clone(),
                dialer,
                cfg.max_inflight,
                cfg.max_inflight_bytes,
                cfg.publish_timeout,
                Refusals {
                    dlq_subject,
                    max_message: max_payload,
                },
            ),
            batches,
            cfg.stream.clone(),
        );
        publisher.per_event().connect().await?;
        let fence = Fence::start(fence::limit(sender_timeout));
        publisher.per_event().set_fence(fence.clone());
        // The link knows the account's or user's max_payload (the INFO after
        // CONNECT), which may be below the server's.
        let max_payload = publisher.per_event().max_message();
        let streams = routed.as_ref().map(|(s, _, _)| Arc::new(s.clone()));
        let router = |source: &str| {
            let router = Router::new(
                &cfg.context,
                cfg.template.clone(),
                cfg.partitions,
                cfg.envelope,
                source.to_owned(),
                shape.subjects.clone(),
            )
            .with_schemas(cfg.schemas.clone())
            .with_columns(extra.clone(), &cfg.header_columns);
            match &streams {
                Some(streams) => router.with_streams(streams.clone()),
                None => router,
            }
        };
        let confirmed = match prepared.slot {
            Some(slot) => slot.confirmed,
            None => {
                backfill::first_start(self.env, publisher.per_event(), router, max_payload).await?
            }
        };
        self.watermark = Watermark::new(confirmed);

        ready.not_ready(format!(
            "not streaming yet: starting replication from slot {}",
            cfg.slot
        ));
        // The kept publication alone where there is one: the operator's,
        // named too, would fail the session once dropped (pgoutput cannot
        // read WAL for a publication that did not exist when it was
        // written), and the kept one carries every row anyway.
        let publication = names
            .kept
            .clone()
            .unwrap_or_else(|| cfg.publication.clone());
        let repl = dsn
            .replication_config(&cfg.slot, publication.as_str())
            .with_start_lsn(confirmed)
            .with_ack_lsn(confirmed)
            .with_binary(binary)
            .with_buffer_size(replication_buffer(cfg.max_inflight_bytes, max_payload))
            .with_status_interval(status_interval)
            .with_wakeup_interval(status_interval);
        let mut client = ReplicationClient::connect_gated(repl).await?;
        let system = client.identify_system().await?;
        // On a promoted server, the old timeline's messages up to the switch
        // point are this WAL's too: resume after them, not by replaying.
        let history = match system.timeline {
            0 | 1 => String::new(),
            tli => {
                String::from_utf8_lossy(&client.timeline_history(tli).await?.content).into_owned()
            }
        };
        let lineage = wire::Lineage::new(
            &system.system_id,
            system.timeline,
            &dsn.database,
            &cfg.slot,
            &history,
        );
        let source = lineage.source.clone();
        // With multi-stream routing, every stream rows may name holds part
        // of what was stored: the resume reads them all, up to the newest.
        let mut tail = None;
        let mut tails = Vec::new();
        // Owned names: a borrowing iterator held across the awaits below
        // keeps the relay's future from being spawned (rustc's
        // higher-ranked `Send` check).
        let stream_names: Vec<String> = std::iter::once(cfg.stream.clone())
            .chain(
                streams
                    .iter()
                    .flat_map(|s| s.found.iter().map(|(n, _)| n.to_string())),
            )
            .collect();
        for name in stream_names.iter().map(String::as_str) {
            if tails.iter().any(|(n, _): &(String, _)| n == name) {
                continue;
            }
            let Some(t) = publish::stored_tail(js, name, &lineage).await? else {
                continue;
            };
            // The batch path settles in the relay's own stream only (rows
            // routed to several go event by event).
            if name == cfg.stream {
                tail = Some(t.clone());
            }
            tails.push((name.to_owned(), t));
        }
        let (resume, readback) = ReadBack::open(js, &tails, &lineage, confirmed).await?;
        let resume_after = resume
            .as_ref()
            .map(|r| format!("{}#{}", r.tail.commit_lsn, r.tail.index));
        publisher.streaming(lineage, tail);
        self.set_failover(&mut client).await?;
        // The walsender this connection becomes: what `heard` asks
        // Postgres about.
        let walsender = backend_pid(&mut client).await?;
        client.start().await?;
        client.wait_started().await?;
        self.streamed = true;
        ready.ready();
        metrics::gauge!(m::STANDBY).set(0.0);
        metrics::gauge!(m::HALTED).set(0.0);
        metrics::gauge!(m::STREAMING).set(1.0);
        tracing::info!(
            slot = %cfg.slot, publication = %publication, from = %confirmed, stream = %cfg.stream,
            batches = publisher.batches(),
            resume_after = ?resume_after,
            "streaming"
        );
        self.metrics.confirmed.set(confirmed.as_u64() as f64);

        let mut stage = Stage::new(
            &cfg.schema,
            &cfg.table,
            prepared.partitions,
            router(&source),
            max_payload,
            resume,
        )
        .with_emitted(cfg.emitted_events)
        .with_columns(cfg.columns.pinned(&resolved, &needed))
        .with_binary(binary);
        if let Ok(oid) = u32::try_from(outbox.oid) {
            stage = stage.with_outbox_oid(oid);
        }
        // What was written while no relay read is published before the
        // first sample: it carries the slot's own horizon.
        if let Some(xid) = provision::slot_horizon(pool, &cfg.slot).await? {
            stage.add_horizon(Lsn(0), xid);
        }
        let (horizons, sampler) = sample_horizons(pool.clone());
        let missing = routed.map(|(s, _, _)| s.missing).unwrap_or_default();
        let (found, finder) = publish::watch_missing(js.clone(), missing);
        let (notify, notices) = tokio::sync::mpsc::channel(4);
        let guarding = guard::watch(
            pool.clone(),
            names.clone(),
            cfg.schema.clone(),
            cfg.table.clone(),
            pin.clone(),
            notify.clone(),
        );
        let hearing = heard::watch(dsn.connect_options(), walsender, cfg.slot.clone(), notify);
        self.pin = Some((names, pin));
        Ok(Open {
            horizons,
            _sampler: sampler.drop_guard(),
            notices,
            _guard: guarding.drop_guard(),
            found,
            _finder: finder.drop_guard(),
            _heard: hearing.drop_guard(),
            client,
            stage,
            publisher,
            status_interval,
            fence,
            readback,
        })
    }

    /// Make the slot a failover slot (or not) as `--failover-slot` says,
    /// on a server that has them; it must happen while no one streams from
    /// it, so here, before `START_REPLICATION`.
    async fn set_failover(&mut self, client: &mut ReplicationClient) -> Result<()> {
        let cfg = self.env.cfg;
        let facts = provision::failover_facts(self.env.pool, &cfg.slot).await?;
        let plan = provision::failover_plan(cfg.failover_slot, &cfg.slot, &facts);
        if let Some(on) = plan.alter {
            // Slot names are validated at config load.
            client
                .simple_query(&format!(
                    "ALTER_REPLICATION_SLOT {} (FAILOVER {on})",
                    cfg.slot
                ))
                .await?;
            tracing::info!(slot = %cfg.slot, failover = on, "set the slot's failover flag");
        }
        if let Some(warning) = plan.warning {
            tracing::warn!("{warning}");
        }
        // Once a process, not once a session.
        static NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if let Some(note) = plan.note {
            if !NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::info!("{note}");
            }
        }
        Ok(())
    }

    /// Until shutdown (`Ok`) or the first error.
    async fn pump(&mut self, open: &mut Open, shutdown: &CancellationToken) -> Result<()> {
        let Open {
            client,
            stage,
            publisher,
            horizons,
            fence,
            notices,
            found,
            readback,
            ..
        } = open;
        let one_thread = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::CurrentThread;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                paused = fence.broken() => return Err(Error::Paused { paused }),
                Some((at, xid)) = horizons.recv() => stage.add_horizon(at, xid),
                Some(notice) = notices.recv() => match notice {
                    guard::Notice::Unpublished(line) => return Err(Error::setup(line)),
                    guard::Notice::Silent(line) => return Err(Error::ReplicationSilent(line)),
                    guard::Notice::Unproven(Some(line)) => self.env.ready.not_ready(line),
                    guard::Notice::Unproven(None) => self.env.ready.ready(),
                    guard::Notice::KeptReady(kept) => return Err(Error::StartOver(format!(
                        "the slot has passed the making of publication {kept}: starting the session over to stream through it (an edit of --publication then loses nothing)"
                    ))),
                },
                Some(stream) = found.recv() => return Err(Error::StreamFound { stream }),
                Some(ack) = publisher.next_ack(), if publisher.in_flight() > 0 => {
                    // The acks already read are taken in this turn: a turn
                    // of the select sets up (and drops) every branch's
                    // waker and the stall timer, once per wait, not per ack.
                    let mut next = Some(ack);
                    let mut taken = 0;
                    while let Some(ack) = next.take() {
                        if let Err(e) = self.on_ack(client, publisher, ack) {
                            self.publish_failed = true;
                            return Err(e);
                        }
                        taken += 1;
                        if taken < TURN && publisher.in_flight() > 0 {
                            // Cancel-safe (see `Publisher::next_ack`).
                            next = ready_now(publisher.next_ack()).flatten();
                        }
                    }
                }
                event = client.recv(), if publisher.has_room() => {
                    // Likewise the events the replication worker has queued
                    // (a transaction arrives in one read), while the window
                    // has room. A closed channel met here means the
                    // worker's task has ended and, on a current-thread
                    // runtime (the relay's own, `src/cli.rs`), stored its
                    // result; on another runtime its end may still be on
                    // the way, and only the select waits for it.
                    let mut next = Some(event);
                    let mut taken = 0;
                    while let Some(event) = next.take() {
                        let event = match event {
                            Ok(Some(ev)) => ev,
                            Ok(None) => return Err(Error::StreamEnded),
                            Err(e) => return Err(e.into()),
                        };
                        if self.on_event(stage, publisher, client, readback, shutdown, event).await? {
                            return Ok(());
                        }
                        taken += 1;
                        if one_thread && taken < TURN && publisher.has_room() {
                            next = ready_now(client.recv());
                        }
                    }
                }
            }
        }
    }

    /// One replication event through decode, the watermark and the
    /// publisher. `Ok(true)`: shutdown came while it waited.
    async fn on_event(
        &mut self,
        stage: &mut Stage,
        publisher: &mut Batcher,
        client: &ReplicationClient,
        readback: &mut ReadBack,
        shutdown: &CancellationToken,
        event: pgwire_replication::ReplicationEvent,
    ) -> Result<bool> {
        if let Some(want) = stage.resume_wants() {
            if let Some(resume) = stage.resume_mut() {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(true),
                    () = readback.advance(resume, want) => {}
                }
            }
        }
        let step = stage.on_event(event, &mut self.watermark)?;
        self.env.lag.set(self.watermark.oldest_unacked());
        match step {
            Step::Nothing => {}
            Step::Confirm(lsn) => self.confirm(client, lsn),
            Step::Commit(lsn) => {
                publisher.end_transaction();
                if let Some(lsn) = lsn {
                    self.confirm(client, lsn);
                }
                self.metrics.in_flight(publisher, true);
            }
            Step::Publish {
                ticket,
                commit_micros,
                pos,
                msg,
            } => {
                if let Err(e) = publisher.publish(ticket, commit_micros, pos, msg).await {
                    self.publish_failed = true;
                    return Err(e);
                }
                self.metrics.in_flight(publisher, false);
            }
        }
        Ok(false)
    }

    /// Graceful stop: read nothing more, wait (bounded) for the acks of what
    /// is in flight, confirm, and let the worker send that position.
    async fn drain(&mut self, mut open: Open) -> Stopped {
        let cfg = self.env.cfg;
        self.env
            .ready
            .not_ready("shutting down: waiting for in-flight acks");
        tracing::info!(
            in_flight = open.publisher.in_flight(),
            "stopping: waiting for in-flight acks"
        );
        self.settle(&mut open).await;
        // A change a last check finds is said now: the next start may
        // not see it (a table added back), and its rows need the audit.
        if let Some((names, pin)) = &self.pin {
            let check = guard::check(self.env.pool, names, &cfg.schema, &cfg.table);
            if let Ok(Ok(found)) = tokio::time::timeout(guard::EVERY, check).await {
                match guard::judge(names, pin, &found) {
                    guard::Verdict::Stop(line) => tracing::error!("{line}"),
                    guard::Verdict::Carried(lines) => {
                        for line in lines {
                            tracing::warn!("{line}");
                        }
                    }
                }
            }
        }
        // The worker sends a raised position within one status interval.
        tokio::time::sleep(open.status_interval + Duration::from_millis(200)).await;
        let _ = open.client.shutdown().await;
        Stopped {
            confirmed: self.watermark.confirmed(),
        }
    }

    /// Read nothing more, and wait (up to the shutdown timeout) for the
    /// acks of what is in flight, confirming as they come.
    async fn settle(&mut self, open: &mut Open) {
        // An open transaction will not complete now: it is read again.
        open.publisher.close();
        let timeout = self.env.cfg.shutdown_timeout;
        let drain = async {
            while open.publisher.in_flight() > 0 {
                let Some(ack) = open.publisher.next_ack().await else {
                    break;
                };
                if let Err(e) = self.on_ack(&open.client, &open.publisher, ack) {
                    tracing::warn!(error = %e, "a publish failed while stopping; it will be replayed");
                    break;
                }
            }
        };
        if tokio::time::timeout(timeout, drain).await.is_err() {
            tracing::warn!("shutdown timeout: unacked events will be replayed on the next start");
        }
    }

    /// The one place an ack is accounted: metrics, watermark, slot.
    fn on_ack(&mut self, client: &ReplicationClient, publisher: &Batcher, ack: Ack) -> Result<()> {
        // A duplicate was stored before, by an earlier run: not published
        // now, and its age is that run's, not this one's.
        if ack.result? {
            self.metrics.skipped.increment(1);
        } else {
            self.metrics.published.increment(1);
            let age = unix_micros_now() - pg_to_unix_micros(ack.commit_micros);
            self.metrics.commit_to_ack.record(age.max(0) as f64 / 1e6);
        }
        let confirmed = self.watermark.ack(ack.ticket);
        if let Some(lsn) = confirmed {
            self.confirm(client, lsn);
        }
        self.metrics.in_flight(publisher, confirmed.is_some());
        self.env.lag.set(self.watermark.oldest_unacked());
        Ok(())
    }

    fn confirm(&self, client: &ReplicationClient, lsn: Lsn) {
        client.update_applied_lsn(lsn);
        self.metrics.confirmed.set(lsn.as_u64() as f64);
    }
}

/// The output of `f` if it is ready at once, else `None` (`f` dropped).
/// Outside the task's coop budget: with the budget spent a ready future
/// reads as pending, and one that has taken something out of its owner
/// first (as `ReplicationClient::recv` takes the worker's join handle when
/// its channel closes) would be dropped holding it. A turn is bounded by
/// [`TURN`] instead.
fn ready_now<F: std::future::Future>(f: F) -> Option<F::Output> {
    tokio::task::unconstrained(f).now_or_never()
}

fn pg_to_unix_micros(pg: i64) -> i64 {
    pg.saturating_add(super::outbox_row::PG_EPOCH_UNIX_MICROS)
}

pub(super) fn unix_micros_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The backend pid of a replication connection not yet streaming.
async fn backend_pid(client: &mut ReplicationClient) -> Result<i32> {
    let rows = client.simple_query("SELECT pg_backend_pid()").await?;
    rows.first()
        .and_then(|r| r.first())
        .and_then(|v| v.as_ref())
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            Error::setup("SELECT pg_backend_pid() on the replication connection answered no number")
        })
}

#[cfg(test)]
mod tests {
    use super::{ready_now, replication_buffer};

    #[test]
    fn the_wal_buffer_holds_the_byte_bound_in_largest_messages() {
        const MIB: usize = 1 << 20;
        assert_eq!(replication_buffer(32 * MIB, MIB), 32);
        assert_eq!(replication_buffer(16 * MIB, 8 * MIB), 4);
        assert_eq!(replication_buffer(16 * MIB, 64 * MIB), 4);
        assert_eq!(replication_buffer(1 << 30, 64 << 10), 512);
        assert_eq!(replication_buffer(MIB, 0), 512);
    }

    /// What `ReplicationClient::recv` does when its channel closes: take
    /// the worker's join handle, then await it. Polled once with the
    /// task's coop budget spent, a plain `now_or_never` drops the handle
    /// (the worker's error with it); `ready_now` must not.
    #[tokio::test(flavor = "current_thread")]
    async fn ready_now_keeps_an_ended_workers_result_with_the_budget_spent() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(1);
        let worker = tokio::spawn(async move {
            drop(tx);
            "the worker's error"
        });
        let mut join = Some(worker);
        tokio::task::yield_now().await;
        for _ in 0..127 {
            tokio::task::consume_budget().await;
        }
        let recv = async {
            match rx.recv().await {
                Some(n) => Ok(n),
                None => Err(join.take().expect("joined once").await.expect("no panic")),
            }
        };
        assert_eq!(ready_now(recv), Some(Err("the worker's error")));
    }
}
