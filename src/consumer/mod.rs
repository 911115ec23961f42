//! The consumer: JetStream pull → [`inbox`] → [`handler`] → ACK | NAK |
//! [`dead_letter`].
//!
//! Order (SPEC §6): one instance per durable dispatches ([`lease`]); the
//! others wait in standby. The active one owns all ordering state in one
//! task ([`scheduler`], pure): an aggregate's messages run one at a time in
//! stream order, and a failed one is parked in its inbox row (acked in
//! JetStream) with the aggregate's later messages parked behind it, so it
//! holds no ack-pending slot and the other aggregates flow. Parked messages
//! survive restarts in the inbox; what a previous holder pulled but did not
//! finish comes again in order because taking over, and a delivery lost on
//! the way (a gap in the delivery sequence, or unacked deliveries on the
//! server while this instance holds none), reset the consumer to its ack
//! floor.
//!
//! Each job ([`delivery`]) runs in its own task; waiting ones are kept alive
//! with progress acks. A pull stream that ends or fails, or whose client
//! reconnected to another server, is rebuilt (with backoff while that
//! fails); nothing but shutdown ends the consumer once it runs.
//!
//! Shutdown: stop pulling, let running jobs finish (bounded), NAK what waits
//! so the next active instance gets it at once.

mod crew;
mod dead_letter;
mod delivery;
pub mod handler;
mod inbox;
pub(crate) mod lease;
mod scheduler;
mod transaction;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::ops::endpoint::Readiness;
use crate::ops::metrics as m;
use crate::wire;
use crew::{Crew, Member, Sent, Worker};
use dead_letter::DeadLetters;
use delivery::Shared;
pub use handler::{Delivery, Handler, HttpHandler, Outcome};
use lease::Lease;
use scheduler::{Finished, Job, Scheduler};

/// Validated consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumeConfig {
    pub stream: String,
    pub durable: String,
    pub filter: Option<String>,
    pub ack_wait: Duration,
    pub max_deliver: i64,
    pub max_ack_pending: i64,
    pub concurrency: usize,
    /// NAK delay for delivery n is `backoff[min(n, len) - 1]`.
    pub backoff: Vec<Duration>,
    pub dlq_prefix: String,
    pub dlq_replicas: u8,
    pub shutdown_timeout: Duration,
    /// `--schemas`: payloads are checked before the handler is called; one
    /// that fails is dead-lettered without a call. SIGHUP reloads them.
    pub schemas: Option<std::sync::Arc<crate::schema::Schemas>>,
}

/// The longest pause between attempts to rebuild a failed pull stream.
const MAX_RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);

const PULL_HEARTBEAT: Duration = Duration::from_millis(500);
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// How often the consumer looks whether its NATS client reconnected.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);

/// How often the dispatcher checks that it still holds the lease.
const LEASE_POLL: Duration = Duration::from_secs(1);
/// How often the other processes of the crew ask for it: a dispatcher's
/// SIGTERM hands over within this (SPEC §11: one second).
const LEASE_ASK: Duration = Duration::from_millis(250);

