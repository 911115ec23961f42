//! The crew: every process of one durable works (SPEC §11).
//!
//! Per-aggregate order needs one place that sees a durable's messages in
//! stream order, so one process of the crew, the **dispatcher** (it holds the
//! [`lease`](super::lease)), pulls and schedules exactly as a lone process
//! does. What it cannot run itself (its own `--concurrency` is busy) it hands,
//! job by job, to another process of the crew with room. A job is the unit
//! the scheduler runs anyway (a delivery, or a parked message's retry) and
//! runs there through the same code, `delivery::run_job`: claim, handler,
//! inbox, ack. The helper acks the JetStream message itself: an ack is a
//! publish to the message's reply subject, from any connection. The key
//! stays busy in the dispatcher's scheduler until the helper says how the
//! job ended, so order, no overlap and no head-of-line blocking are the
//! scheduler's, unchanged.
//!
//! Who is alive is Postgres's word: each process holds a session advisory
//! lock (its member lock) for as long as it lives, and a kill -9 closes that
//! connection and frees it at once. Every process says every [`BEAT`] what it
//! runs. A job is lost when its helper's lock is gone, when its helper stops
//! listing it without having reported it, or when its helper is silent for
//! [`SILENT`]; the dispatcher then treats it as a job that panicked here:
//! what the inbox holds decides, and a reset to the ack floor brings back an
//! unacked message, in order.
//!
//! Taking over, a dispatcher first hears every live process once and adopts
//! the jobs they run (their keys stay busy until each reports), then resets
//! to the ack floor: a message JetStream delivers again while a helper still
//! runs it waits behind it, and the inbox answers it as a duplicate.
//!
//! Subjects (core NATS, outside any stream): `_OUTBOX_CREW.{stream}.{durable}`
//! `.s.hello` and `.s.done` (one subscription, so a job's end is never read
//! after a beat that no longer lists it), and `.job.{member}` (requests).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::delivery::{self, Shared};
use super::handler::Handler;
use super::scheduler::{Finished, Job};
use crate::error::{Error, Result};
use crate::ops::endpoint::Readiness;
use crate::ops::metrics as m;

/// How often every process says what it runs.
pub(super) const BEAT: Duration = Duration::from_millis(250);
/// A helper that says nothing for this long has lost its jobs.
const SILENT: Duration = Duration::from_secs(5);
/// How long a new dispatcher waits to hear every live process.
const ADOPT_WAIT: Duration = Duration::from_millis(1500);
/// How long a helper may take to accept a job.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the dispatcher asks Postgres who is alive.
const LIVENESS: Duration = Duration::from_millis(500);

fn lock_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay crew {stream}/{durable}")
}

fn base(stream: &str, durable: &str) -> String {
    format!("{}.{stream}.{durable}", crate::wire::CREW_PREFIX)
}

/// This process's place in the crew: a session advisory lock that lives as
/// long as its connection.
pub(super) struct Member {
    conn: PgConnection,
    pub id: i32,
}

impl Member {
    pub async fn join(pool: &PgPool, stream: &str, durable: &str) -> Result<Member> {
        let mut conn = pool
            .acquire()
            .await
            .map_err(Error::pg("connecting for the crew membership"))?
            .detach();
        let name = lock_name(stream, durable);
        loop {
            // Positive, so pg_locks shows it as written.
            let id = (uuid::Uuid::new_v4().as_u128() as u32 >> 1) as i32;
            if id == 0 {
                continue;
            }
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1), $2)")
                .bind(&name)
                .bind(id)
                .fetch_one(&mut conn)
                .await
                .map_err(Error::pg("pg_try_advisory_lock"))?;
            if got {
                return Ok(Member { conn, id });
            }
        }
    }

    pub async fn held(&mut self) -> bool {
        self.conn.ping().await.is_ok()
    }
}

