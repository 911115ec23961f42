//! The consumer: JetStream pull → [`inbox`] → [`handler`] → ACK | NAK |
//! [`dead_letter`].
//!
//! Order (SPEC §6): one process per durable dispatches ([`lease`],
//! [`dispatcher`]); every process of the durable runs the jobs it hands out
//! ([`crew`], SPEC §11). The dispatcher owns all ordering state in one task
//! ([`scheduler`], pure): an aggregate's messages run one at a time in
//! stream order, and a failed one is parked in its inbox row (acked in
//! JetStream) with the aggregate's later messages parked behind it, so it
//! holds no ack-pending slot and the other aggregates flow. Parked messages
//! survive restarts in the inbox; what a previous dispatcher pulled but did
//! not finish comes again in order because taking over, and a delivery lost
//! on the way, reset the consumer to its ack floor.
//!
//! Each job ([`delivery`]) runs in its own task: claim in the inbox, call
//! the handler (inside the inbox transaction, [`transaction`], or detached),
//! complete, ack. Imports go one way: dispatcher → delivery → transaction →
//! handler.
//!
//! Shutdown: stop pulling, hand the lease over, let running jobs finish
//! (bounded), NAK what waits so the next dispatcher gets it at once.

mod config;
mod crew;
mod dead_letter;
mod delivery;
mod dispatcher;
pub mod handler;
pub(crate) mod inbox;
pub(crate) mod lease;
mod scheduler;
mod transaction;
mod watchdog;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, response::Response};
use futures::StreamExt;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics as m;
use crate::readiness::Readiness;
use crate::wire;
pub use config::ConsumeConfig;
use config::{durable_config, JS_REQUEST};
use crew::{Member, Worker};
use dead_letter::DeadLetters;
use delivery::new_shared;
use dispatcher::{Active, Ended, LEASE_POLL};
pub use handler::{Delivery, Handler, HttpHandler, Outcome};
use lease::Lease;

/// How often the other processes of the crew ask for it: a dispatcher's
/// SIGTERM hands over within this (SPEC §11: one second).
const LEASE_ASK: Duration = Duration::from_millis(250);