/// Why an active period ended.
enum Ended {
    Shutdown,
    LeaseLost,
}

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
    if let Some(schemas) = &cfg.schemas {
        let filter = cfg.filter.as_deref().unwrap_or(">");
        warn_unschematized(&stream, filter, schemas).await;
    }
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(cfg.durable.clone()),
            filter_subject: cfg.filter.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: cfg.ack_wait,
            // Attempts are counted in the inbox (`--max-deliver`); JetStream
            // redelivers only what a crash or a reset left unacked, and must
            // never give up on it.
            max_deliver: -1,
            max_ack_pending: cfg.max_ack_pending,
            ..Default::default()
        })
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
    tokio::spawn(crate::ops::dlq::watch_depth(
        js.clone(),
        dlq_stream.to_owned(),
        dlq_subjects,
        watchers.clone(),
    ));
    tokio::spawn(watch_lag(
        consumer.clone(),
        stream.clone(),
        cfg.filter.clone().unwrap_or_else(|| ">".to_owned()),
        watchers,
    ));
    let handler = Arc::new(handler);
    // Every process of the durable works (SPEC §11, `crew`): whichever
    // holds the lease dispatches, and all run the jobs it hands out.
    let member = Member::join(&pool, &cfg.stream, &cfg.durable).await?;
    let me = member.id;
    let worker = Arc::new(Worker {
        registry: Default::default(),
        dispatching: AtomicBool::new(false),
        processes: AtomicUsize::new(1),
    });
    let worker_task = tokio::spawn(crew::work(
        new_shared(
            &cfg,
            &pool,
            &stream,
            &dlq,
            handler.clone(),
            CancellationToken::new(),
        ),
        js.clone(),
        pool.clone(),
        member,
        worker.clone(),
        readiness.clone(),
        shutdown.clone(),
        cfg.shutdown_timeout,
    ));
    let ended = dispatch(
        &cfg, &pool, &js, &stream, &consumer, &dlq, handler, &readiness, &shutdown, me, &worker,
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
    me: i32,
    worker: &Arc<Worker>,
) -> Result<()> {
    let standby = metrics::gauge!(m::CONSUMER_STANDBY);
    let mut standby_logged = false;
    loop {
        let lease = match Lease::try_acquire(pool, &cfg.stream, &cfg.durable).await {
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
            me,
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

/// One period as the active instance.
struct Active<'a, H> {
    cfg: &'a ConsumeConfig,
    js: &'a jetstream::Context,
    pool: &'a PgPool,
    stream: &'a jetstream::stream::Stream,
    dlq: &'a DeadLetters,
    handler: Arc<H>,
    readiness: &'a Readiness,
    me: i32,
    worker: &'a Arc<Worker>,
}

/// How a job of the dispatcher ended, wherever it ran.
struct JobEnd {
    id: u64,
    key: String,
    how: Finished<Instant>,
    /// Run the way a panic is handled: reset to the ack floor.
    panicked: bool,
    /// Run by this process (else by another of the crew).
    local: bool,
}

/// The processing state a job needs, one per dispatcher period and one for
/// the jobs the crew sends this process.
fn new_shared<H: Handler>(
    cfg: &ConsumeConfig,
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    dlq: &DeadLetters,
    handler: Arc<H>,
    stop: CancellationToken,
) -> Arc<Shared<H>> {
    Arc::new(Shared {
        pool: pool.clone(),
        handler: handler.clone(),
        dlq: dlq.clone(),
        cfg: cfg.clone(),
        stream: stream.clone(),
        stop,
        dlq_failing: AtomicUsize::new(0),
        batcher: inbox::Batcher::start(pool.clone(), cfg.durable.clone(), cfg.stream.clone()),
        transactions: handler.in_transaction().then(|| {
            // A quarter of the pool each for the dispatcher's and the crew's
            // jobs, so parking, retries and the lease check still find a
            // connection; four shared groups are enough to keep Postgres
            // busy, one message each is not.
            let max_group = handler.max_group().clamp(1, transaction::MAX_GROUP);
            let quarter_pool = (pool.options().get_max_connections() / 4).max(1) as usize;
            let workers = if max_group == 1 {
                quarter_pool
            } else {
                quarter_pool.min(4)
            };
            transaction::Transactions::start(
                pool.clone(),
                handler.clone(),
                transaction::Settings {
                    consumer: cfg.durable.clone(),
                    stream: cfg.stream.clone(),
                    workers,
                    max_group,
                },
            )
        }),
    })
}

type Consumer = jetstream::consumer::Consumer<pull::Config>;

impl<H: Handler> Active<'_, H> {
    async fn run(
        self,
        mut consumer: Consumer,
        mut lease: Lease,
        shutdown: &CancellationToken,
    ) -> Result<Ended> {
        let cfg = self.cfg;
        self.readiness
            .not_ready("taking over: resuming from the ack floor");
        let crew_stop = CancellationToken::new();
        let _crew_stop = crew_stop.clone().drop_guard();
        let crew = Crew::start(
            self.js.client(),
            self.pool.clone(),
            &cfg.stream,
            &cfg.durable,
            self.me,
            crew_stop,
        )
        .await?;
        // Past half of max_ack_pending waiting in memory, busy keys spill
        // theirs to the inbox, so JetStream never holds back for them.
        let high_water = usize::try_from(cfg.max_ack_pending)
            .ok()
            .filter(|&m| m > 0)
            .map_or(10_000, |m| (m / 2).max(1));
        let mut scheduler: Scheduler<jetstream::Message, Instant> =
            Scheduler::new(cfg.concurrency, high_water);
        // What the crew runs for a previous dispatcher keeps its key busy
        // until it ends: its message, delivered again by the reset, waits
        // behind it.
        let adopted = crew.adopt(self.pool, &cfg.stream, &cfg.durable).await;
        for (running, _) in &adopted {
            scheduler.adopt(running.key.clone());
        }
        let heads = inbox::parked_heads(self.pool, &cfg.durable, &cfg.stream)
            .await
            .map_err(Error::pg("reading parked messages"))?;
        let now = Instant::now();
        for (key, seq, wait) in heads {
            scheduler.load_parked(key, seq, now + wait);
        }
        // Whatever a previous holder pulled and did not finish comes again,
        // in stream order, before anything new: order survives its crash.
        let rewound = reset_to_ack_floor(&mut consumer, "taking over").await;
        if let Some(from) = rewound {
            scheduler.rewound(from);
        }
        let mut rewound_at = Instant::now();
        let stop = shutdown.child_token();
        let shared = new_shared(
            cfg,
            self.pool,
            self.stream,
            self.dlq,
            self.handler.clone(),
            stop.clone(),
        );
        let mut messages = Some(
            pull_stream(&consumer, cfg)
                .await
                .map_err(Error::nats("starting the pull subscription"))?,
        );
        // When the pull stream is down: when to rebuild it, the pause after
        // that, and whether to reset to the ack floor first. Rebuilding is a
        // branch of the loop, never a wait inside it: during an election
        // JetStream requests wait out their timeout, and running jobs must
        // still finish meanwhile.
        let mut rebuild: Option<Rebuild> = None;
        let mut rebuild_pause = MIN_REBUILD_PAUSE;
        let durable_now = Arc::new(std::sync::Mutex::new(None));
        let pending_task = tokio::spawn(watch_pending(
            consumer.clone(),
            durable_now.clone(),
            stop.clone(),
        ));
        // A pull request can vanish with a consumer leader without the pull
        // stream noticing (no error, no missed heartbeat); a stream that
        // stays quiet while messages are pending is rebuilt. A delivery
        // lost on the way (a pull stream renewed while it travelled) that
        // was the last in the stream shows neither a gap nor pending
        // messages, only the server's count of unacked deliveries while
        // this consumer holds none.
        let mut last_arrival = Instant::now();
        let mut last_settled = Instant::now();
        let mut quiet_check = tokio::time::interval(QUIET_PULL);
        tracing::info!(stream = %cfg.stream, durable = %cfg.durable, parked_aggregates = scheduler.parked_keys(), "consuming");
        self.readiness.ready();

        let mut tasks: JoinSet<JobEnd> = JoinSet::new();
        let registry = self.worker.registry.clone();
        // Deliveries and retries this process runs; past `--concurrency`,
        // they go to the crew.
        let local_running = Arc::new(AtomicUsize::new(0));
        let start = |tasks: &mut JoinSet<JobEnd>, jobs: Vec<(String, Job<jetstream::Message>)>| {
            for (key, job) in jobs {
                let id = crew::new_job_id();
                let retry = match &job {
                    Job::Retry { seq } => Some(*seq),
                    _ => None,
                };
                let counted = retry.is_some() || matches!(job, Job::Deliver(_));
                let remote = if counted && local_running.load(Ordering::Relaxed) >= cfg.concurrency
                {
                    crew.pick()
                } else {
                    None
                };
                if counted && remote.is_none() {
                    local_running.fetch_add(1, Ordering::Relaxed);
                    crew::register(&registry, id, &key, retry);
                }
                let shared = shared.clone();
                let crew = crew.clone();
                let local_running = local_running.clone();
                let registry = registry.clone();
                tasks.spawn(async move {
                    if let Some(member) = remote {
                        match crew.send(member, id, &key, &job).await {
                            Sent::Accepted(end) => {
                                let (how, panicked) =
                                    crew::await_end(&crew, &shared, &key, retry, end).await;
                                crew.unreserve(member);
                                return JobEnd {
                                    id,
                                    key,
                                    how,
                                    panicked,
                                    local: false,
                                };
                            }
                            Sent::Refused => {
                                crew.unreserve(member);
                                local_running.fetch_add(1, Ordering::Relaxed);
                                crew::register(&registry, id, &key, retry);
                            }
                        }
                    }
                    let (how, panicked) = crew::run_caught(&shared, &key, job, retry).await;
                    if counted {
                        local_running.fetch_sub(1, Ordering::Relaxed);
                    }
                    JobEnd {
                        id,
                        key,
                        how,
                        panicked,
                        local: counted,
                    }
                });
            }
        };
        for (running, end) in adopted {
            let shared = shared.clone();
            let crew = crew.clone();
            tasks.spawn(async move {
                let (how, panicked) =
                    crew::await_end(&crew, &shared, &running.key, running.retry, end).await;
                JobEnd {
                    id: running.id,
                    key: running.key,
                    how,
                    panicked,
                    local: false,
                }
            });
        }
        let mut crew_tick = tokio::time::interval(crew::BEAT);
        let remote_jobs = metrics::gauge!(m::CONSUMER_REMOTE_JOBS);
        let mut progress =
            tokio::time::interval((cfg.ack_wait / 3).max(Duration::from_millis(100)));
        let mut lease_check = tokio::time::interval(LEASE_POLL);
        let parked = metrics::gauge!(m::CONSUMER_PARKED_AGGREGATES);
        metrics::gauge!(m::CONSUMER_PENDING).set(consumer.cached_info().num_pending as f64);

        // A pull subscription does not survive its client moving to another
        // server (a NATS node died): async-nats resubscribes the inbox but the
        // outstanding pull request is gone, and the stream goes quiet without
        // an error. Each new connection gets a new pull subscription.
        let stats = self.js.client().statistics();
        let mut connects = stats.connects.load(Ordering::Relaxed);
        let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
        // Deliveries to the only puller are numbered without gaps; a gap is a
        // delivery lost on the way (a consumer leader died with it), which
        // would come back only after ack_wait, behind later messages.
        let mut last_delivery: Option<u64> = None;

        let ended = loop {
            let wake = scheduler.next_wake();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ended::Shutdown,
                Some(done) = tasks.join_next() => {
                    last_settled = Instant::now();
                    if let Ok(JobEnd { id, key, how, panicked, local }) = done {
                        if local {
                            if let Ok(mut r) = registry.lock() {
                                r.remove(&id);
                            }
                        }
                        if panicked {
                            // Before the key's lane goes on: what waits
                            // behind the lost message comes back with it,
                            // after it, through the reset.
                            drop(scheduler.take_waiting());
                            messages = None;
                            rebuild = Some(Rebuild { at: Instant::now(), reset: true, tries: 0 });
                        }
                        let jobs = scheduler.finish(&key, how, Instant::now());
                        start(&mut tasks, jobs);
                    }
                }
                _ = crew_tick.tick() => {
                    let jobs = scheduler.set_concurrency(cfg.concurrency + crew.capacity(), Instant::now());
                    start(&mut tasks, jobs);
                    let local = local_running.load(Ordering::Relaxed);
                    remote_jobs.set(tasks.len().saturating_sub(local) as f64);
                    self.readiness.note(format!(
                        "dispatching durable {} for {} process(es): {local} job(s) running here, {} in the other processes",
                        cfg.durable,
                        crew.helpers() + 1,
                        tasks.len().saturating_sub(local),
                    ));
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now).into()), if wake.is_some() => {
                    let jobs = scheduler.wake(Instant::now());
                    start(&mut tasks, jobs);
                }
                _ = lease_check.tick() => {
                    if !matches!(tokio::time::timeout(JS_REQUEST, lease.held()).await, Ok(true)) {
                        break Ended::LeaseLost;
                    }
                    parked.set(scheduler.parked_keys() as f64);
                    let failing = shared.dlq_failing.load(Ordering::Relaxed);
                    metrics::gauge!(m::CONSUMER_DLQ_FAILING).set(failing as f64);
                    if failing > 0 {
                        self.readiness.not_ready(format!(
                            "{failing} dead letter(s) not stored yet: the dead-letter stream refuses them; retrying"
                        ));
                    } else {
                        self.readiness.ready();
                    }
                }
                _ = reconnect_check.tick() => {
                    let now = stats.connects.load(Ordering::Relaxed);
                    if now != connects {
                        connects = now;
                        tracing::info!("NATS reconnected; renewing the pull subscription");
                        messages = None;
                        rebuild.get_or_insert(Rebuild { at: Instant::now(), reset: false, tries: 0 });
                    }
                }
                _ = quiet_check.tick() => {
                    let durable = durable_now.lock().ok().and_then(|d| *d);
                    // A parked head held for the pull to come back to it,
                    // while JetStream has nothing left to deliver: its
                    // message left the stream. It goes on.
                    if scheduler.holds_back()
                        && durable.is_some_and(|d| {
                            d.num_pending == 0 && d.asked > last_arrival.max(rewound_at) + ACK_LANDS
                        })
                    {
                        let jobs = scheduler.release(Instant::now());
                        start(&mut tasks, jobs);
                    }
                    let quiet = messages.is_some()
                        && scheduler.can_pull()
                        && last_arrival.elapsed() > QUIET_PULL;
                    let lost = durable.and_then(|d| {
                        if d.num_pending > 0 && !d.ack_pending_full {
                            Some("nothing delivered while messages are pending")
                        } else if d.num_ack_pending > 0
                            && scheduler.holds_no_delivery()
                            && d.asked > last_settled + ACK_LANDS
                        {
                            Some("JetStream counts deliveries unacked that never arrived")
                        } else {
                            None
                        }
                    });
                    if let (true, Some(why)) = (quiet, lost) {
                        tracing::warn!(quiet = ?last_arrival.elapsed(), "{why}; resuming from the ack floor");
                        drop(scheduler.take_waiting());
                        messages = None;
                        last_arrival = Instant::now();
                        rebuild = Some(Rebuild { at: Instant::now(), reset: true, tries: 0 });
                    }
                }
                _ = progress.tick() => {
                    // Waiting deliveries must not pass ack_wait, or they come back
                    // as duplicates out of order.
                    for msg in scheduler.waiting() {
                        let _ = msg.ack_with(AckKind::Progress).await;
                    }
                }
                _ = tokio::time::sleep_until(rebuild.as_ref().map_or_else(Instant::now, |r| r.at).into()), if rebuild.is_some() => {
                    let Some(mut r) = rebuild.take() else { continue };
                    if r.reset {
                        if r.tries < MAX_RESET_TRIES {
                            r.tries += 1;
                            let Some(from) = reset_to_ack_floor(&mut consumer, "lost delivery").await else {
                                r.at = Instant::now() + rebuild_pause;
                                rebuild_pause = (rebuild_pause * 2).min(MAX_RESUBSCRIBE_BACKOFF);
                                rebuild = Some(r);
                                continue;
                            };
                            scheduler.rewound(from);
                            rewound_at = Instant::now();
                        } else {
                            tracing::warn!("giving up the reset: the lost delivery comes back after ack_wait");
                        }
                        // Numbering starts over either way, or the next
                        // delivery would look like another gap.
                        last_delivery = None;
                    }
                    match tokio::time::timeout(JS_REQUEST, pull_stream(&consumer, cfg)).await {
                        Ok(Ok(m)) => messages = Some(m),
                        result => {
                            let error = match result {
                                Ok(Err(e)) => e.to_string(),
                                _ => "timed out".to_owned(),
                            };
                            tracing::warn!(error, retry_in = ?rebuild_pause, "cannot restart the pull subscription");
                            r.at = Instant::now() + rebuild_pause;
                            r.reset = false;
                            rebuild_pause = (rebuild_pause * 2).min(MAX_RESUBSCRIBE_BACKOFF);
                            rebuild = Some(r);
                        }
                    }
                }
                next = next_message(&mut messages), if messages.is_some() && scheduler.can_pull() => {
                    let msg = match next {
                        Some(Ok(m)) => m,
                        failed => {
                            // Missed heartbeats, no responders: the pull request
                            // is gone with a consumer leader. A new subscription
                            // asks the current one, after a pause that grows
                            // while the stream keeps failing at once.
                            match failed {
                                Some(Err(e)) => tracing::debug!(error = %e, retry_in = ?rebuild_pause, "pull stream error; renewing the pull subscription"),
                                _ => tracing::debug!(retry_in = ?rebuild_pause, "pull stream ended; renewing the pull subscription"),
                            }
                            messages = None;
                            rebuild = Some(Rebuild { at: Instant::now() + rebuild_pause, reset: false, tries: 0 });
                            rebuild_pause = (rebuild_pause * 2).min(MAX_RESUBSCRIBE_BACKOFF);
                            continue;
                        }
                    };
                    rebuild_pause = MIN_REBUILD_PAUSE;
                    let (delivery, stream_seq) = msg
                        .info()
                        .map(|i| (i.consumer_sequence, Some(i.stream_sequence)))
                        .unwrap_or((0, None));
                    if let Some(last) = last_delivery {
                        if delivery != last + 1 {
                            tracing::warn!(last, now = delivery, "a delivery was lost on the way; resuming from the ack floor");
                            // What waits is delivered again by the reset.
                            drop(scheduler.take_waiting());
                            drop(msg);
                            messages = None;
                            rebuild = Some(Rebuild { at: Instant::now(), reset: true, tries: 0 });
                            continue;
                        }
                    }
                    last_delivery = Some(delivery);
                    last_arrival = Instant::now();
                    if let Some(seq) = stream_seq {
                        let jobs = scheduler.passed(seq, Instant::now());
                        start(&mut tasks, jobs);
                    }
                    let key = aggregate_key(&msg);
                    let jobs = scheduler.arrive(key, msg, Instant::now());
                    start(&mut tasks, jobs);
                }
            }
        };

        // No more pulls. What waits is NAKed so the next dispatcher gets it
        // at once.
        drop(messages);
        for msg in scheduler.take_waiting() {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
        pending_task.abort();
        remote_jobs.set(0.0);
        if matches!(ended, Ended::LeaseLost) {
            // Another instance may be active already: nothing more of ours runs.
            stop.cancel();
            tasks.abort_all();
            if let Ok(mut r) = registry.lock() {
                r.retain(|_, j| !j.mine);
            }
            lease.release().await;
        } else {
            // Hand over at once: the next dispatcher hears from this
            // process which jobs still run here, and from the others what
            // they run, and waits for each.
            self.readiness.not_ready("shutting down");
            crew.hand_over();
            lease.release().await;
            let client = self.js.client();
            let deadline = Instant::now() + cfg.shutdown_timeout;
            while !tasks.is_empty() {
                match tokio::time::timeout_at(deadline.into(), tasks.join_next()).await {
                    Ok(Some(Ok(end))) => {
                        if end.local {
                            crew::report(
                                &client,
                                &cfg.stream,
                                &cfg.durable,
                                end.id,
                                end.how,
                                end.panicked,
                            )
                            .await;
                            if let Ok(mut r) = registry.lock() {
                                r.remove(&end.id);
                            }
                        }
                    }
                    Ok(Some(Err(_))) => {}
                    Ok(None) => break,
                    Err(_) => {
                        tracing::warn!(
                            running = tasks.len(),
                            "shutdown timeout: unfinished deliveries will be redelivered"
                        );
                        stop.cancel();
                        tasks.abort_all();
                        if let Ok(mut r) = registry.lock() {
                            r.retain(|_, j| !j.mine);
                        }
                        break;
                    }
                }
            }
        }
        tracing::info!("consumer stopped dispatching");
        Ok(ended)
    }
}