/// The members alive now (their lock is held), this one included.
pub(super) async fn alive(
    pool: &PgPool,
    stream: &str,
    durable: &str,
) -> sqlx::Result<HashSet<i32>> {
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT objid::text::bigint FROM pg_locks \
         WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND classid = hashtext($1)::oid",
    )
    .bind(lock_name(stream, durable))
    .fetch_all(pool)
    .await?;
    Ok(ids
        .into_iter()
        .filter_map(|i| i32::try_from(i).ok())
        .collect())
}

/// A job as a process reports it while it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Running {
    pub id: u64,
    pub key: String,
    /// The parked message's sequence, for a retry; none for a delivery.
    #[serde(default)]
    pub retry: Option<u64>,
    /// Run by this process as dispatcher (not sent to it).
    #[serde(skip)]
    pub mine: bool,
}

/// The jobs this process runs (dispatched here, or its own as dispatcher).
pub(super) type Registry = Arc<Mutex<HashMap<u64, Running>>>;

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    member: i32,
    capacity: usize,
    leaving: bool,
    beat: u64,
    running: Vec<Running>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Done {
    id: u64,
    how: Ended,
    panicked: bool,
}

/// [`Finished`] on the wire: a due time travels as a delay.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "t", rename_all = "snake_case")]
enum Ended {
    Done,
    Parked { seq: u64, due_ms: u64 },
    Retried { next: Option<u64> },
    Spilled { seq: Option<u64> },
}

impl Ended {
    fn from(how: Finished<Instant>) -> Self {
        match how {
            Finished::Done => Ended::Done,
            Finished::Parked { seq, due } => Ended::Parked {
                seq,
                due_ms: due.saturating_duration_since(Instant::now()).as_millis() as u64,
            },
            Finished::Retried { next } => Ended::Retried { next },
            Finished::Spilled { seq } => Ended::Spilled { seq },
        }
    }

    fn into_finished(self) -> Finished<Instant> {
        match self {
            Ended::Done => Finished::Done,
            Ended::Parked { seq, due_ms } => Finished::Parked {
                seq,
                due: Instant::now() + Duration::from_millis(due_ms),
            },
            Ended::Retried { next } => Finished::Retried { next },
            Ended::Spilled { seq } => Finished::Spilled { seq },
        }
    }
}

/// What travels ahead of a job's message body.
#[derive(Debug, Serialize, Deserialize)]
struct JobHead {
    id: u64,
    key: String,
    #[serde(default)]
    retry: Option<u64>,
    #[serde(default)]
    subject: String,
    #[serde(default)]
    reply: Option<String>,
}

/// A job id unique across the crew: a random base drawn once per process,
/// then a counter. Not a random per job: that was a `getrandom` system call
/// on every delivery (seen in the consumer's profile).
pub(super) fn new_job_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static BASE: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| uuid::Uuid::new_v4().as_u128() as u64);
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Tell the dispatcher how a job ended (a process that ran it, or that ran
/// it as dispatcher and handed the lease on meanwhile).
pub(super) async fn report(
    client: &async_nats::Client,
    stream: &str,
    durable: &str,
    id: u64,
    how: Finished<Instant>,
    panicked: bool,
) {
    let done = Done {
        id,
        how: Ended::from(how),
        panicked,
    };
    if let Ok(body) = serde_json::to_vec(&done) {
        let _ = client
            .publish(format!("{}.s.done", base(stream, durable)), body.into())
            .await;
    }
}

// ---------------------------------------------------------------- dispatcher

/// How a job handed to a helper came back.
pub(super) enum Sent {
    /// Accepted: its end comes through the receiver (`None`: lost).
    Accepted(oneshot::Receiver<Option<(Finished<Instant>, bool)>>),
    /// Refused (no room, no such process): run it here.
    Refused,
}

struct Helper {
    capacity: usize,
    leaving: bool,
    beat: u64,
    heard: Instant,
    running: Vec<Running>,
}

struct Waiter {
    member: i32,
    /// Beats after this one must list the job while it runs.
    since_beat: u64,
    tx: oneshot::Sender<Option<(Finished<Instant>, bool)>>,
}

#[derive(Default)]
struct State {
    helpers: HashMap<i32, Helper>,
    alive: HashSet<i32>,
    reserved: HashMap<i32, usize>,
    waiting: HashMap<u64, Waiter>,
}

impl State {
    fn fail_where(&mut self, lost: impl Fn(u64, &Waiter) -> bool) {
        let ids: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(id, w)| lost(**id, w))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(w) = self.waiting.remove(&id) {
                tracing::warn!(job = id, member = w.member, "a job another process ran is lost; the inbox decides, and JetStream delivers it again if unacked");
                let _ = w.tx.send(None);
            }
        }
    }
}

