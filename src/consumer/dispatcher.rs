//! One period as the dispatcher of a durable, in three stages:
//! [`open`](Active::open) (join the crew, adopt what it runs, load parked
//! keys, reset to the ack floor, subscribe), [`pump`](Dispatch::pump) (pull,
//! schedule, start jobs here or in the crew, settle their ends, keep the
//! pull stream alive) and [`drain`](Dispatch::drain) (NAK what waits, then
//! hand over or stop).
//!
//! The [`Scheduler`] decides what runs; everything here is I/O around it.
//! Every branch of the pump is one method of [`Dispatch`], so each reason
//! the dispatcher wakes up reads on its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::config::{durable_config, window, ConsumeConfig, JS_REQUEST, MAX_RESUBSCRIBE_BACKOFF};
use super::crew::{self, Crew, Registry, Sent, Worker};
use super::dead_letter::DeadLetters;
use super::delivery::new_shared;
use super::delivery::{self, Shared};
use super::handler::Handler;
use super::lease::Lease;
use super::scheduler::{Finished, Job, Scheduler};
use super::watchdog::{Watchdog, ACK_LANDS, QUIET_PULL};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::readiness::Readiness;

const PULL_HEARTBEAT: Duration = Duration::from_millis(500);
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// Why an active period ended.
pub(super) enum Ended {
    Shutdown,
    LeaseLost,
}

/// How often the dispatcher looks whether its NATS client reconnected.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);
/// How often the dispatcher checks that it still holds the lease.
pub(super) const LEASE_POLL: Duration = Duration::from_secs(1);
const MIN_REBUILD_PAUSE: Duration = Duration::from_millis(50);

type Consumer = jetstream::consumer::Consumer<pull::Config>;
type Messages = pull::Stream;
type Message = jetstream::Message;

/// What a dispatcher period works with.
pub(super) struct Active<'a, H> {
    pub cfg: &'a ConsumeConfig,
    pub js: &'a jetstream::Context,
    pub pool: &'a PgPool,
    pub stream: &'a jetstream::stream::Stream,
    pub dlq: &'a DeadLetters,
    pub handler: Arc<H>,
    pub readiness: &'a Readiness,
    /// This process's crew member id, which tags the lease it holds.
    pub me: i32,
    pub worker: &'a Arc<Worker>,
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

/// The pull stream is down; rebuild it at `at`, resetting first if `reset`.
struct Rebuild {
    at: Instant,
    reset: bool,
    tries: u32,
    /// When the reset was first asked for.
    since: Instant,
}

impl Rebuild {
    /// At once, from the ack floor: what was pulled comes again in order.
    fn from_ack_floor() -> Self {
        Rebuild {
            at: Instant::now(),
            reset: true,
            tries: 0,
            since: Instant::now(),
        }
    }

    /// Without a reset, after a pause.
    fn after(pause: Duration) -> Self {
        Rebuild {
            at: Instant::now() + pause,
            reset: false,
            tries: 0,
            since: Instant::now(),
        }
    }
}

impl<'a, H: Handler> Active<'a, H> {
    /// Dispatch until shutdown or the lease is lost.
    pub(super) async fn run(
        self,
        consumer: Consumer,
        lease: Lease,
        shutdown: &CancellationToken,
    ) -> Result<Ended> {
        // Taking over waits on the crew and on old pull requests: a lease
        // lost meanwhile ends it, or this process would reset the durable
        // under the next dispatcher.
        let lost = lease.lost();
        let mut dispatch = tokio::select! {
            opened = self.open(consumer, &lease, shutdown) => opened?,
            _ = lost.cancelled() => return Ok(Ended::LeaseLost),
            // A takeover may wait seconds for a silent process: a SIGTERM
            // meanwhile hands the lease on at once (it has started nothing).
            _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
        };
        let ended = dispatch.pump(&lease, shutdown).await;
        dispatch.drain(&ended, lease).await;
        tracing::info!("consumer stopped dispatching");
        Ok(ended)
    }