/// Put the consumer back at its ack floor (ADR-60, nats-server 2.14+): every
/// unacked message is delivered again, in stream order, at once. Whether it
/// worked (within [`JS_REQUEST`]).
/// The stream sequence JetStream delivers again from, once reset.
async fn reset_to_ack_floor(consumer: &mut Consumer, why: &str) -> Option<u64> {
    match tokio::time::timeout(JS_REQUEST, consumer.reset(None)).await {
        Ok(Ok(r)) => {
            tracing::info!(
                why,
                ack_floor = r.reset_seq,
                "consumer reset to its ack floor"
            );
            Some(r.reset_seq)
        }
        Ok(Err(e)) => {
            tracing::warn!(why, error = %e, "cannot reset the consumer to its ack floor (no leader now, or nats-server before 2.14); unacked messages come back after ack_wait");
            None
        }
        Err(_) => {
            tracing::warn!(why, "no answer to the consumer reset");
            None
        }
    }
}

/// What the server last said of the durable, and when it was asked.
#[derive(Debug, Clone, Copy)]
struct DurableState {
    asked: Instant,
    num_pending: u64,
    num_ack_pending: u64,
    /// JetStream holds back at max_ack_pending: quiet then is not a lost
    /// pull request.
    ack_pending_full: bool,
}