/// The dispatcher's view of the crew, for one period as dispatcher.
#[derive(Clone)]
pub(super) struct Crew {
    inner: Arc<CrewInner>,
}

struct CrewInner {
    client: async_nats::Client,
    base: String,
    me: i32,
    state: Mutex<State>,
    /// Set on hand-over: waiting on other processes' jobs stops (the next
    /// dispatcher adopts them).
    handover: CancellationToken,
}

impl Crew {
    /// Listen to the crew until `stop`.
    pub async fn start(
        client: async_nats::Client,
        pool: PgPool,
        stream: &str,
        durable: &str,
        me: i32,
        stop: CancellationToken,
    ) -> Result<Crew> {
        let base = base(stream, durable);
        let sub = client
            .subscribe(format!("{base}.s.*"))
            .await
            .map_err(Error::nats("subscribing to the crew"))?;
        let crew = Crew {
            inner: Arc::new(CrewInner {
                client,
                base,
                me,
                state: Mutex::new(State::default()),
                handover: CancellationToken::new(),
            }),
        };
        tokio::spawn(
            crew.clone()
                .listen(sub, pool, stream.to_owned(), durable.to_owned(), stop),
        );
        Ok(crew)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn listen(
        self,
        mut sub: async_nats::Subscriber,
        pool: PgPool,
        stream: String,
        durable: String,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(LIVENESS);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                msg = sub.next() => {
                    let Some(msg) = msg else { break };
                    if msg.subject.ends_with(".hello") {
                        if let Ok(h) = serde_json::from_slice::<Hello>(&msg.payload) {
                            self.heard(h);
                        }
                    } else if let Ok(d) = serde_json::from_slice::<Done>(&msg.payload) {
                        if let Some(w) = self.state().waiting.remove(&d.id) {
                            let _ = w.tx.send(Some((d.how.into_finished(), d.panicked)));
                        }
                    }
                }
                _ = tick.tick() => {
                    let Ok(Ok(alive)) = tokio::time::timeout(LIVENESS, alive(&pool, &stream, &durable)).await else {
                        continue;
                    };
                    let mut s = self.state();
                    s.helpers.retain(|id, h| alive.contains(id) && h.heard.elapsed() < SILENT);
                    let helpers: HashSet<i32> = s.helpers.keys().copied().collect();
                    s.alive = alive;
                    let me = self.inner.me;
                    s.fail_where(|_, w| w.member != me && !helpers.contains(&w.member));
                }
            }
        }
        // The period ended: nobody waits for these any more.
        self.state().waiting.clear();
    }

    fn heard(&self, h: Hello) {
        let mut s = self.state();
        let listed: HashSet<u64> = h.running.iter().map(|r| r.id).collect();
        let (member, beat) = (h.member, h.beat);
        s.fail_where(|id, w| w.member == member && beat > w.since_beat && !listed.contains(&id));
        s.helpers.insert(
            h.member,
            Helper {
                capacity: h.capacity,
                leaving: h.leaving,
                beat: h.beat,
                heard: Instant::now(),
                running: h.running,
            },
        );
    }

    fn pickable(&self, s: &State, id: i32, h: &Helper) -> bool {
        id != self.inner.me && !h.leaving && s.alive.contains(&id) && h.heard.elapsed() < SILENT
    }

    /// Jobs the other processes can take at once.
    pub fn capacity(&self) -> usize {
        let s = self.state();
        s.helpers
            .iter()
            .filter(|(id, h)| self.pickable(&s, **id, h))
            .map(|(_, h)| h.capacity)
            .sum()
    }

    /// Other live processes of the crew.
    pub fn helpers(&self) -> usize {
        let s = self.state();
        s.helpers
            .iter()
            .filter(|(id, h)| self.pickable(&s, **id, h))
            .count()
    }

    /// The helper with the most room, which keeps a place for the job.
    pub fn pick(&self) -> Option<i32> {
        let mut s = self.state();
        let best = s
            .helpers
            .iter()
            .filter(|(id, h)| self.pickable(&s, **id, h))
            .map(|(id, h)| {
                (
                    *id,
                    h.capacity.saturating_sub(*s.reserved.get(id).unwrap_or(&0)),
                )
            })
            .filter(|(_, free)| *free > 0)
            .max_by_key(|(_, free)| *free)
            .map(|(id, _)| id)?;
        *s.reserved.entry(best).or_default() += 1;
        Some(best)
    }

    /// The job's place at `member` is free again.
    pub fn unreserve(&self, member: i32) {
        let mut s = self.state();
        if let Some(n) = s.reserved.get_mut(&member) {
            *n = n.saturating_sub(1);
        }
    }

    /// Hand `job` to `member`.
    pub async fn send(
        &self,
        member: i32,
        id: u64,
        key: &str,
        job: &Job<jetstream::Message>,
    ) -> Sent {
        let (head, headers, body) = match job {
            Job::Deliver(msg) => (
                JobHead {
                    id,
                    key: key.to_owned(),
                    retry: None,
                    subject: msg.subject.to_string(),
                    reply: msg.reply.as_ref().map(|r| r.to_string()),
                },
                msg.headers.clone(),
                msg.payload.clone(),
            ),
            Job::Retry { seq } => (
                JobHead {
                    id,
                    key: key.to_owned(),
                    retry: Some(*seq),
                    subject: String::new(),
                    reply: None,
                },
                None,
                Bytes::new(),
            ),
            _ => return Sent::Refused,
        };
        let Ok(mut payload) = serde_json::to_vec(&head) else {
            return Sent::Refused;
        };
        payload.push(b'\n');
        payload.extend_from_slice(&body);
        let (tx, rx) = oneshot::channel();
        // Waiting before asking: its end may come before the answer does.
        let known_beat = {
            let mut s = self.state();
            let beat = s.helpers.get(&member).map_or(0, |h| h.beat);
            s.waiting.insert(
                id,
                Waiter {
                    member,
                    since_beat: u64::MAX,
                    tx,
                },
            );
            beat
        };
        let subject = format!("{}.job.{member}", self.inner.base);
        let request = async {
            match headers {
                Some(h) => {
                    self.inner
                        .client
                        .request_with_headers(subject, h, payload.into())
                        .await
                }
                None => self.inner.client.request(subject, payload.into()).await,
            }
        };
        let answer = tokio::time::timeout(SEND_TIMEOUT, request).await;
        let mut s = self.state();
        match answer {
            Ok(Ok(reply)) => {
                let text = String::from_utf8_lossy(&reply.payload);
                if let Some(beat) = text.strip_prefix("ok ").and_then(|b| b.trim().parse().ok()) {
                    if let Some(w) = s.waiting.get_mut(&id) {
                        w.since_beat = beat;
                    }
                    return Sent::Accepted(rx);
                }
                s.waiting.remove(&id);
                Sent::Refused
            }
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                s.waiting.remove(&id);
                Sent::Refused
            }
            // It may have been accepted: its beats tell.
            _ => {
                if let Some(w) = s.waiting.get_mut(&id) {
                    w.since_beat = known_beat;
                }
                Sent::Accepted(rx)
            }
        }
    }

    /// Wait (bounded) to hear every live process once, then take on the jobs
    /// they run. Each comes with the receiver its end arrives on.
    pub async fn adopt(
        &self,
        pool: &PgPool,
        stream: &str,
        durable: &str,
    ) -> Vec<(
        Running,
        oneshot::Receiver<Option<(Finished<Instant>, bool)>>,
    )> {
        let started = Instant::now();
        let deadline = started + ADOPT_WAIT;
        loop {
            let live = tokio::time::timeout(LIVENESS, alive(pool, stream, durable))
                .await
                .ok()
                .and_then(|r| r.ok());
            if let Some(live) = &live {
                let s = self.state();
                let all_heard = live
                    .iter()
                    .all(|id| s.helpers.get(id).is_some_and(|h| h.heard > started));
                if all_heard {
                    break;
                }
            }
            if Instant::now() >= deadline {
                tracing::warn!("not every process of the crew answered in time; taking over with what was heard");
                break;
            }
            tokio::time::sleep(BEAT / 5).await;
        }
        let mut s = self.state();
        let mut adopted = Vec::new();
        let jobs: Vec<(i32, u64, Running)> = s
            .helpers
            .iter()
            .flat_map(|(id, h)| h.running.iter().map(move |r| (*id, h.beat, r.clone())))
            .collect();
        for (member, beat, running) in jobs {
            let (tx, rx) = oneshot::channel();
            s.waiting.insert(
                running.id,
                Waiter {
                    member,
                    since_beat: beat,
                    tx,
                },
            );
            adopted.push((running, rx));
        }
        adopted
    }

    /// Stop waiting on other processes' jobs (the lease is handed on).
    pub fn hand_over(&self) {
        self.inner.handover.cancel();
    }

    pub fn handed_over(&self) -> CancellationToken {
        self.inner.handover.clone()
    }
}