    /// Take over: what the crew runs for a previous dispatcher keeps its key
    /// busy, parked keys wait for their retry, and whatever a previous
    /// holder pulled and did not finish comes again, in stream order,
    /// before anything new.
    async fn open(
        self,
        mut consumer: Consumer,
        lease: &Lease,
        shutdown: &CancellationToken,
    ) -> Result<Dispatch<'a, H>> {
        let cfg = self.cfg;
        self.readiness
            .not_ready("taking over: resuming from the ack floor");
        // Whatever way this period ends, even before it starts pumping, its
        // view of the crew stops listening (and syncing) with it.
        let crew_stop = CancellationToken::new().drop_guard();
        let crew = Crew::start(
            self.js.client(),
            self.pool.clone(),
            &cfg.stream,
            &cfg.durable,
            self.me,
            self.worker.clone(),
            crew_stop.token().clone(),
        )
        .await?;
        let window = consumer.cached_info().config.max_ack_pending;
        let mut scheduler = Scheduler::new(cfg.concurrency, high_water(window));
        scheduler.set_parked_cap(cfg.max_parked_keys, PARKED_BYTES);
        let adopted = crew.adopt(self.pool, &cfg.stream, &cfg.durable).await?;
        for (_, running, _) in &adopted {
            scheduler.adopt(running.key.clone());
        }
        // Soonest due first, as many as memory holds; the rest wait in the
        // inbox (cold) and are loaded as room frees.
        let (heads, parked_total) =
            super::inbox::parked_heads(self.pool, &cfg.durable, &cfg.stream, cfg.max_parked_keys)
                .await
                .map_err(Error::pg("reading parked messages"))?;
        let now = Instant::now();
        let read = heads.len();
        for (key, seq, wait) in heads {
            scheduler.load_parked(key, seq, now + wait);
        }
        if parked_total > read as u64 {
            scheduler.inbox_holds_more();
        }
        // A previous dispatcher that froze or was cut off may still have
        // pull requests waiting at the server: what the reset delivers
        // again would go to them, and its later messages here, out of order.
        old_pulls_gone(&mut consumer).await;
        let resets = crate::nats::resets_consumers(&self.js.client());
        if !resets {
            tracing::warn!("nats-server is older than 2.14 (no consumer reset, ADR-60): what a previous dispatcher pulled and did not finish comes back after --ack-wait, behind later messages of its aggregate");
        }
        let rewound = match resets {
            true => reset_to_ack_floor(&mut consumer, "taking over").await,
            false => None,
        };
        match rewound {
            // Nothing held yet: the scheduler was just made.
            Some(from) => drop(scheduler.rewound(from, Instant::now())),
            // Parked heads wait for the reset: before it, a previous
            // dispatcher's unacked message of their key may come back.
            None if resets => drop(scheduler.rewound(0, Instant::now())),
            None => {}
        }
        let stop = shutdown.child_token();
        let shared = new_shared(
            cfg,
            self.pool,
            self.stream,
            self.dlq,
            self.handler.clone(),
            stop.clone(),
            delivery::Role::Dispatcher(lease.proof()),
            self.worker.member.load(Ordering::Relaxed),
        );
        // A reset that failed (an election, say) is tried again before
        // anything is pulled: pulling first would run later messages ahead
        // of the unacked ones the reset is to bring back.
        let (messages, rebuild) = if rewound.is_none() && resets {
            (None, Some(Rebuild::from_ack_floor()))
        } else {
            let messages = pull_stream(&consumer, cfg)
                .await
                .map_err(Error::nats("starting the pull subscription"))?;
            (Some(messages), None)
        };
        let watchdog = Watchdog::start(&consumer, self.js.client().statistics(), &stop);
        let mut dispatch = Dispatch {
            registry: self.worker.registry.clone(),
            fences: self.worker.fences.load(Ordering::Relaxed),
            active: self,
            consumer,
            crew,
            _crew_stop: crew_stop,
            scheduler,
            shared,
            stop,
            tasks: JoinSet::new(),
            local_running: Arc::new(AtomicUsize::new(0)),
            remote_running: Arc::new(AtomicUsize::new(0)),
            deferred: Vec::new(),
            messages,
            rebuild,
            resets,
            rebuild_pause: Backoff::jittered(MIN_REBUILD_PAUSE, MAX_RESUBSCRIBE_BACKOFF),
            watchdog,
            remote_jobs: metrics::gauge!(m::CONSUMER_REMOTE_JOBS),
            window,
            window_set: Instant::now(),
            resize: None,
            parked: metrics::gauge!(m::CONSUMER_PARKED_AGGREGATES),
            parked_total,
            reload: None,
            reloaded: Instant::now(),
        };
        let own = dispatch.active.worker.member.load(Ordering::Relaxed);
        for (member, running, end) in adopted {
            dispatch.await_adopted(running, end, member != own);
        }
        Ok(dispatch)
    }
}

/// Past half of the durable's window waiting in memory, busy keys spill
/// theirs to the inbox, so JetStream never holds back for them.
fn high_water(window: i64) -> usize {
    usize::try_from(window)
        .ok()
        .filter(|&m| m > 0)
        .map_or(10_000, |m| (m / 2).max(1))
}

/// About the memory parked keys may take, beside `--max-parked-keys`: long
/// aggregate keys reach it first.
const PARKED_BYTES: usize = 64 << 20;