/// An ack sent when a job settles has reached the server by then, so a
/// count asked later no longer includes it.
const ACK_LANDS: Duration = Duration::from_secs(1);

/// The pending gauge and [`DurableState`], kept off the dispatcher: during
/// an election the info request waits out its timeout.
async fn watch_pending(
    mut consumer: Consumer,
    now: Arc<std::sync::Mutex<Option<DurableState>>>,
    stop: CancellationToken,
) {
    let pending = metrics::gauge!(m::CONSUMER_PENDING);
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let asked = Instant::now();
        if let Ok(Ok(info)) = tokio::time::timeout(JS_REQUEST, consumer.info()).await {
            pending.set(info.num_pending as f64);
            let limit = info.config.max_ack_pending;
            let state = DurableState {
                asked,
                num_pending: info.num_pending,
                num_ack_pending: info.num_ack_pending as u64,
                ack_pending_full: limit > 0 && info.num_ack_pending as i64 >= limit,
            };
            if let Ok(mut d) = now.lock() {
                *d = Some(state);
            }
        }
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

/// `outbox_consumer_ack_pending_messages` and `outbox_consumer_lag_seconds`:
/// the age of the oldest message the durable has not acked is the stream
/// time of the first message on its filter past its ack floor.
async fn watch_lag(
    mut consumer: Consumer,
    stream: jetstream::stream::Stream,
    filter: String,
    stop: CancellationToken,
) {
    let ack_pending = metrics::gauge!(m::CONSUMER_ACK_PENDING);
    let lag = metrics::gauge!(m::CONSUMER_LAG_SECONDS);
    let mut tick = tokio::time::interval(LAG_TICK);
    // The oldest unacked message last seen. While NATS cannot answer,
    // nothing can be acked either, so that message only ages: the lag goes
    // on growing from it instead of freezing, and the lag alerts escalate.
    let mut oldest: Option<time::OffsetDateTime> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = time::OffsetDateTime::now_utc();
        let age = |t: time::OffsetDateTime| (now - t).as_seconds_f64().max(0.0);
        let info = match tokio::time::timeout(JS_REQUEST, consumer.info()).await {
            Ok(Ok(info)) => info,
            _ => {
                if let Some(t) = oldest {
                    lag.set(age(t));
                }
                continue;
            }
        };
        ack_pending.set(info.num_ack_pending as f64);
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            oldest = None;
            lag.set(0.0);
            continue;
        }
        let first = stream
            .raw_message_builder()
            .sequence(info.ack_floor.stream_sequence + 1)
            .next_by_subject(filter.clone())
            .send();
        if let Ok(Ok(msg)) = tokio::time::timeout(JS_REQUEST, first).await {
            oldest = Some(msg.time);
        }
        if let Some(t) = oldest {
            lag.set(age(t));
        }
    }
}