/// Wait for the end of a job another process runs. Once the lease is
/// handed over, waiting stops (the next dispatcher adopts the job); a lost
/// job is what [`lost`] makes of it.
pub(super) async fn await_end<H: Handler>(
    crew: &Crew,
    shared: &Shared<H>,
    key: &str,
    retry: Option<u64>,
    end: oneshot::Receiver<Option<(Finished<Instant>, bool)>>,
) -> (Finished<Instant>, bool) {
    let handed = crew.handed_over();
    let end = tokio::select! {
        end = end => end.ok().flatten(),
        _ = handed.cancelled() => None,
    };
    match end {
        Some(end) => end,
        None if handed.is_cancelled() => (Finished::Done, false),
        None => lost(shared, key, retry).await,
    }
}

/// Record a job this process runs as dispatcher, for its beats.
pub(super) fn register(registry: &Registry, id: u64, key: &str, retry: Option<u64>) {
    if let Ok(mut r) = registry.lock() {
        r.insert(
            id,
            Running {
                id,
                key: key.to_owned(),
                retry,
                mine: true,
            },
        );
    }
}

/// A job another process ran and lost: the inbox says what became of it,
/// and `reset` asks for a reset to the ack floor (an unacked message comes
/// again, in order).
pub(super) async fn lost<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    retry: Option<u64>,
) -> (Finished<Instant>, bool) {
    match retry {
        Some(seq) => (
            Finished::Parked {
                seq,
                due: Instant::now() + Duration::from_secs(1),
            },
            false,
        ),
        None => match delivery::next_parked_of(shared, key).await {
            Some(Some(seq)) => (
                Finished::Parked {
                    seq,
                    due: Instant::now(),
                },
                true,
            ),
            _ => (Finished::Done, true),
        },
    }
}