/// Keys held in the inbox only are read back at least this often, memory
/// full or not (see [`Scheduler::make_room`]).
const RELOAD_AT_LEAST: Duration = Duration::from_secs(30);

/// The inbox's parked heads, read while some are held there only (see
/// [`Dispatch::reload_parked`]).
type ParkedHeads = std::result::Result<(Vec<(String, u64, Duration)>, u64), sqlx::Error>;

/// The dispatcher's state between its stages.
struct Dispatch<'a, H> {
    active: Active<'a, H>,
    consumer: Consumer,
    crew: Crew,
    _crew_stop: DropGuard,
    scheduler: Scheduler<Message, Instant>,
    shared: Arc<Shared<H>>,
    /// Cancels this period's jobs (a child of shutdown).
    stop: CancellationToken,
    tasks: JoinSet<JobEnd>,
    /// The jobs this process runs as dispatcher, for its crew beats.
    registry: Registry,
    /// [`Worker::fences`] when the period began.
    fences: u64,
    /// Deliveries and retries this process runs; past `--concurrency`,
    /// they go to the crew.
    local_running: Arc<AtomicUsize>,
    /// Jobs other processes run for this dispatcher (sent and accepted,
    /// or adopted from them), for `outbox_consumer_remote_jobs`. Spills
    /// and parks behind are tasks too, and run nowhere.
    remote_running: Arc<AtomicUsize>,
    /// What the scheduler let go while the proof had lapsed ([`Dispatch::start`]).
    deferred: Vec<(String, Job<Message>)>,
    messages: Option<Messages>,
    /// When the pull stream is down: when to rebuild it, the pause after
    /// that, and whether to reset to the ack floor first. Rebuilding is a
    /// branch of the pump, never a wait inside it: during an election
    /// JetStream requests wait out their timeout, and running jobs must
    /// still finish meanwhile.
    rebuild: Option<Rebuild>,
    rebuild_pause: Backoff,
    /// The server resets a consumer to its ack floor (nats-server 2.14+).
    resets: bool,
    /// What tells a pull stream that lost a delivery, or went quiet,
    /// without an error.
    watchdog: Watchdog,
    remote_jobs: metrics::Gauge,
    parked: metrics::Gauge,
    /// The durable's max_ack_pending as last set or read, when it was set,
    /// and a resize on its way (see [`Dispatch::resize_window`]).
    window: i64,
    window_set: Instant,
    resize: Option<tokio::task::JoinHandle<Option<i64>>>,
    /// Aggregates parked in all, as the inbox said when last read (memory
    /// may hold fewer).
    parked_total: u64,
    /// A reload of cold parked keys on its way: what [`Scheduler::cold`]
    /// said when it began, and the read.
    reload: Option<(u64, tokio::task::JoinHandle<ParkedHeads>)>,
    /// When a reload last began.
    reloaded: Instant,
}