/// Run until `shutdown`. The consumer is created, or updated to these
/// settings. One instance per durable is active (see [`lease`]); the others
/// wait in standby. `readiness` says which, and when pulling has started.
pub async fn run<H: Handler>(
    cfg: ConsumeConfig,
    pool: PgPool,
    js: jetstream::Context,
    handler: H,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<()> {
    m::register_consumer();
    readiness.not_ready(format!(
        "not consuming yet: creating consumer {} on stream {}",
        cfg.durable, cfg.stream
    ));
    crate::postgres::pooler::check_session_pinned(&pool).await?;
    warn_if_commits_may_be_lost(&pool).await;
    inbox::check_schema(&pool).await.map_err(|e| Error::Setup {
        message: format!(
            "the inbox tables lack what the consumer needs ({e}); run `outbox-relay migrate` against this database"
        ),
        source: Some(Box::new(e)),
    })?;
    let stream = js
        .get_stream(&cfg.stream)
        .await
        .map_err(Error::nats(format!("looking up stream {}", cfg.stream)))?;
    // A failed message waits parked, acked, and is read back later: a stream
    // that deletes acked messages would take it away meanwhile.
    let retention = stream.cached_info().config.retention;
    if retention != jetstream::stream::RetentionPolicy::Limits {
        return Err(Error::setup(format!(
            "stream {} has {retention:?} retention, which deletes acked messages; the consumer acks a failed message while it waits for its retry and reads it back later, so it needs limits retention (the relay creates its streams so)",
            cfg.stream
        )));
    }
    let max_age = stream.cached_info().config.max_age;
    let parked = delivery::longest_parked(&cfg.backoff, cfg.max_deliver);
    if !max_age.is_zero() && max_age < parked {
        tracing::warn!(stream = %cfg.stream, ?max_age, backoff_total = ?parked, "the stream's max age is shorter than a failing message may wait for its retries (--backoff over --max-deliver): one that ages out while it waits is dead-lettered as expired, from its inbox row, without its body");
    }
    if let Some(schemas) = &cfg.schemas {
        let filter = cfg.filter.as_deref().unwrap_or(">");
        warn_unschematized(&stream, filter, schemas).await;
    }
    // A running crew's dispatcher has sized the window for every process
    // (see `durable_config`): a process that joins keeps it, or the durable
    // would hold back until the dispatcher sized it again.
    let existing = stream.consumer_info(&cfg.durable).await.ok();
    let window = match &existing {
        Some(info)
            if cfg.max_ack_pending > 0 && info.config.max_ack_pending > cfg.max_ack_pending =>
        {
            info.config.max_ack_pending
        }
        _ => cfg.max_ack_pending,
    };
    let mut config = durable_config(&cfg, window);
    // A durable `consumer reset` made again at a sequence (a server
    // before ADR-60) keeps that start: the server cannot change a
    // durable's deliver policy, and where it started is history.
    if let Some(info) = &existing {
        config.deliver_policy = info.config.deliver_policy;
    }
    let consumer = stream
        .create_consumer(config)
        .await
        .map_err(Error::nats(format!("creating consumer {}", cfg.durable)))?;
    let dlq = DeadLetters::new(
        js.clone(),
        &cfg.dlq_prefix,
        &cfg.durable,
        &cfg.stream,
        cfg.dlq_replicas,
    )
    .await?;
    // Figures of the durable, not of this instance: every instance, active
    // or standby, reports them.
    let watchers = CancellationToken::new();
    let _watchers = watchers.clone().drop_guard();
    let (dlq_stream, dlq_subjects) = dlq.stream();
    // A dead letter replaces the event it was (the original is acked once
    // it is stored): a dead-letter stream that loses what it acked loses
    // events (review U1), so it is judged like the relay's streams.
    let servers = crate::durability::read_servers(&cfg.nats_monitor_url).await;
    for failed in &servers.failed {
        tracing::warn!(error = %failed, "cannot read a server's sync_interval");
    }
    let durability = crate::durability::judge(&dlq.placement().await?, &servers);
    metrics::gauge!(crate::metrics::CONSUMER_DLQ_DURABLE).set(if durability.durable {
        1.0
    } else {
        0.0
    });
    if !durability.durable {
        if cfg.require_durable && !servers.failed.is_empty() {
            // Unknown is not "not durable": a monitoring port down for a
            // moment is retried, not a configuration to fix.
            return Err(Error::Nats {
                context: "--require-durable needs the server's sync_interval".into(),
                source: Box::new(Error::setup(format!("dead letters: {}", durability.why))),
            });
        }
        if cfg.require_durable {
            return Err(Error::Config(format!(
                "--require-durable: dead letters: {}",
                durability.why
            )));
        }
        tracing::warn!(
            "acked dead letters are not durable: {}; --dlq-replicas 3 creates it with three",
            durability.why
        );
        readiness.caution(Some(format!(
            "acked dead letters are not durable: {}",
            durability.why
        )));
    }
    tokio::spawn(crate::nats::watch_depth(
        js.clone(),
        dlq_stream.to_owned(),
        dlq_subjects,
        watchers.clone(),
    ));
    tokio::spawn(watch_lag(
        js.clone(),
        consumer.cached_info().clone(),
        stream.clone(),
        cfg.filter.clone().unwrap_or_else(|| ">".to_owned()),
        watchers,
    ));
    let handler = Arc::new(handler);
    // Every process of the durable works (SPEC §11, `crew`): whichever
    // holds the lease dispatches, and all run the jobs it hands out.
    let member = Member::join(&pool, &cfg.stream, &cfg.durable).await?;
    let helping = new_shared(
        &cfg,
        &pool,
        &stream,
        &dlq,
        handler.clone(),
        CancellationToken::new(),
        delivery::Role::Helper(delivery::Recorder {
            client: js.client(),
            subject: crew::record_subject(&cfg.stream, &cfg.durable),
        }),
        member.id,
    );
    let worker = Arc::new(Worker {
        registry: Default::default(),
        dispatching: AtomicBool::new(false),
        processes: AtomicUsize::new(1),
        member: std::sync::atomic::AtomicI32::new(member.id),
        fences: Default::default(),
        dlq_failing: helping.dlq_failing.clone(),
        overheard: Default::default(),
    });
    let worker_task = tokio::spawn(crew::work(
        helping,
        js.clone(),
        pool.clone(),
        member,
        worker.clone(),
        readiness.clone(),
        shutdown.clone(),
        cfg.shutdown_timeout,
    ));
    let ended = dispatch(
        &cfg, &pool, &js, &stream, &consumer, &dlq, handler, &readiness, &shutdown, &worker,
    )
    .await;
    match &ended {
        // The jobs this process runs for the crew finish first.
        Ok(()) => {
            let _ = worker_task.await;
        }
        Err(_) => worker_task.abort(),
    }
    ended
}

/// Ask for the lease until shutdown; dispatch while holding it.
#[allow(clippy::too_many_arguments)]
async fn dispatch<H: Handler>(
    cfg: &ConsumeConfig,
    pool: &PgPool,
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    consumer: &Consumer,
    dlq: &DeadLetters,
    handler: Arc<H>,
    readiness: &Readiness,
    shutdown: &CancellationToken,
    worker: &Arc<Worker>,
) -> Result<()> {
    let standby = metrics::gauge!(m::CONSUMER_STANDBY);
    let mut standby_logged = false;
    // One connection for every ask, kept between them (four asks a second
    // must not be four new Postgres sessions).
    let mut asking = None;
    loop {
        // A process cut off from NATS could neither reach the crew nor
        // pull: holding the lease, it would only keep the others waiting.
        if js.client().connection_state() != async_nats::connection::State::Connected {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(LEASE_ASK) => continue,
            }
        }
        let member = worker.member.load(Ordering::Relaxed);
        let lease = match Lease::try_acquire(
            pool,
            &mut asking,
            &cfg.stream,
            &cfg.durable,
            Some(member),
        )
        .await
        {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                standby.set(1.0);
                if !standby_logged {
                    tracing::info!(durable = %cfg.durable, "another process of this durable dispatches; this one runs the jobs it is sent");
                    standby_logged = true;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(LEASE_ASK) => continue,
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot ask for the consumer lease; retrying");
                readiness.not_ready(format!("cannot ask for the consumer lease: {e}"));
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(LEASE_POLL) => continue,
                }
            }
        };
        standby.set(0.0);
        standby_logged = false;
        let active = Active {
            cfg,
            js,
            pool,
            stream,
            dlq,
            handler: handler.clone(),
            readiness,
            me: member,
            worker,
        };
        worker.dispatching.store(true, Ordering::Relaxed);
        let result = active.run(consumer.clone(), lease, shutdown).await;
        worker.dispatching.store(false, Ordering::Relaxed);
        match result {
            Ok(Ended::Shutdown) => return Ok(()),
            Ok(Ended::LeaseLost) => {
                tracing::warn!(
                    "lost the consumer lease (its Postgres connection failed); stopped dispatching"
                );
                readiness.not_ready("lost the consumer lease; asking again");
            }
            // The lease went with `run` (its connection closed): another
            // instance may take over meanwhile. An outage that a running
            // instance rides out must not end one that was taking over.
            Err(e) if e.class() == crate::error::Class::Transient => {
                tracing::warn!(error = %e, retry_in = ?LEASE_POLL, "stopped dispatching on a transient error; asking for the lease again");
                readiness.not_ready(format!(
                    "stopped dispatching: {e}; asking for the lease again"
                ));
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(LEASE_POLL) => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The inbox row is what keeps a message from being handled twice, and a
/// Rust handler's effects commit with it: a commit the database can lose
/// after acknowledging it (a failover to an asynchronous standby, or
/// `synchronous_commit = off` and a crash) loses that. Said once at start;
/// never refused (a single-node database with a good disk is fine).
async fn warn_if_commits_may_be_lost(pool: &PgPool) {
    let settings: std::result::Result<(String, String, i64), _> = sqlx::query_as(
        "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'), \
                (SELECT count(*) FROM pg_stat_replication)",
    )
    .fetch_one(pool)
    .await;
    let Ok((commit, standby_names, standbys)) = settings else {
        return;
    };
    if let Some(why) = commits_may_be_lost(&commit, &standby_names, standbys) {
        tracing::warn!("{why}: a handler's effects (Rust) or the record that it ran (HTTP) can be lost after the consumer acked the message, and then it is never delivered again or called again; see docs/guide/consumers.md (failover)");
    }
}

/// Why commits the consumer's database acknowledged may be lost, if they
/// may be.
fn commits_may_be_lost(commit: &str, standby_names: &str, standbys: i64) -> Option<String> {
    match commit {
        "off" => Some("synchronous_commit is off for the consumer's database".into()),
        _ if standbys > 0 && standby_names.trim().is_empty() => Some(format!(
            "the consumer's database streams to {standbys} standby(s) asynchronously (synchronous_standby_names is empty): a failover may drop commits it acknowledged"
        )),
        "local" if standbys > 0 => Some(
            "synchronous_commit is local for the consumer's database: a failover may drop commits it acknowledged".into(),
        ),
        _ => None,
    }
}

/// Distinct subjects, and last messages read, when looking for event
/// types without a schema at start: a bound on the start's cost.
const SCHEMA_SCAN_SUBJECTS: usize = 1000;
const SCHEMA_SCAN_READS: usize = 200;

/// Warn, at start, for each event type the stream holds on `filter` that has
/// no schema: it would reach the handler unchecked (or be dead-lettered,
/// with `--schema-missing dead-letter`). Types are read from the last
/// message of each stored subject, so any subject template works; a type
/// first seen later is warned about on its first delivery.
async fn warn_unschematized(
    stream: &jetstream::stream::Stream,
    filter: &str,
    schemas: &crate::schema::Schemas,
) {
    let scan = async {
        let mut counts = stream.info_with_subjects(filter).await.ok()?;
        let mut subjects = Vec::new();
        while let Some(Ok((subject, _))) = counts.next().await {
            subjects.push(subject);
            if subjects.len() >= SCHEMA_SCAN_SUBJECTS {
                break;
            }
        }
        subjects.sort();
        let mut types = std::collections::BTreeMap::new();
        for subject in subjects.iter().take(SCHEMA_SCAN_READS) {
            let Ok(last) = stream.get_last_raw_message_by_subject(subject).await else {
                continue;
            };
            let header = |k: &str| last.headers.get(k).map(|v| v.as_str().to_owned());
            let Some(event_type) = header(wire::EVENT_TYPE) else {
                continue;
            };
            let version = header(wire::EVENT_VERSION)
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(1);
            types
                .entry((event_type, version))
                .or_insert_with(|| subject.clone());
        }
        Some(types)
    };
    let Ok(Some(types)) = tokio::time::timeout(Duration::from_secs(10), scan).await else {
        tracing::warn!(filter, "cannot list the event types the stream holds; types without a schema are reported on first delivery");
        return;
    };
    let current = schemas.current();
    for ((event_type, version), subject) in types {
        if current.has(&event_type, version) || !schemas.first_note(&event_type, version) {
            continue;
        }
        let fate = match schemas.missing() {
            crate::schema::Missing::Allow => "reach the handler unchecked (--schema-missing allow)",
            crate::schema::Missing::DeadLetter => {
                "are dead-lettered as schema_missing (--schema-missing dead-letter)"
            }
        };
        tracing::warn!(
            filter,
            subject,
            event_type,
            version,
            "no schema for an event type this consumer receives: its messages {fate}"
        );
    }
}

/// How often the durable's lag is measured.
const LAG_TICK: Duration = Duration::from_secs(5);

/// `outbox_consumer_pending_messages`, `outbox_consumer_ack_pending_messages`
/// and `outbox_consumer_lag_seconds`, in every process of the durable
/// (standby or not: a figure only the dispatcher set froze on a process
/// that stopped dispatching, and the autoscaler takes the largest):
/// the age of the oldest message the durable has not acked is the stream
/// time of the first message on its filter past its ack floor, measured
/// against the server's clock (the info's `ts`), never this host's: a
/// consumer host whose clock is off would shift the lag one for one.
async fn watch_lag(
    js: jetstream::Context,
    durable: jetstream::consumer::Info,
    stream: jetstream::stream::Stream,
    filter: String,
    stop: CancellationToken,
) {
    let ack_pending = metrics::gauge!(m::CONSUMER_ACK_PENDING);
    let pending = metrics::gauge!(m::CONSUMER_PENDING);
    let lag = metrics::gauge!(m::CONSUMER_LAG_SECONDS);
    let mut tick = tokio::time::interval(LAG_TICK);
    let info_subject = format!("CONSUMER.INFO.{}.{}", durable.stream_name, durable.name);
    // The oldest unacked message last seen, and how far the server's clock
    // was ahead of this host's then. While NATS cannot answer, nothing can
    // be acked either, so that message only ages: the lag goes on growing
    // from it instead of freezing, and the lag alerts escalate.
    let mut oldest: Option<time::OffsetDateTime> = None;
    let mut skew = time::Duration::ZERO;
    let empty = serde_json::json!({});
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let asked = js.request::<_, _, Response<Progress>>(info_subject.clone(), &empty);
        let info = match tokio::time::timeout(JS_REQUEST, asked).await {
            Ok(Ok(Response::Ok(info))) => info,
            _ => {
                if let Some(t) = oldest {
                    lag.set(age(t, time::OffsetDateTime::now_utc() + skew));
                }
                continue;
            }
        };
        let local = time::OffsetDateTime::now_utc();
        skew = info
            .server_now()
            .map_or(time::Duration::ZERO, |ts| ts - local);
        ack_pending.set(info.num_ack_pending as f64);
        pending.set(info.num_pending as f64);
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            oldest = None;
            lag.set(0.0);
            continue;
        }
        let first = stream
            .raw_message_builder()
            .sequence(info.ack_floor.stream_seq + 1)
            .next_by_subject(filter.clone())
            .send();
        if let Ok(Ok(msg)) = tokio::time::timeout(JS_REQUEST, first).await {
            oldest = Some(msg.time);
        }
        if let Some(t) = oldest {
            lag.set(age(t, local + skew));
        }
    }
}

/// Seconds from `stored` (a message's stream time) to `server_now`; never
/// negative.
fn age(stored: time::OffsetDateTime, server_now: time::OffsetDateTime) -> f64 {
    (server_now - stored).as_seconds_f64().max(0.0)
}

/// What `watch_lag` reads of the durable's info: async-nats leaves out
/// the server's time of the answer (`ts`, nats-server 2.10+).
#[derive(serde::Deserialize)]
struct Progress {
    #[serde(default)]
    ts: Option<String>,
    num_pending: u64,
    num_ack_pending: u64,
    ack_floor: Floor,
}

#[derive(serde::Deserialize)]
struct Floor {
    stream_seq: u64,
}

impl Progress {
    fn server_now(&self) -> Option<time::OffsetDateTime> {
        let ts = self.ts.as_deref()?;
        time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()
    }
}

type Consumer = jetstream::consumer::Consumer<pull::Config>;

#[cfg(test)]
mod tests {
    use super::{age, commits_may_be_lost, Progress};

    /// The lag is the server's: a consumer host whose clock is a minute
    /// ahead, or behind, reads what a host in step reads. Before, it read
    /// its own clock against the stream's times (60 s more, or 0).
    #[test]
    fn the_lag_is_measured_on_the_servers_clock() {
        let info: Progress = serde_json::from_str(
            r#"{"type":"io.nats.jetstream.api.v1.consumer_info_response","stream_name":"S","name":"d",
                "created":"2026-11-29T00:00:00Z","ts":"2026-11-29T00:10:00.5Z",
                "num_pending":3,"num_ack_pending":1,"num_waiting":0,"num_redelivered":0,
                "delivered":{"consumer_seq":9,"stream_seq":9},"ack_floor":{"consumer_seq":7,"stream_seq":7}}"#,
        )
        .unwrap();
        let server = info.server_now().unwrap();
        let stored = server - time::Duration::seconds(12);
        for off in [-60, 0, 60] {
            let local = server + time::Duration::seconds(off);
            let skew = server - local;
            assert_eq!(age(stored, local + skew), 12.0, "host clock off by {off} s");
        }
        assert_eq!(info.ack_floor.stream_seq, 7);
        let old: Progress = serde_json::from_str(
            r#"{"num_pending":0,"num_ack_pending":0,"ack_floor":{"stream_seq":0}}"#,
        )
        .unwrap();
        assert!(
            old.server_now().is_none(),
            "no ts: this host's clock, as before"
        );
        assert_eq!(age(server, stored), 0.0, "never negative");
    }

    #[test]
    fn commits_that_may_be_lost_are_named() {
        assert!(commits_may_be_lost("on", "", 0).is_none(), "a single node");
        assert!(commits_may_be_lost("on", "ANY 1 (s1)", 2).is_none());
        assert!(commits_may_be_lost("remote_apply", "s1", 1).is_none());
        assert!(commits_may_be_lost("off", "", 0).is_some());
        assert!(
            commits_may_be_lost("on", "", 1).is_some(),
            "an async standby"
        );
        assert!(commits_may_be_lost("local", "s1", 1).is_some());
    }
}