/// The pull stream is down; rebuild it at `at`, resetting first if `reset`.
struct Rebuild {
    at: Instant,
    reset: bool,
    tries: u32,
}

/// How long the dispatcher waits on one JetStream request.
const JS_REQUEST: Duration = Duration::from_secs(2);
const MIN_REBUILD_PAUSE: Duration = Duration::from_millis(50);
/// The pause before a parked message whose retry panicked is tried again.
const PANIC_PAUSE: Duration = Duration::from_secs(5);
/// How long a pull stream may deliver nothing while messages are pending.
const QUIET_PULL: Duration = Duration::from_secs(5);
/// A reset that keeps failing (a server without ADR-60) is given up.
const MAX_RESET_TRIES: u32 = 20;

async fn next_message(
    messages: &mut Option<Messages>,
) -> Option<std::result::Result<jetstream::Message, pull::MessagesError>> {
    match messages {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

type Messages = pull::Stream;

/// The pull subscription, built the same way at start and on every rebuild.
async fn pull_stream(
    consumer: &jetstream::consumer::Consumer<pull::Config>,
    cfg: &ConsumeConfig,
) -> std::result::Result<Messages, jetstream::consumer::StreamError> {
    // A pull request lives at the consumer's leader: when that node dies,
    // only a missed heartbeat (two intervals) or the request's expiry tells.
    // Short ones keep a failover to seconds; an idle heartbeat is cheap.
    consumer
        .stream()
        .max_messages_per_batch(cfg.concurrency.max(1) * 2)
        .heartbeat(PULL_HEARTBEAT)
        .expires(PULL_EXPIRES)
        .messages()
        .await
}

/// Messages of one aggregate are ordered; without the header, none are.
fn aggregate_key(msg: &jetstream::Message) -> String {
    match delivery::header(msg, wire::AGGREGATE_ID) {
        Some(a) => format!("a:{a}"),
        None => format!(
            "s:{}",
            msg.info().map(|i| i.stream_sequence).unwrap_or_default()
        ),
    }
}