impl<H: Handler> Dispatch<'_, H> {
    /// Until shutdown or a lost lease: each branch is one reason to wake.
    async fn pump(&mut self, lease: &Lease, shutdown: &CancellationToken) -> Ended {
        let cfg = self.active.cfg;
        tracing::info!(stream = %cfg.stream, durable = %cfg.durable, parked_aggregates = self.scheduler.parked_keys(), "consuming");
        self.active.readiness.ready();
        let mut crew_tick = tokio::time::interval(crew::BEAT);
        let mut progress =
            tokio::time::interval((cfg.ack_wait / 3).max(Duration::from_millis(100)));
        let mut health = tokio::time::interval(LEASE_POLL);
        let lease_lost = lease.lost();
        let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
        let mut quiet_check = tokio::time::interval(QUIET_PULL);
        loop {
            // Checked at every wake-up: a process that thaws after a freeze
            // runs a branch or two before its keeper hears the lease is gone,
            // and starts nothing meanwhile. A lapse may also be a slow ping
            // still on its way: waited for, it costs no takeover and reset.
            if !self.shared.proof.holds() {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ended::Shutdown,
                    _ = lease_lost.cancelled() => return Ended::LeaseLost,
                    regained = self.shared.proof.regained() => {
                        if !regained {
                            return Ended::LeaseLost;
                        }
                    }
                }
                let deferred = std::mem::take(&mut self.deferred);
                self.start(deferred);
            }
            let wake = self.scheduler.next_wake();
            let rebuild_at = self.rebuild.as_ref().map(|r| r.at);
            let pulling = self.messages.is_some() && self.scheduler.can_pull();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ended::Shutdown,
                _ = lease_lost.cancelled() => return Ended::LeaseLost,
                Some(done) = self.tasks.join_next() => self.job_ended(done),
                _ = crew_tick.tick() => {
                    if self.crew_beat() {
                        return Ended::LeaseLost;
                    }
                }
                _ = sleep_until(wake), if wake.is_some() => {
                    let jobs = self.scheduler.wake(Instant::now());
                    self.start(jobs);
                }
                _ = health.tick() => self.report_health(),
                _ = reconnect_check.tick() => self.check_reconnect(),
                _ = quiet_check.tick() => self.check_quiet(),
                _ = progress.tick() => {
                    // Waiting deliveries must not pass ack_wait, or they
                    // come back as duplicates out of order.
                    for msg in self.scheduler.waiting() {
                        let _ = msg.ack_with(AckKind::Progress).await;
                    }
                }
                _ = sleep_until(rebuild_at), if rebuild_at.is_some() => self.rebuild().await,
                next = next_message(&mut self.messages), if pulling => self.arrived(next),
            }
        }
    }

    /// Start what the scheduler let go: here while this process has room
    /// for it, else in another process of the crew (a refusal runs it here).
    fn start(&mut self, jobs: Vec<(String, Job<Message>)>) {
        let cfg = self.active.cfg;
        // No right to hand anything out or run it (a thawed process, a slow
        // lease ping): held until the pump's next turn, which starts them
        // once the proof is back, or ends the period (what was let go then
        // comes again through the next dispatcher's reset).
        if !self.shared.proof.holds() {
            self.deferred.extend(jobs);
            return;
        }
        for (key, job) in jobs {
            let id = crew::new_job_id();
            let retry = match &job {
                Job::Retry { seq } => Some(*seq),
                _ => None,
            };
            // Spills and parks behind are bookkeeping, never sent away; a
            // check may call the handler, as a delivery does.
            let counted = retry.is_some() || matches!(job, Job::Deliver(_) | Job::Check(_));
            let remote = if counted && self.local_running.load(Ordering::Relaxed) >= cfg.concurrency
            {
                self.crew.pick()
            } else {
                None
            };
            if counted && remote.is_none() {
                if !crew::register(&self.registry, self.crew.whoami(), id, &key, retry) {
                    // Replaced: the pump ends at the next crew beat, and
                    // the message, unacked, goes to the new dispatcher.
                    continue;
                }
                self.local_running.fetch_add(1, Ordering::Relaxed);
            }
            let shared = self.shared.clone();
            let crew = self.crew.clone();
            let local_running = self.local_running.clone();
            let remote_running = self.remote_running.clone();
            let registry = self.registry.clone();
            self.tasks.spawn(async move {
                if let Some(member) = remote {
                    match crew.send(member, id, &key, &job).await {
                        Sent::Accepted(end) => {
                            let (how, panicked) = {
                                let _elsewhere = Counted::on(&remote_running);
                                crew::await_end(&crew, &shared, &key, retry, end).await
                            };
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
                            if !crew::register(&registry, crew.whoami(), id, &key, retry) {
                                return JobEnd {
                                    id,
                                    key,
                                    how: Finished::Done,
                                    panicked: false,
                                    local: false,
                                };
                            }
                            local_running.fetch_add(1, Ordering::Relaxed);
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
    }

    /// A job the crew ran for a previous dispatcher: its key stays busy
    /// until its end comes.
    fn await_adopted(
        &mut self,
        running: crew::Running,
        end: tokio::sync::oneshot::Receiver<Option<(Finished<Instant>, bool)>>,
        elsewhere: bool,
    ) {
        let shared = self.shared.clone();
        let crew = self.crew.clone();
        let remote_running = self.remote_running.clone();
        self.tasks.spawn(async move {
            let _elsewhere = elsewhere.then(|| Counted::on(&remote_running));
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

    fn job_ended(&mut self, done: std::result::Result<JobEnd, JoinError>) {
        self.watchdog.settled();
        let Ok(JobEnd {
            id,
            key,
            how,
            panicked,
            local,
        }) = done
        else {
            return;
        };
        if local {
            crew::roster(&self.registry).jobs.remove(&id);
        }
        if panicked {
            // Before the key's lane goes on: what waits behind the lost
            // message comes back with it, after it, through the reset.
            self.resume_from_ack_floor();
        }
        let jobs = self.scheduler.finish(&key, how, Instant::now());
        self.start(jobs);
    }

    /// Forget what waits and pull again from the ack floor: JetStream
    /// delivers it again, in stream order.
    fn resume_from_ack_floor(&mut self) {
        drop(self.scheduler.take_waiting());
        // Parked heads wait for the pull to come back to them from now on,
        // not from when the reset goes through: a lost job's key goes on
        // with its next parked message at once, which would otherwise run
        // before the lost one comes back.
        drop(self.scheduler.rewound(0, Instant::now()));
        self.watchdog.rewound();
        self.messages = None;
        self.rebuild = Some(Rebuild::from_ack_floor());
    }

    /// Every crew beat: the crew's room joins the scheduler's, and readiness
    /// says who runs what. True when another dispatcher has synced this
    /// process: the lease is gone even if its connection has not said so.
    fn crew_beat(&mut self) -> bool {
        let cfg = self.active.cfg;
        let (me, period) = self.crew.whoami();
        if crew::roster(&self.registry).replaced(me, period) {
            tracing::warn!("another process took over as dispatcher");
            return true;
        }
        if self.cut_off() {
            tracing::warn!("this process was cut off from the crew (its member lock, or NATS): giving the lease up so that another process takes over");
            return true;
        }
        let jobs = self
            .scheduler
            .set_concurrency(cfg.concurrency + self.crew.capacity(), Instant::now());
        self.start(jobs);
        self.resize_window();
        let local = self.local_running.load(Ordering::Relaxed);
        let remote = self.remote_running.load(Ordering::Relaxed);
        self.remote_jobs.set(remote as f64);
        self.active.readiness.note(format!(
            "dispatching durable {} for {} process(es): {local} job(s) running here, {remote} in the other processes",
            cfg.durable,
            self.crew.helpers() + 1,
        ));
        false
    }

    /// While parked keys wait in the inbox only, load them back, soonest
    /// due first, once memory has room for a tenth of its bound (or has
    /// nothing left to retry). One read at a time, off the pump.
    fn reload_parked(&mut self) {
        use futures::FutureExt;
        let cfg = self.active.cfg;
        if let Some((cold, read)) = self.reload.as_mut() {
            if !read.is_finished() {
                return;
            }
            let cold = *cold;
            match read.now_or_never() {
                Some(Ok(Ok((heads, total)))) => {
                    let now = Instant::now();
                    let read = heads.len();
                    let mut started = Vec::new();
                    let mut all = true;
                    for (key, seq, wait) in heads {
                        all &= self.scheduler.reload_parked(key, seq, now + wait);
                    }
                    self.scheduler.refilled(cold, all && total <= read as u64);
                    self.parked_total = total;
                    started.extend(self.scheduler.wake(now));
                    self.start(started);
                }
                Some(Ok(Err(e))) => {
                    tracing::warn!(error = %e, "cannot read parked messages back; retrying")
                }
                _ => {}
            }
            self.reload = None;
        }
        if self.scheduler.cold().is_none() {
            return;
        }
        let tenth = (cfg.max_parked_keys / 10).max(1);
        if self.scheduler.parked_room() < tenth && self.reloaded.elapsed() > RELOAD_AT_LEAST {
            // Memory stays full of keys that keep failing: those due last
            // make room for the inbox's sooner ones.
            self.scheduler.make_room(tenth);
        }
        let Some(cold) = self.scheduler.cold() else {
            return;
        };
        let room = self.scheduler.parked_room();
        let idle = self.scheduler.next_wake().is_none();
        if room == 0 || (room < tenth && !idle) {
            return;
        }
        self.reloaded = Instant::now();
        // Keys held already come back too: read past them.
        let limit = room.saturating_add(self.scheduler.parked_keys());
        let (pool, durable, stream) = (
            self.active.pool.clone(),
            cfg.durable.clone(),
            cfg.stream.clone(),
        );
        self.reload = Some((
            cold,
            tokio::spawn(async move {
                super::inbox::parked_heads(&pool, &durable, &stream, limit).await
            }),
        ));
    }

    /// The durable's window follows the crew (`window`): resized when the
    /// processes this dispatcher hears change, and again when the server
    /// holds another (a process that joined created the durable with its
    /// own). One resize at a time, off the pump.
    fn resize_window(&mut self) {
        use futures::FutureExt;
        let cfg = self.active.cfg;
        if let Some(resize) = self.resize.as_mut() {
            if !resize.is_finished() {
                return;
            }
            if let Some(Ok(Some(w))) = resize.now_or_never() {
                self.window = w;
                self.window_set = Instant::now();
                self.scheduler.set_high_water(high_water(w));
            }
            self.resize = None;
        }
        if let Some(d) = self
            .watchdog
            .durable()
            .filter(|d| d.asked > self.window_set + ACK_LANDS)
        {
            self.window = d.limit;
        }
        let want = window(cfg.max_ack_pending, self.crew.helpers() + 1);
        if want == self.window {
            return;
        }
        let stream = self.active.stream.clone();
        let mut config = durable_config(cfg, want);
        let durable = cfg.durable.clone();
        self.resize = Some(tokio::spawn(async move {
            // A durable `consumer reset` made again at a sequence (a server
            // before ADR-60) keeps that start: a deliver policy cannot be
            // updated.
            if let Ok(Ok(info)) =
                tokio::time::timeout(JS_REQUEST, stream.consumer_info(&durable)).await
            {
                config.deliver_policy = info.config.deliver_policy;
            }
            match tokio::time::timeout(JS_REQUEST, stream.update_consumer(config)).await {
                Ok(Ok(_)) => {
                    tracing::info!(
                        max_ack_pending = want,
                        "sized the durable's ack-pending window for the crew"
                    );
                    Some(want)
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot size the durable's ack-pending window; retrying");
                    None
                }
                Err(_) => None,
            }
        }));
    }

    /// This process was cut off from the crew since the period began, and
    /// another process could take over and run its jobs. Alone, it keeps
    /// the lease (nobody else could run them).
    fn cut_off(&self) -> bool {
        let worker = self.active.worker;
        worker.fences.load(Ordering::Relaxed) != self.fences
            && worker.processes.load(Ordering::Relaxed) > 1
    }

    fn report_health(&mut self) {
        self.reload_parked();
        let held = self.scheduler.parked_keys() as u64;
        let parked = match self.scheduler.cold() {
            Some(_) => held.max(self.parked_total),
            None => held,
        };
        self.parked.set(parked as f64);
        // Its own jobs' and those it runs for the crew (a process is a
        // helper of its own dispatcher too).
        let failing = self.shared.dlq_failing.load(Ordering::Relaxed)
            + self.active.worker.dlq_failing.load(Ordering::Relaxed);
        metrics::gauge!(m::CONSUMER_DLQ_FAILING).set(failing as f64);
        if failing > 0 {
            self.active.readiness.not_ready(format!(
                "{failing} dead letter(s) not stored yet: the dead-letter stream refuses them; retrying"
            ));
        } else {
            self.active.readiness.ready();
        }
    }

    fn check_reconnect(&mut self) {
        if self.watchdog.reconnected() {
            tracing::info!("NATS reconnected; renewing the pull subscription");
            self.messages = None;
            self.rebuild.get_or_insert(Rebuild::after(Duration::ZERO));
        }
    }

    /// A parked head held back for a pull that never comes, a pull stream
    /// quiet while messages are pending, deliveries the server counts that
    /// never arrived.
    fn check_quiet(&mut self) {
        // Not while the reset that will bring held heads' elders back is
        // still to go through: they are unacked, not pending.
        let resetting = self.rebuild.as_ref().is_some_and(|r| r.reset);
        if self.scheduler.holds_back() && !resetting && self.watchdog.held_head_left() {
            let jobs = self.scheduler.release(Instant::now());
            self.start(jobs);
        }
        let pulling = self.messages.is_some() && self.scheduler.can_pull();
        if let Some(why) = self
            .watchdog
            .lost(pulling, self.scheduler.holds_no_delivery())
        {
            tracing::warn!(quiet = ?self.watchdog.quiet_for(), "{why}; resuming from the ack floor");
            self.resume_from_ack_floor();
            self.watchdog.heard();
        }
    }

    /// The pull stream is due to be rebuilt (after a reset, if asked).
    async fn rebuild(&mut self) {
        let Some(mut r) = self.rebuild.take() else {
            return;
        };
        if r.reset {
            // Tried until it works, nothing pulled meanwhile: pulling first
            // would run later messages ahead of what it brings back. Once
            // ack_wait has passed, every delivery it was to bring back waits
            // for redelivery, which JetStream serves before anything new:
            // pulling is then safe without it.
            let waited_out = r.since.elapsed() >= self.active.cfg.ack_wait;
            if waited_out && self.resets {
                tracing::warn!(tries = r.tries, "no reset to the ack floor within ack_wait; pulling without it (JetStream delivers the unacked messages again first)");
            }
            if self.resets && !waited_out {
                r.tries += 1;
                let Some(from) = reset_to_ack_floor(&mut self.consumer, "lost delivery").await
                else {
                    r.at = Instant::now() + self.rebuild_pause.next_pause();
                    self.rebuild = Some(r);
                    return;
                };
                if r.tries > 1 {
                    tracing::info!(tries = r.tries, "the reset to the ack floor went through");
                }
                let jobs = self.scheduler.rewound(from, Instant::now());
                self.watchdog.rewound();
                self.start(jobs);
            }
            // Numbering starts over either way, or the next delivery would
            // look like another gap.
            self.watchdog.renumbered();
        }
        match tokio::time::timeout(JS_REQUEST, pull_stream(&self.consumer, self.active.cfg)).await {
            Ok(Ok(m)) => self.messages = Some(m),
            result => {
                let error = match result {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_owned(),
                };
                let pause = self.rebuild_pause.next_pause();
                tracing::warn!(error, retry_in = ?pause, "cannot restart the pull subscription");
                r.at = Instant::now() + pause;
                r.reset = false;
                self.rebuild = Some(r);
            }
        }
    }

    /// The pull stream gave a message, or failed.
    fn arrived(&mut self, next: Option<std::result::Result<Message, pull::MessagesError>>) {
        let msg = match next {
            Some(Ok(m)) => m,
            failed => {
                // Missed heartbeats, no responders: the pull request is gone
                // with a consumer leader. A new subscription asks the
                // current one, after a pause that grows while the stream
                // keeps failing at once.
                let pause = self.rebuild_pause.next_pause();
                match failed {
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, retry_in = ?pause, "pull stream error; renewing the pull subscription")
                    }
                    _ => {
                        tracing::debug!(retry_in = ?pause, "pull stream ended; renewing the pull subscription")
                    }
                }
                self.messages = None;
                self.rebuild = Some(Rebuild::after(pause));
                return;
            }
        };
        self.rebuild_pause.reset();
        let (delivery, stream_seq) = msg
            .info()
            .map(|i| (i.consumer_sequence, Some(i.stream_sequence)))
            .unwrap_or((0, None));
        if let Err(last) = self.watchdog.arrived(delivery) {
            tracing::warn!(
                last,
                now = delivery,
                "a delivery was lost on the way; resuming from the ack floor"
            );
            // What waits is delivered again by the reset.
            drop(msg);
            self.resume_from_ack_floor();
            return;
        }
        if let Some(seq) = stream_seq {
            let jobs = self.scheduler.passed(seq, Instant::now());
            self.start(jobs);
        }
        let key = aggregate_key(&msg);
        let jobs = self.scheduler.arrive(key, msg, Instant::now());
        self.start(jobs);
    }

    /// No more pulls, and the lease handed over (or lost). At shutdown what
    /// waits is NAKed so the next dispatcher gets it at once; with the lease
    /// lost it comes again through the next dispatcher's reset (a NAK from a
    /// process that thawed after a freeze would only send it a copy).
    ///
    /// Running jobs are not aborted: a job past its handler call records its
    /// outcome, and one whose call is in flight finishes it, while the next
    /// dispatcher (this process's next period, or another process) adopts
    /// them from this process's roster and waits for their ends; a job that
    /// has not called its handler yet calls nothing (the lease's proof is
    /// gone) and is handled as lost. At shutdown this process waits for them
    /// (bounded by the shutdown timeout); with the lease lost they finish in
    /// the background while this process asks for the lease again.
    async fn drain(mut self, ended: &Ended, lease: Lease) {
        let cfg = self.active.cfg;
        self.messages = None;
        let waiting = self.scheduler.take_waiting();
        if matches!(ended, Ended::Shutdown) {
            for msg in waiting {
                let _ = msg.ack_with(AckKind::Nak(None)).await;
            }
            self.active.readiness.not_ready("shutting down");
        }
        self.watchdog.stop();
        // What this process reports of the period is no longer true: a
        // standby holds no parked aggregate and no dead letter, and the
        // autoscaler takes the largest figure of any process.
        self.remote_jobs.set(0.0);
        self.parked.set(0.0);
        metrics::gauge!(m::CONSUMER_DLQ_FAILING).set(0.0);
        self.crew.hand_over();
        drop(lease);
        let ours = crew::roster(&self.registry)
            .jobs
            .values()
            .filter(|j| j.mine)
            .map(|j| j.id)
            .collect();
        let finishing = Finishing {
            tasks: std::mem::take(&mut self.tasks),
            shared: self.shared.clone(),
            stop: self.stop.clone(),
            registry: self.registry.clone(),
            worker: self.active.worker.clone(),
            fences: self.fences,
            client: self.active.js.client(),
            stream: cfg.stream.clone(),
            durable: cfg.durable.clone(),
            ours,
            // A lost lease sets no deadline: a job past its call waits for
            // Postgres to record its outcome, however long that takes
            // (dropped, the call that succeeded would be made again).
            deadline: matches!(ended, Ended::Shutdown)
                .then(|| Instant::now() + cfg.shutdown_timeout),
        };
        match ended {
            Ended::Shutdown => finishing.run().await,
            Ended::LeaseLost => {
                tokio::spawn(finishing.run());
            }
        }
    }
}

/// The jobs a dispatcher period leaves running when it ends.
struct Finishing<H> {
    tasks: JoinSet<JobEnd>,
    shared: Arc<Shared<H>>,
    stop: CancellationToken,
    registry: Registry,
    worker: Arc<Worker>,
    /// [`Worker::fences`] when the period began.
    fences: u64,
    client: async_nats::Client,
    stream: String,
    durable: String,
    /// The period's own jobs in the roster when it ended.
    ours: std::collections::HashSet<u64>,
    /// At shutdown, when what still runs is stopped.
    deadline: Option<Instant>,
}

impl<H: Handler> Finishing<H> {
    /// Report each job's end as it comes. Cut off from the crew while
    /// others could take over, nobody can adopt them: calls in flight are
    /// cut (a job past its call still records its outcome). Alone, nothing
    /// is cut: no other process could run them, and this one adopts them
    /// when it dispatches again. Past the shutdown deadline, what runs is
    /// stopped.
    async fn run(mut self) {
        let mut cut = false;
        while !self.tasks.is_empty() {
            if !cut
                && self.worker.fences.load(Ordering::Relaxed) != self.fences
                && self.worker.processes.load(Ordering::Relaxed) > 1
            {
                tracing::warn!("cut off from the crew while finishing: cutting this process's calls in flight, which the next dispatcher makes again");
                self.shared.calls.cut();
                cut = true;
            }
            let mut step = Instant::now() + crew::BEAT;
            if let Some(deadline) = self.deadline {
                step = step.min(deadline);
            }
            let past_deadline = || self.deadline.is_some_and(|d| Instant::now() >= d);
            match tokio::time::timeout_at(step.into(), self.tasks.join_next()).await {
                Ok(Some(Ok(end))) => {
                    if end.local {
                        crew::report(
                            &self.client,
                            &self.stream,
                            &self.durable,
                            end.id,
                            end.how,
                            end.panicked,
                        )
                        .await;
                        crew::roster(&self.registry).jobs.remove(&end.id);
                    }
                }
                Ok(Some(Err(_))) => {}
                Ok(None) => break,
                Err(_) if !past_deadline() => {}
                Err(_) => {
                    tracing::warn!(
                        running = self.tasks.len(),
                        "shutdown timeout: unfinished deliveries will be redelivered"
                    );
                    // Stopped first, unlisted after: an unlisted job is run
                    // again by the next dispatcher.
                    self.stop.cancel();
                    self.tasks.abort_all();
                    while self.tasks.join_next().await.is_some() {}
                    crew::roster(&self.registry)
                        .jobs
                        .retain(|id, _| !self.ours.contains(id));
                    break;
                }
            }
        }
    }
}

/// Wait until no pull request waits at the durable (they expire within
/// [`PULL_EXPIRES`]; one whose subscriber is gone goes sooner).
async fn old_pulls_gone(consumer: &mut Consumer) {
    let deadline = Instant::now() + PULL_EXPIRES + Duration::from_millis(500);
    loop {
        let waiting = match tokio::time::timeout(JS_REQUEST, consumer.info()).await {
            Ok(Ok(info)) => info.num_waiting,
            _ => 1,
        };
        if waiting == 0 {
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                waiting,
                "pull requests of a previous dispatcher still wait at the durable; taking over regardless"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn sleep_until(at: Option<Instant>) {
    tokio::time::sleep_until(at.unwrap_or_else(Instant::now).into()).await
}

/// Put the consumer back at its ack floor (ADR-60, nats-server 2.14+): every
/// unacked message is delivered again, in stream order, at once. The stream
/// sequence JetStream delivers again from, once reset (within
/// [`JS_REQUEST`]).
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

async fn next_message(
    messages: &mut Option<Messages>,
) -> Option<std::result::Result<Message, pull::MessagesError>> {
    match messages {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

/// The pull subscription, built the same way at start and on every rebuild.
async fn pull_stream(
    consumer: &Consumer,
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

fn aggregate_key(msg: &Message) -> String {
    order_key(
        delivery::header(msg, &delivery::names::AGGREGATE_ID).as_deref(),
        msg.subject.as_str(),
    )
}

/// Messages of one aggregate are ordered (SPEC §6); a message without
/// `Outbox-Aggregate-Id` (from an outbox table with no aggregate role,
/// SPEC §13) is ordered with the others of its subject.
fn order_key(aggregate: Option<&str>, subject: &str) -> String {
    match aggregate {
        Some(a) => format!("a:{a}"),
        None => format!("s:{subject}"),
    }
}

/// One in `count` while it lives (a task aborted with its period counts
/// down too).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn on(count: &Arc<AtomicUsize>) -> Counted {
        count.fetch_add(1, Ordering::Relaxed);
        Counted(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::order_key;

    #[test]
    fn the_order_key_is_the_aggregate_else_the_subject() {
        assert_eq!(order_key(Some("o-1"), "a.b"), "a:o-1");
        assert_eq!(order_key(None, "a.b"), order_key(None, "a.b"));
        assert_ne!(order_key(None, "a.b"), order_key(None, "a.c"));
        // An aggregate named like a subject is still another key.
        assert_ne!(order_key(Some("a.b"), "x"), order_key(None, "a.b"));
    }
}