// ---------------------------------------------------------------- every process

/// What every process of the crew shares with its dispatcher period.
pub(super) struct Worker {
    pub registry: Registry,
    pub dispatching: AtomicBool,
    pub processes: AtomicUsize,
}

/// Run the jobs the dispatcher sends, and say every beat what this process
/// runs, until `shutdown`; then finish them (bounded by `timeout`) and keep
/// saying what runs until nothing does.
#[allow(clippy::too_many_arguments)]
pub(super) async fn work<H: Handler>(
    shared: Arc<Shared<H>>,
    js: jetstream::Context,
    pool: PgPool,
    mut member: Member,
    worker: Arc<Worker>,
    readiness: Readiness,
    shutdown: CancellationToken,
    timeout: Duration,
) {
    let cfg = shared.cfg.clone();
    let client = js.client();
    let base = base(&cfg.stream, &cfg.durable);
    let capacity = cfg.concurrency.max(1);
    let mut sub = None;
    let mut tasks: JoinSet<(u64, String, Finished<Instant>, bool)> = JoinSet::new();
    let mut beat = tokio::time::interval(BEAT);
    let mut beat_no: u64 = 0;
    let mut liveness = tokio::time::interval(Duration::from_secs(1));
    let mut leaving: Option<Instant> = None;
    let running_gauge = metrics::gauge!(m::CONSUMER_RUNNING_JOBS);
    let processes_gauge = metrics::gauge!(m::CONSUMER_PROCESSES);
    loop {
        if sub.is_none() && leaving.is_none() {
            match client.subscribe(format!("{base}.job.{}", member.id)).await {
                Ok(s) => sub = Some(s),
                Err(e) => tracing::warn!(error = %e, "cannot subscribe for crew jobs; retrying"),
            }
        }
        let registry_empty = worker.registry.lock().map(|r| r.is_empty()).unwrap_or(true);
        if leaving.is_some() && tasks.is_empty() && registry_empty {
            break;
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled(), if leaving.is_none() => {
                leaving = Some(Instant::now() + timeout);
                sub = None;
                beat.reset_immediately();
            }
            _ = tokio::time::sleep_until(leaving.unwrap_or_else(Instant::now).into()), if leaving.is_some() => {
                tracing::warn!(running = tasks.len(), "shutdown timeout: jobs of the crew left unfinished come again");
                shared.stop.cancel();
                tasks.abort_all();
                break;
            }
            Some(done) = tasks.join_next() => {
                if let Ok((id, _key, how, panicked)) = done {
                    report(&client, &cfg.stream, &cfg.durable, id, how, panicked).await;
                    if let Ok(mut r) = worker.registry.lock() {
                        r.remove(&id);
                    }
                }
            }
            req = next_request(&mut sub) => {
                let Some(req) = req else {
                    sub = None;
                    tokio::time::sleep(BEAT).await;
                    continue;
                };
                let Some(reply) = req.reply.clone() else { continue };
                if tasks.len() >= capacity || leaving.is_some() {
                    let _ = client.publish(reply, "full".into()).await;
                    continue;
                }
                let Some((head, job)) = decode(&req, &js) else {
                    let _ = client.publish(reply, "bad".into()).await;
                    continue;
                };
                if let Ok(mut r) = worker.registry.lock() {
                    r.insert(head.id, Running { id: head.id, key: head.key.clone(), retry: head.retry, mine: false });
                }
                let _ = client.publish(reply, format!("ok {beat_no}").into()).await;
                let shared = shared.clone();
                tasks.spawn(async move {
                    let (how, panicked) = run_caught(&shared, &head.key, job, head.retry).await;
                    (head.id, head.key, how, panicked)
                });
            }
            _ = beat.tick() => {
                beat_no += 1;
                let running: Vec<Running> = worker
                    .registry
                    .lock()
                    .map(|r| r.values().cloned().collect())
                    .unwrap_or_default();
                running_gauge.set(running.len() as f64);
                let hello = Hello {
                    member: member.id,
                    capacity,
                    leaving: leaving.is_some(),
                    beat: beat_no,
                    running,
                };
                if let Ok(body) = serde_json::to_vec(&hello) {
                    let _ = client.publish(format!("{base}.s.hello"), body.into()).await;
                }
            }
            _ = liveness.tick() => {
                if leaving.is_none() && !member.held().await {
                    tracing::warn!("lost the crew membership (its Postgres connection failed); joining again");
                    // Jobs in flight would be taken for lost: stop them.
                    shared.stop.cancel();
                    tasks.abort_all();
                    if let Ok(mut r) = worker.registry.lock() {
                        r.clear();
                    }
                    match Member::join(&pool, &cfg.stream, &cfg.durable).await {
                        Ok(m) => {
                            member = m;
                            sub = None;
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot join the crew again; retrying"),
                    }
                    continue;
                }
                if let Ok(Ok(live)) = tokio::time::timeout(Duration::from_secs(2), alive(&pool, &cfg.stream, &cfg.durable)).await {
                    worker.processes.store(live.len(), Ordering::Relaxed);
                    processes_gauge.set(live.len() as f64);
                }
                if !worker.dispatching.load(Ordering::Relaxed) && leaving.is_none() {
                    let n = worker.processes.load(Ordering::Relaxed);
                    readiness.ready();
                    readiness.note(format!(
                        "one of {n} process(es) of durable {}: another dispatches; this one runs the jobs it is sent ({} running, room for {capacity})",
                        cfg.durable,
                        tasks.len()
                    ));
                }
            }
        }
    }
    running_gauge.set(0.0);
}

async fn next_request(sub: &mut Option<async_nats::Subscriber>) -> Option<async_nats::Message> {
    match sub {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// A job request back into the scheduler's job.
fn decode(
    req: &async_nats::Message,
    js: &jetstream::Context,
) -> Option<(JobHead, Job<jetstream::Message>)> {
    let split = req.payload.iter().position(|b| *b == b'\n')?;
    let head: JobHead = serde_json::from_slice(&req.payload[..split]).ok()?;
    let body = req.payload.slice(split + 1..);
    let job = match head.retry {
        Some(seq) => Job::Retry { seq },
        None => {
            let message = async_nats::Message {
                subject: head.subject.as_str().into(),
                reply: Some(head.reply.clone()?.into()),
                length: body.len(),
                payload: body,
                headers: req.headers.clone(),
                status: None,
                description: None,
            };
            Job::Deliver(jetstream::Message {
                message,
                context: js.clone(),
            })
        }
    };
    Some((head, job))
}

/// Run a job here as the dispatcher would, a panic turned into what the
/// dispatcher does with one.
pub(super) async fn run_caught<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    job: Job<jetstream::Message>,
    retry: Option<u64>,
) -> (Finished<Instant>, bool) {
    use futures::FutureExt;
    let spill = matches!(job, Job::Spill(_));
    match std::panic::AssertUnwindSafe(Box::pin(delivery::run_job(shared, key, job)))
        .catch_unwind()
        .await
    {
        Ok(how) => (how, false),
        Err(_) => {
            tracing::error!(key, "a delivery panicked (the handler?)");
            // A parked message stays the key's head and is tried again
            // later; a pulled one is unacked and comes again, in order,
            // after a reset.
            match retry {
                Some(seq) => (
                    Finished::Parked {
                        seq,
                        due: Instant::now() + super::PANIC_PAUSE,
                    },
                    false,
                ),
                None if spill => (Finished::Spilled { seq: None }, false),
                None => (Finished::Done, true),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_end_survives_the_wire() {
        for ended in [
            Ended::Done,
            Ended::Parked { seq: 7, due_ms: 0 },
            Ended::Retried { next: Some(9) },
            Ended::Retried { next: None },
            Ended::Spilled { seq: Some(3) },
        ] {
            let back: Ended = serde_json::from_slice(&serde_json::to_vec(&ended).unwrap()).unwrap();
            assert_eq!(back, ended);
        }
        let parked = Ended::from(Finished::Parked {
            seq: 4,
            due: Instant::now() + Duration::from_secs(10),
        });
        assert!(
            matches!(parked, Ended::Parked { seq: 4, due_ms } if due_ms > 9_000 && due_ms <= 10_000)
        );
    }

    #[test]
    fn job_ids_do_not_repeat_across_threads() {
        let ids: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10_000).map(|_| new_job_id()).collect::<Vec<_>>()))
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }
}
