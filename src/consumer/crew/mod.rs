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
//! The one rule everything below keeps: **a job is run again only once its
//! first run has stopped.** So:
//!
//! - Every process serves one dispatcher at a time. A new dispatcher first
//!   *syncs* every live process, and every one it heard running jobs in the
//!   last [`OVERHEARD`] (each process hears every beat, all along: after a
//!   Postgres stall every member lock is gone at once, and a process cut
//!   off from both may still be running its calls). A process honours a sync only from the
//!   member that holds the lease *now* (the lease's connection also holds a
//!   tag lock keyed by the holder's member id, see `lease::held_by`), so an
//!   old dispatcher that has not noticed it lost the lease cannot take a
//!   process back. From then on that process refuses jobs from anyone else,
//!   and its answer lists what it runs, which the new dispatcher adopts
//!   (their keys stay busy until each reports). A live process that does
//!   not answer is waited for until it must have stopped its jobs (below).
//!   Only then does the new dispatcher reset the durable to its ack floor.
//! - A job request expires: it names the helper's beat after which it must
//!   be refused, so a request that arrives late cannot start a job the
//!   dispatcher has already given up on; and it names the dispatcher's
//!   period, so one sent before the same process took the lease back is
//!   refused too.
//! - Who is alive is Postgres's word: each process holds a session advisory
//!   lock (its member lock) on a session Postgres ends after
//!   [`LEASE_TTL`](super::lease::LEASE_TTL) of silence, and a kill -9 frees
//!   it at once. A helper checks its lock every [`BEAT`] (bounded by
//!   [`PING`]), and the dispatcher acknowledges every beat it hears from a
//!   process serving it, naming the beat. A helper's *proof* holds while it
//!   is heard (its newest acknowledged beat sent less than [`FENCE`] ago)
//!   or holds its lock (its last good check less than `LEASE_TTL` ago), and
//!   never past `FENCE_LOCKED` unheard; every call reads it first. So a
//!   Postgres outage, a stalled path or a paused dispatcher costs no call.
//!   Once it lapses the helper offers no room, refuses jobs and cuts its
//!   calls in flight, and nothing it held calls again (a lapse is a fence);
//!   a job past its call is never cut (it records its outcome). A lock
//!   whose connection failed is taken back under the same id. The
//!   dispatcher takes a job for lost only later, by the rule in `rule.rs`
//!   (neither heard nor holding its lock, or not heard for long), or when
//!   a beat past the job's start no longer lists it. A lost job is handled
//!   as one that panicked here: what the inbox holds decides, and a reset
//!   to the ack floor brings back an unacked message, in order. A
//!   dispatcher's own process cut off the same way ends its period (its
//!   calls in flight cut) when others could take over; alone, it cuts
//!   nothing.
//!
//! A call already on the wire when its process froze (SIGSTOP, a VM pause)
//! may be answered by the handler during the freeze; the new dispatcher,
//! which cannot know, makes it again. Nothing else of a frozen process runs
//! once it thaws: its proof has lapsed.
//!
//! Subjects (core NATS, outside any stream): `_OUTBOX_CREW.{stream}.{durable}`
//! `.s.hello` and `.s.done` (one subscription, so a job's end is never read
//! after a beat that no longer lists it), `.job.{member}` (requests),
//! `.sync.{member}` and `.ack.{member}` (the dispatcher heard this member).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::delivery::{self, Shared};
use super::handler::Handler;
use super::scheduler::{Finished, Job};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::readiness::Readiness;
pub(super) use rule::BEAT;
#[cfg(test)]
pub(super) use rule::GRACE;
use rule::{
    Answer, Heard, JobReply, Ledger, Lost, Refusal, Standing, FENCE, LIVENESS, LIVENESS_WAIT,
    OVERHEARD, PING,
};

mod rule;

/// How long a helper may take to answer a request or a sync.
const SEND_TIMEOUT: Duration = Duration::from_millis(500);
/// A new dispatcher that cannot account for every live process by then
/// gives the lease up and asks again.
const ADOPT_LIMIT: Duration = Duration::from_secs(30);

fn lock_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay crew {stream}/{durable}")
}

/// Which processes' transactions [`end_transactions`] ends.
pub(super) enum Fenced<'a> {
    /// These, taken for lost.
    Members(&'a HashSet<i32>),
    /// All but these (the processes that answered a takeover, this one
    /// included).
    AllBut(&'a HashSet<i32>),
}

/// End the inbox transactions of processes whose jobs the crew takes for
/// lost, before their messages run again elsewhere. A frozen process (a VM
/// pause, SIGSTOP) keeps its group transaction open, and with it the row
/// locks of up to [`MAX_GROUP`](super::transaction::MAX_GROUP) messages,
/// until Postgres ends it as idle past the handler's call timeout (30 s
/// and more): each claim elsewhere that names one of them waits as long,
/// with the unrelated messages of its own group. Nothing of an ended
/// transaction commits, so the handler's effects stay exactly-once; the
/// thawed process finds its connection gone. Needs the right to signal
/// the processes' backends (the same role, or `pg_signal_backend`); without
/// it, the wait is Postgres's.
pub(super) async fn end_transactions(pool: &PgPool, stream: &str, durable: &str, who: Fenced<'_>) {
    let (ids, all_but): (Vec<i32>, bool) = match who {
        Fenced::Members(m) => (m.iter().copied().collect(), false),
        Fenced::AllBut(m) => (m.iter().copied().collect(), true),
    };
    let ending = async {
        let marked: Vec<(i32, i64)> = sqlx::query_as(
            "SELECT DISTINCT pid, objid::text::bigint FROM pg_locks \
             WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND classid = hashtext($1)::oid AND pid <> pg_backend_pid() \
               AND (objid::text::bigint = ANY($2)) <> $3",
        )
        .bind(super::transaction::mark_name(stream, durable))
        .bind(&ids)
        .bind(all_but)
        .fetch_all(pool)
        .await?;
        // One by one, so a session this role may not signal (another
        // role's, a superuser's) does not keep the others; each waited for
        // (up to 1 s) to exit, so its locks are gone when the messages are
        // delivered again.
        let ends = marked.into_iter().map(|(pid, member)| async move {
            let ended = sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1, 1000)")
                .bind(pid)
                .fetch_one(pool)
                .await;
            match ended {
                Ok(true) => {
                    metrics::counter!(m::CONSUMER_CREW_TRANSACTIONS_ENDED).increment(1);
                    tracing::warn!(pid, member, "ended an inbox transaction of a process whose jobs run elsewhere now (taken for lost, or silent at a takeover)");
                }
                Ok(false) => tracing::warn!(pid, member, "an inbox transaction of a process whose jobs run elsewhere now did not end within 1 s"),
                Err(e) => tracing::warn!(pid, member, error = %e, "cannot end an inbox transaction of a process whose jobs run elsewhere now: its messages wait until Postgres ends it (idle past the handler's call timeout); grant the consumer's role pg_signal_backend"),
            }
        });
        futures::future::join_all(ends).await;
        Ok::<_, sqlx::Error>(())
    };
    match tokio::time::timeout(END_WAIT, ending).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot look for the inbox transactions of a process whose jobs run elsewhere now: its messages wait until Postgres ends them (idle past the handler's call timeout)"),
        Err(_) => tracing::warn!(
            "ending the inbox transactions of a process whose jobs run elsewhere now took over {END_WAIT:?}"
        ),
    }
}

/// Bounds [`end_transactions`]: each backend is given a second to exit.
const END_WAIT: Duration = Duration::from_secs(3);

fn base(stream: &str, durable: &str) -> String {
    format!("{}.{stream}.{durable}", crate::wire::CREW_PREFIX)
}

/// Where a helper cut off from Postgres asks the crew to record a success
/// (see [`delivery::Recorder`]); every process listens, and each that finds
/// the row processed (one of them by its own write) answers.
pub(super) fn record_subject(stream: &str, durable: &str) -> String {
    format!("{}.record", base(stream, durable))
}

/// How long a process tries to record another's success before it leaves
/// the request unanswered (the asker asks again).
const RECORD_WAIT: Duration = Duration::from_secs(2);

/// Record a success another process of the crew could not, and say so:
/// only once the inbox row says processed does the asker ack the message
/// (no row, no answer: the asker keeps its job and asks again).
async fn record_for(
    client: async_nats::Client,
    pool: PgPool,
    durable: String,
    req: async_nats::Message,
) {
    let (Some(reply), Ok(id)) = (
        req.reply,
        std::str::from_utf8(&req.payload)
            .unwrap_or_default()
            .parse::<uuid::Uuid>(),
    ) else {
        return;
    };
    let write = super::inbox::record_success(&pool, &durable, id);
    match tokio::time::timeout(RECORD_WAIT, write).await {
        Ok(Ok(super::inbox::Recorded::Now)) => {
            tracing::info!(%id, "recorded a success for a process of the crew cut off from Postgres");
        }
        Ok(Ok(super::inbox::Recorded::Already)) => {}
        _ => return,
    }
    bounded(client.publish(reply, delivery::RECORDED.into())).await;
}

/// This process's place in the crew: a session advisory lock that lives as
/// long as its connection.
pub(super) struct Member {
    conn: PgConnection,
    pub id: i32,
}

impl Member {
    pub async fn join(pool: &PgPool, stream: &str, durable: &str) -> Result<Member> {
        // Time-bounded like the lease: a frozen or cut-off process's lock
        // goes within LEASE_TTL, and with it the crew's wait for its jobs.
        let mut conn =
            super::lease::bounded_session(pool, "connecting for the crew membership").await?;
        loop {
            // Positive, so pg_locks shows it as written.
            let id = (uuid::Uuid::new_v4().as_u128() as u32 >> 1) as i32;
            if id != 0 && lock_as(&mut conn, stream, durable, id).await? {
                return Ok(Member { conn, id });
            }
        }
    }

    /// Take the lock under `id` again (its connection failed): `None` while
    /// another session (this process's old one, alive still) holds it.
    pub async fn join_as(
        pool: &PgPool,
        stream: &str,
        durable: &str,
        id: i32,
    ) -> Result<Option<Member>> {
        let mut conn =
            super::lease::bounded_session(pool, "connecting for the crew membership").await?;
        let got = lock_as(&mut conn, stream, durable, id).await?;
        Ok(got.then_some(Member { conn, id }))
    }

    /// The lock is still ours: its connection answers within [`PING`]. A
    /// connection cut off without a reset would otherwise hang the check.
    /// Postgres's clock as it answered (see [`rule::clock_stood_still`]).
    pub async fn held(&mut self) -> Option<f64> {
        let now = sqlx::query_scalar::<_, f64>(SERVER_CLOCK).fetch_one(&mut self.conn);
        match tokio::time::timeout(PING, now).await {
            Ok(Ok(t)) => Some(t),
            _ => None,
        }
    }
}

/// Postgres's clock, in seconds since the epoch.
const SERVER_CLOCK: &str = "SELECT extract(epoch FROM clock_timestamp())::float8";

/// Take the member lock `id` on `conn`, if no other session holds it.
async fn lock_as(conn: &mut PgConnection, stream: &str, durable: &str, id: i32) -> Result<bool> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1), $2)")
        .bind(lock_name(stream, durable))
        .bind(id)
        .fetch_one(conn)
        .await
        .map_err(Error::pg("pg_try_advisory_lock"))
}

/// The members alive now (their lock is held), this one included.
pub(super) async fn alive(
    pool: &PgPool,
    stream: &str,
    durable: &str,
) -> sqlx::Result<HashSet<i32>> {
    super::lease::holders(pool, &lock_name(stream, durable)).await
}

/// Ask Postgres who is alive each [`LIVENESS`], off the loop that reads the
/// crew's beats: an answer may take its whole timeout (a slow or far
/// database), and beats queued behind it would be acknowledged late, their
/// senders' proofs lapsing while they were heard all along. Each answer is
/// dated when it came (a lock seen gone ages from later than Postgres saw
/// it: the safe side); none in time is `None` (silence still counts).
async fn poll_liveness(
    pool: PgPool,
    stream: String,
    durable: String,
    answers: tokio::sync::mpsc::Sender<(Option<HashSet<i32>>, Instant, Instant)>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(LIVENESS);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let asked = Instant::now();
        let alive = tokio::time::timeout(LIVENESS_WAIT, alive(&pool, &stream, &durable))
            .await
            .ok()
            .and_then(Result::ok);
        if answers.send((alive, asked, Instant::now())).await.is_err() {
            return;
        }
    }
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
    #[serde(default)]
    pub mine: bool,
}

/// What a process runs, and the dispatcher it serves (see [`rule::Roster`]).
pub(super) type Roster = rule::Roster<Running>;

pub(super) type Registry = Arc<Mutex<Roster>>;

pub(super) fn roster(registry: &Registry) -> std::sync::MutexGuard<'_, Roster> {
    registry
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hello {
    member: i32,
    capacity: usize,
    leaving: bool,
    beat: u64,
    running: Vec<Running>,
    #[serde(default)]
    serving: Option<i32>,
    #[serde(default)]
    period: u64,
    /// It refused a sync since it was last synced: sync it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    fenced: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct Done {
    id: u64,
    how: Ended,
    panicked: bool,
    /// Stopped unfinished (the helper could not be heard, or lost its
    /// lock): the dispatcher handles it as lost.
    #[serde(default)]
    lost: bool,
}

/// How a job a helper ran ended, for its report.
struct JobDone {
    id: u64,
    how: Finished<Instant>,
    panicked: bool,
}

/// A sync refused by a process that cannot ask Postgres who holds the
/// lease, with its beat then (the takeover adopts its jobs from a later
/// beat: [`rule::Takeover::adopts_from`]).
#[derive(Debug, Serialize, Deserialize)]
struct SyncRefusal {
    refused_at_beat: u64,
}

/// How a process answered a sync.
enum SyncReply {
    /// It serves the asker now; what it runs.
    Joined(Hello),
    /// It cannot tell whether the asker holds the lease.
    Refused { beat: u64 },
    /// No answer, or "not the dispatcher".
    Silent,
}

#[derive(Debug, Serialize, Deserialize)]
struct Sync {
    from: i32,
    /// Drawn anew each period as dispatcher.
    #[serde(default)]
    period: u64,
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
    /// A [`Job::Check`]: its key may be parked in the inbox only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    check: bool,
    #[serde(default)]
    subject: String,
    #[serde(default)]
    reply: Option<String>,
    /// The dispatcher that sends it, and its period.
    from: i32,
    #[serde(default)]
    period: u64,
    /// The helper's last beat at which it may still start the job.
    until: u64,
}

/// A job id unique across the crew: a random base drawn once per process,
/// then a counter. Not a random per job: that was a `getrandom` system call
/// on every delivery (seen in the consumer's profile).
pub(super) fn new_job_id() -> u64 {
    use std::sync::atomic::AtomicU64;
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
    let done = JobDone { id, how, panicked };
    publish_done(client, &base(stream, durable), done).await;
}

async fn publish_done(client: &async_nats::Client, base: &str, job: JobDone) {
    let done = Done {
        id: job.id,
        how: Ended::from(job.how),
        panicked: job.panicked,
        // A job cut short is now reported as panicked (see `stop_jobs`);
        // the field stays for what helpers of earlier versions send.
        lost: false,
    };
    if let Ok(body) = serde_json::to_vec(&done) {
        // Bounded: with NATS gone the client's queue may be full, and the
        // dispatcher takes a silent helper's jobs for lost anyway.
        let _ = tokio::time::timeout(
            SEND_TIMEOUT,
            client.publish(format!("{base}.s.done"), body.into()),
        )
        .await;
    }
}

// ---------------------------------------------------------------- dispatcher

/// How a job ended as its dispatcher handles it: `None` when lost.
type JobEnded = Option<(Finished<Instant>, bool)>;

type EndRx = oneshot::Receiver<JobEnded>;

/// How a job handed to a helper came back.
pub(super) enum Sent {
    /// Accepted: its end comes through the receiver (`None`: lost).
    Accepted(EndRx),
    /// Refused (no room, no such process): run it here.
    Refused,
}

type EndTx = oneshot::Sender<JobEnded>;

/// Jobs the ledger took for lost: their waits end with `None`.
fn end_lost(lost: Lost<EndTx>) {
    for (id, w) in lost {
        tracing::warn!(job = id, member = w.member, "a job another process ran is lost; the inbox decides, and JetStream delivers it again if unacked");
        let _ = w.end.send(None);
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
    /// This dispatcher's name in requests and syncs: the member id this
    /// process had when the period began, and a number drawn for the period.
    me: i32,
    period: u64,
    worker: Arc<Worker>,
    state: Mutex<Ledger<EndTx>>,
    /// Set on hand-over: waiting on other processes' jobs stops (the next
    /// dispatcher adopts them).
    handover: CancellationToken,
    /// Set once the takeover has adopted what runs: before, a process the
    /// listener syncs lists jobs the takeover is about to adopt.
    adopted: AtomicBool,
    /// Until then, each process's newest beat and the jobs it lists: one
    /// that cannot answer the sync is adopted from them
    /// ([`rule::Takeover::adopts_from`]).
    beats: Mutex<HashMap<i32, (u64, Vec<Running>)>>,
    /// Refusals of this period's syncs, the listener's too (a process
    /// answers one sync at a time, and the takeover's may time out behind
    /// the listener's): member, and the beat it named.
    refusals: Mutex<HashMap<i32, u64>>,
}

impl Crew {
    /// Listen to the crew until `stop`.
    pub async fn start(
        client: async_nats::Client,
        pool: PgPool,
        stream: &str,
        durable: &str,
        me: i32,
        worker: Arc<Worker>,
        stop: CancellationToken,
    ) -> Result<Crew> {
        let base = base(stream, durable);
        let sub = client
            .subscribe(format!("{base}.s.*"))
            .await
            .map_err(Error::nats("subscribing to the crew"))?;
        let period = new_job_id() ^ (uuid::Uuid::new_v4().as_u128() as u64);
        let crew = Crew {
            inner: Arc::new(CrewInner {
                client,
                base,
                me,
                period,
                worker,
                state: Mutex::new(Ledger::new(me, period)),
                handover: CancellationToken::new(),
                adopted: AtomicBool::new(false),
                beats: Mutex::new(HashMap::new()),
                refusals: Mutex::new(HashMap::new()),
            }),
        };
        tokio::spawn(
            crew.clone()
                .listen(sub, pool, stream.to_owned(), durable.to_owned(), stop),
        );
        Ok(crew)
    }

    /// This dispatcher as the crew knows it: its member id and period.
    pub fn whoami(&self) -> (i32, u64) {
        (self.inner.me, self.inner.period)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Ledger<EndTx>> {
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
        let (polled, mut polls) = tokio::sync::mpsc::channel(1);
        tokio::spawn(poll_liveness(
            pool.clone(),
            stream.clone(),
            durable.clone(),
            polled,
            stop.clone(),
        ));
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                msg = sub.next() => {
                    let Some(msg) = msg else { break };
                    if msg.subject.ends_with(".hello") {
                        if let Ok(h) = serde_json::from_slice::<Hello>(&msg.payload) {
                            if let Some((member, beat)) = self.heard(h) {
                                // The beat heard: the helper's proof runs
                                // from when it sent it, not from when this
                                // answer reaches it (after a freeze, say).
                                let ack = self.inner.client.publish(format!("{}.ack.{member}", self.inner.base), beat.to_string().into());
                                let _ = tokio::time::timeout(BEAT / 5, ack).await;
                            }
                        }
                    } else if let Ok(d) = serde_json::from_slice::<Done>(&msg.payload) {
                        let waiter = self.state().ended(d.id);
                        if let Some(w) = waiter {
                            let end = (!d.lost).then(|| (d.how.into_finished(), d.panicked));
                            let _ = w.end.send(end);
                        }
                    }
                }
                Some((alive, asked, at)) = polls.recv() => {
                    let lost = self.state().liveness(alive, asked, at);
                    let own = self.inner.worker.member.load(Ordering::Relaxed);
                    let fenced: HashSet<i32> = lost.iter().map(|(_, w)| w.member).filter(|m| *m != own).collect();
                    if fenced.is_empty() {
                        end_lost(lost);
                    } else {
                        // Off the loop, which acknowledges the helpers'
                        // beats; the jobs' waits end once it is done.
                        let (pool, stream, durable) = (pool.clone(), stream.clone(), durable.clone());
                        tokio::spawn(async move {
                            end_transactions(&pool, &stream, &durable, Fenced::Members(&fenced)).await;
                            end_lost(lost);
                        });
                    }
                }
            }
        }
        // The period ended: nobody waits for these any more.
        self.state().clear();
    }

    /// A process's beat. Returns the member to acknowledge, and its beat:
    /// one that serves this dispatcher (the acknowledgement is what keeps
    /// its jobs running).
    fn heard(&self, h: Hello) -> Option<(i32, u64)> {
        let member = h.member;
        if !self.inner.adopted.load(Ordering::Relaxed) {
            let mut beats = self.inner.beats.lock().unwrap_or_else(|e| e.into_inner());
            beats.insert(member, (h.beat, h.running.clone()));
        }
        let heard = Heard {
            member,
            beat: h.beat,
            offer: (!h.leaving).then_some(h.capacity),
            running: h.running.iter().map(|r| r.id).collect(),
            serving: h.serving.map(|s| (s, h.period)),
            fenced: h.fenced,
        };
        let own = self.inner.worker.member.load(Ordering::Relaxed);
        let (Answer { ack, sync }, lost) = self.state().heard(heard, own, Instant::now());
        end_lost(lost);
        if sync {
            let crew = self.clone();
            tokio::spawn(async move {
                if let SyncReply::Joined(answer) = crew.sync(member).await {
                    // Adopting now would come after the keys moved on; a
                    // job of a previous dispatcher here means that process
                    // could not be reached when this period began and did
                    // not stop its jobs in time.
                    let foreign: Vec<&Running> = {
                        let s = crew.state();
                        answer
                            .running
                            .iter()
                            .filter(|r| !s.is_waited(r.id))
                            .collect()
                    };
                    if !foreign.is_empty() && crew.inner.adopted.load(Ordering::Relaxed) {
                        tracing::warn!(
                            member,
                            jobs = foreign.len(),
                            "a process joined this dispatcher while it ran jobs of a previous one"
                        );
                    }
                }
                crew.state().synced(member);
            });
        }
        ack
    }

    /// Make `member` serve this dispatcher; its answer lists what it runs.
    async fn sync(&self, member: i32) -> SyncReply {
        let reply = match self.ask_sync(member).await {
            None => SyncReply::Silent,
            Some(payload) => match serde_json::from_slice::<Hello>(&payload) {
                Ok(h) => SyncReply::Joined(h),
                Err(_) => match serde_json::from_slice::<SyncRefusal>(&payload) {
                    Ok(r) => SyncReply::Refused {
                        beat: r.refused_at_beat,
                    },
                    // "not the dispatcher", from a process that reached
                    // Postgres (or from an earlier version).
                    Err(_) => SyncReply::Silent,
                },
            },
        };
        if let SyncReply::Refused { beat } = reply {
            let mut refusals = self
                .inner
                .refusals
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            refusals.entry(member).or_insert(beat);
        }
        reply
    }

    async fn ask_sync(&self, member: i32) -> Option<bytes::Bytes> {
        let body = serde_json::to_vec(&Sync {
            from: self.inner.me,
            period: self.inner.period,
        })
        .ok()?;
        let subject = format!("{}.sync.{member}", self.inner.base);
        let reply = tokio::time::timeout(
            SEND_TIMEOUT,
            self.inner.client.request(subject, body.into()),
        )
        .await
        .ok()?
        .ok()?;
        Some(reply.payload)
    }

    fn own(&self) -> i32 {
        self.inner.worker.member.load(Ordering::Relaxed)
    }

    /// Jobs the other processes can take at once.
    pub fn capacity(&self) -> usize {
        self.state().capacity(self.own(), Instant::now())
    }

    /// Other live processes of the crew.
    pub fn helpers(&self) -> usize {
        self.state().helper_count(self.own(), Instant::now())
    }

    /// The helper with the most room, which keeps a place for the job.
    pub fn pick(&self) -> Option<i32> {
        let own = self.own();
        self.state().pick(own, Instant::now())
    }

    /// The job's place at `member` is free again.
    pub fn unreserve(&self, member: i32) {
        self.state().unreserve(member);
    }

    /// Hand `job` to `member`.
    pub async fn send(
        &self,
        member: i32,
        id: u64,
        key: &str,
        job: &Job<jetstream::Message>,
    ) -> Sent {
        let (tx, rx) = oneshot::channel();
        // Waiting before asking: its end may come before the answer does.
        // The request expires one beat after the last one heard: a beat
        // past that which does not list the job says it never started.
        let until = self.state().expect(id, member, tx);
        // From now on the member may run a job: a takeover (this process's
        // next period after a lost lease, say) accounts for it even if its
        // beat never says so.
        self.inner.worker.may_run(member);
        let (head, headers, body) = match job {
            Job::Deliver(msg) | Job::Check(msg) => (
                JobHead {
                    id,
                    key: key.to_owned(),
                    retry: None,
                    check: matches!(job, Job::Check(_)),
                    subject: msg.subject.to_string(),
                    reply: msg.reply.as_ref().map(|r| r.to_string()),
                    from: self.inner.me,
                    period: self.inner.period,
                    until,
                },
                msg.headers.clone(),
                msg.payload.clone(),
            ),
            Job::Retry { seq } => (
                JobHead {
                    id,
                    key: key.to_owned(),
                    retry: Some(*seq),
                    check: false,
                    subject: String::new(),
                    reply: None,
                    from: self.inner.me,
                    period: self.inner.period,
                    until,
                },
                None,
                Bytes::new(),
            ),
            _ => {
                self.state().ended(id);
                return Sent::Refused;
            }
        };
        let Ok(mut payload) = serde_json::to_vec(&head) else {
            self.state().ended(id);
            return Sent::Refused;
        };
        payload.push(b'\n');
        payload.extend_from_slice(&body);
        // The request carries the message and a head: one near the server's
        // max_payload does not fit. Refused, it runs here (sent, the server
        // refused it, the job was taken for lost, and the reset that followed
        // brought it back to the same refusal).
        let size = payload.len() + headers.as_ref().map_or(0, crate::nats::header_size);
        if size > self.inner.client.server_info().max_payload {
            self.state().ended(id);
            return Sent::Refused;
        }
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
            Ok(Ok(reply)) => match JobReply::read(&reply.payload) {
                JobReply::Admitted { beat } => {
                    s.accepted(id, beat);
                    Sent::Accepted(rx)
                }
                refused => {
                    tracing::debug!(member, job = id, reply = ?refused, "a helper refused a job; it runs here");
                    s.ended(id);
                    Sent::Refused
                }
            },
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                s.ended(id);
                Sent::Refused
            }
            // It may have been accepted: a beat past `until` tells.
            _ => {
                s.unanswered(id, until);
                Sent::Accepted(rx)
            }
        }
    }

    /// Before this dispatcher runs anything: sync every live process (from
    /// then on it serves this one only) and take on the jobs each runs,
    /// each with the receiver its end arrives on. A live process that does
    /// not answer is waited for until it has stopped its jobs; one whose
    /// lock just went, until [`GRACE`](rule::GRACE) says it has. Bounded by
    /// [`ADOPT_LIMIT`] (an error: the lease is given up and asked again).
    pub async fn adopt(
        &self,
        pool: &PgPool,
        stream: &str,
        durable: &str,
    ) -> Result<Vec<(i32, Running, EndRx)>> {
        let mut takeover = rule::Takeover::new(&self.state(), Instant::now());
        let started = takeover.started();
        let mut adopted = Vec::new();
        let mut told = false;
        loop {
            let live = tokio::time::timeout(LIVENESS_WAIT, alive(pool, stream, durable))
                .await
                .ok()
                .and_then(|r| r.ok());
            if let Some(live) = live {
                let overheard = self.inner.worker.heard_lately();
                let targets = takeover.targets(&mut self.state(), &live, overheard);
                let ask = takeover.unanswered(&targets);
                let got = futures::future::join_all(ask.iter().map(|m| self.sync(*m))).await;
                {
                    let refusals = self
                        .inner
                        .refusals
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    for (m, beat) in refusals.iter() {
                        takeover.refused(*m, *beat);
                    }
                }
                for (m, answer) in ask.iter().zip(got) {
                    if let SyncReply::Joined(a) = answer {
                        // Waited for at once: an end may come before the
                        // takeover is done.
                        let mut s = self.state();
                        for running in &a.running {
                            let (tx, rx) = oneshot::channel();
                            if s.adopt(running.id, *m, a.beat, tx, Instant::now()) {
                                adopted.push((*m, running.clone(), rx));
                            }
                        }
                        takeover.answered.insert(*m);
                    }
                }
                // One that cannot answer (cut off from Postgres alone) is
                // adopted from its beats once they list all it may run.
                let own = self.inner.worker.member.load(Ordering::Relaxed);
                for m in takeover.unanswered(&targets) {
                    // Its own process answers itself or the takeover
                    // fails: its roster must serve the new period.
                    if m == own {
                        continue;
                    }
                    let beat = {
                        let beats = self.inner.beats.lock().unwrap_or_else(|e| e.into_inner());
                        beats
                            .get(&m)
                            .filter(|(b, _)| takeover.adopts_from(m, *b))
                            .cloned()
                    };
                    let Some((beat, running)) = beat else {
                        continue;
                    };
                    let mut s = self.state();
                    s.adopted_from_beats(m);
                    for r in running {
                        let (tx, rx) = oneshot::channel();
                        if s.adopt(r.id, m, beat, tx, Instant::now()) {
                            adopted.push((m, r, rx));
                        }
                    }
                    takeover.answered.insert(m);
                    tracing::info!(process = m, beat, "taking over: adopted the jobs of a process that cannot reach Postgres to answer, from its beats");
                }
                if !takeover.answered.contains(&own) && started.elapsed() >= FENCE {
                    return Err(Error::Nats {
                        context: "taking over as dispatcher".into(),
                        source: "this process cannot reach itself through NATS".into(),
                    });
                }
                // One that does not answer is waited for until the rule
                // says it has stopped its jobs.
                let complete = takeover.complete(&self.state(), &targets, Instant::now());
                if !complete && !told {
                    told = true;
                    tracing::info!(processes = ?takeover.unanswered(&targets), "taking over: waiting for processes that ran jobs a moment ago to answer, or to have stopped them");
                }
                if complete {
                    let unanswered = takeover.unanswered(&targets);
                    if !unanswered.is_empty() {
                        tracing::warn!(processes = ?unanswered, "taking over without an answer from every live process: each has stopped its jobs by now");
                    }
                    // Whoever did not answer (the old dispatcher frozen,
                    // say) runs nothing this dispatcher knows of: its
                    // transactions end before its messages come again.
                    let mut answered = takeover.answered.clone();
                    answered.insert(own);
                    end_transactions(pool, stream, durable, Fenced::AllBut(&answered)).await;
                    break;
                }
            }
            if started.elapsed() >= ADOPT_LIMIT {
                return Err(Error::Nats {
                    context: "taking over as dispatcher".into(),
                    source: format!(
                        "cannot account for every process of the crew within {ADOPT_LIMIT:?}"
                    )
                    .into(),
                });
            }
            tokio::time::sleep(BEAT / 5).await;
        }
        self.inner.adopted.store(true, Ordering::Relaxed);
        Ok(adopted)
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
    end: EndRx,
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

/// Record a job this process runs as dispatcher `me` in `period`, for its
/// beats. False when another dispatcher, or a later period of this one, has
/// synced this process since: `me` no longer holds the lease as it did, and
/// must not start anything.
pub(super) fn register(
    registry: &Registry,
    (me, period): (i32, u64),
    id: u64,
    key: &str,
    retry: Option<u64>,
) -> bool {
    let mut r = roster(registry);
    if r.replaced(me, period) {
        return false;
    }
    r.jobs.insert(
        id,
        Running {
            id,
            key: key.to_owned(),
            retry,
            mine: true,
        },
    );
    true
}

/// A job another process ran and lost: the inbox says what became of it,
/// and `reset` asks for a reset to the ack floor (an unacked message comes
/// again, in order). Whatever is parked keeps its backoff: a retry lost in
/// the middle of its attempt (the attempt is counted) waits the backoff of
/// that attempt, so a message that takes its helpers down is not tried
/// again every second.
pub(super) async fn lost<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    retry: Option<u64>,
) -> (Finished<Instant>, bool) {
    let now = Instant::now();
    let Some(head) = delivery::parked_head(shared, key).await else {
        // Stopping: the next dispatcher reads the inbox again.
        return (Finished::Done, false);
    };
    match (retry, head) {
        (Some(seq), Some((head, wait, attempts))) if head == seq => {
            // Parked again before its helper went: that backoff stands.
            // Else the attempt was under way: its own backoff.
            let wait = match wait.is_zero() {
                true => delivery::backoff_after(&shared.cfg.backoff, attempts),
                false => wait,
            };
            (
                Finished::Parked {
                    seq,
                    due: now + wait,
                },
                false,
            )
        }
        // The retried message was done with before its helper went.
        (Some(_), head) => (
            Finished::Retried {
                next: head.map(|(seq, ..)| seq),
            },
            false,
        ),
        (None, Some((seq, wait, _))) => (
            Finished::Parked {
                seq,
                due: now + wait,
            },
            true,
        ),
        (None, None) => (Finished::Done, true),
    }
}

// ---------------------------------------------------------------- every process

/// What every process of the crew shares with its dispatcher period.
pub(super) struct Worker {
    pub registry: Registry,
    pub dispatching: AtomicBool,
    pub processes: AtomicUsize,
    /// This process's member id (taken back under the same id when its
    /// lock's connection fails).
    pub member: AtomicI32,
    /// Counts the times this process was cut off from the crew (its lock
    /// lost, or the dispatcher no longer acknowledging it). A dispatcher
    /// period that sees it move ends: others may take the lease and run its
    /// jobs.
    pub fences: std::sync::atomic::AtomicU64,
    /// Dead letters the DLQ has not stored yet, of the jobs this process
    /// runs for the crew (the dispatcher's own are its period's).
    pub dlq_failing: Arc<AtomicUsize>,
    /// The processes this one has heard beat, or has asked to run a job,
    /// when last, and whether they dispatched then (whoever dispatches): a
    /// takeover accounts for each it heard lately, its member lock held or
    /// not. Kept by [`overhear`] and [`Crew::send`].
    pub overheard: Mutex<HashMap<i32, (Instant, bool)>>,
}

/// How long a takeover counts a dispatcher it heard (one that stopped
/// dispatching without a word: its lease lost in a Postgres stall, or dead)
/// among the processes it must hear from: longer than the longest gap
/// between two beats of a working loop (a beat, and one of the loop's
/// other waits, a [`PING`]; the member-lock check runs off the loop).
/// Alive and heard, it answers
/// and its calls are adopted; silent past this, it is dead or cut off from
/// NATS, and a takeover does not wait for it: its calls are its lease's,
/// and waiting the rule's 5.5 s for a process it cannot tell from a dead one
/// would cost every kill -9 of a dispatcher as much (the one gap left: a
/// dispatcher cut off from both may still be in a call after the reset).
const DISPATCHER_HEARD: Duration = BEAT.saturating_mul(2).saturating_add(PING);

impl Worker {
    /// `member` may run a job from now on (one was just asked of it).
    fn may_run(&self, member: i32) {
        self.overheard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(member, (Instant::now(), false));
    }

    /// The processes a takeover must hear from, with when each was last
    /// heard (or asked): every helper heard less than [`OVERHEARD`] ago
    /// (one that beat idle may have been handed a job since, by a
    /// dispatcher now gone), every dispatcher less than
    /// [`DISPATCHER_HEARD`] ago.
    fn heard_lately(&self) -> Vec<(i32, Instant)> {
        let now = Instant::now();
        self.overheard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, (at, dispatching))| {
                let within = if *dispatching {
                    DISPATCHER_HEARD
                } else {
                    OVERHEARD
                };
                now.saturating_duration_since(*at) < within
            })
            .map(|(m, (at, _))| (*m, *at))
            .collect()
    }
}

/// What a member-lock check found.
struct LockCheck {
    member: Member,
    /// When the check that found the lock held was sent.
    proven: Option<Instant>,
    /// Postgres's clock, and when the statement that read it was sent.
    clock: Option<(Instant, f64)>,
}

/// The member lock, checked; or taken back under the same id: the
/// dispatcher waits GRACE before it takes a member whose lock went for
/// gone, and a blip (a Postgres restart, a terminated backend) must not
/// cost the jobs running here. The old session, if it lives, holds the id
/// until Postgres ends it (LEASE_TTL).
async fn check_member(
    mut member: Member,
    pool: PgPool,
    stream: String,
    durable: String,
) -> LockCheck {
    let pinged = Instant::now();
    if let Some(clock) = member.held().await {
        return LockCheck {
            member,
            proven: Some(pinged),
            clock: Some((pinged, clock)),
        };
    }
    let asked = Instant::now();
    match tokio::time::timeout(PING, Member::join_as(&pool, &stream, &durable, member.id)).await {
        Ok(Ok(Some(mut m))) => {
            tracing::info!(
                member = m.id,
                "the crew membership's connection failed; took the membership back"
            );
            let checked = Instant::now();
            let clock = m.held().await.map(|c| (checked, c));
            return LockCheck {
                member: m,
                proven: Some(asked),
                clock,
            };
        }
        Ok(Ok(None)) => tracing::warn!(
            "the crew membership's connection failed and its lock is still held; retrying"
        ),
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot join the crew again; retrying"),
        Err(_) => tracing::warn!("cannot join the crew again (Postgres does not answer); retrying"),
    }
    LockCheck {
        member,
        proven: None,
        clock: None,
    }
}

/// Hear every process's beat, in every process, all along: a new
/// dispatcher's own listener starts with its period, and a process whose
/// member lock is gone (every one, after a Postgres stall past
/// `LEASE_TTL`) that it has not heard yet would be missing from the crew
/// it takes over, with the jobs it runs.
async fn overhear(
    client: async_nats::Client,
    base: String,
    worker: Arc<Worker>,
    stop: CancellationToken,
) {
    let mut sub = None;
    loop {
        if sub.is_none() {
            sub = client.subscribe(format!("{base}.s.hello")).await.ok();
        }
        let Some(s) = sub.as_mut() else {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(BEAT) => continue,
            }
        };
        let msg = tokio::select! {
            _ = stop.cancelled() => return,
            msg = s.next() => msg,
        };
        let Some(msg) = msg else {
            sub = None;
            continue;
        };
        let Ok(h) = serde_json::from_slice::<Hello>(&msg.payload) else {
            continue;
        };
        let mut heard = worker.overheard.lock().unwrap_or_else(|e| e.into_inner());
        if h.leaving && h.running.is_empty() {
            // Its last beat: it takes no job again. (A beat that lists
            // nothing proves little else: a request may be on its way.)
            heard.remove(&h.member);
        } else {
            heard.insert(h.member, (Instant::now(), h.serving == Some(h.member)));
        }
        // Bounded by the crew: who fell silent long ago is forgotten.
        heard.retain(|_, (at, _)| at.elapsed() < OVERHEARD);
    }
}

/// The subscriptions of one membership.
struct Subs {
    jobs: Option<async_nats::Subscriber>,
    sync: Option<async_nats::Subscriber>,
    ack: Option<async_nats::Subscriber>,
    record: Option<async_nats::Subscriber>,
}

impl Subs {
    async fn open(client: &async_nats::Client, base: &str, member: i32, leaving: bool) -> Subs {
        let sub = |what: &str| {
            let subject = format!("{base}.{what}.{member}");
            async move {
                match client.subscribe(subject).await {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot subscribe for the crew; retrying");
                        None
                    }
                }
            }
        };
        // Every process hears it and any that reaches Postgres answers.
        // Not a queue group: the server would hand some requests to the
        // asker itself, or to another process cut off from Postgres, and
        // each such pick cost the asker another 10 s with its job listed.
        let record = match client.subscribe(format!("{base}.record")).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot subscribe for the crew; retrying");
                None
            }
        };
        Subs {
            jobs: if leaving { None } else { sub("job").await },
            sync: sub("sync").await,
            ack: sub("ack").await,
            record,
        }
    }

    fn complete(&self, leaving: bool) -> bool {
        (leaving || self.jobs.is_some())
            && self.sync.is_some()
            && self.ack.is_some()
            && self.record.is_some()
    }
}

/// Run the jobs the dispatcher sends, and say every beat what this process
/// runs, until `shutdown`; then finish them (bounded by `timeout`) and keep
/// saying what runs until nothing does.
///
/// Nothing in this loop waits longer than [`PING`], and the member-lock
/// check runs off it: the checks that stop this process's jobs (its lock,
/// the dispatcher's acknowledgements) must come every beat, or the
/// dispatcher's [`GRACE`](rule::GRACE) would not cover them; and a
/// takeover hears a process by its beats.
#[allow(clippy::too_many_arguments)]
pub(super) async fn work<H: Handler>(
    shared: Arc<Shared<H>>,
    js: jetstream::Context,
    pool: PgPool,
    member: Member,
    worker: Arc<Worker>,
    readiness: Readiness,
    shutdown: CancellationToken,
    timeout: Duration,
) {
    let client = js.client();
    let base = base(&shared.cfg.stream, &shared.cfg.durable);
    let subs = Subs::open(&client, &base, member.id, false).await;
    let mut w = Work {
        member_id: member.id,
        member: Some(member),
        lock_check: JoinSet::new(),
        capacity: shared.cfg.concurrency.max(1),
        shared,
        js,
        client,
        base,
        pool,
        worker,
        readiness,
        subs,
        tasks: JoinSet::new(),
        standing: Standing::new(Instant::now()),
        server_clock: None,
        unheard: false,
        leaving: None,
        running_gauge: metrics::gauge!(m::CONSUMER_RUNNING_JOBS),
    };
    w.prove();
    let _cutter = {
        let stop = CancellationToken::new();
        tokio::spawn(cut_at_lapse(w.shared.clone(), stop.clone()));
        tokio::spawn(overhear(
            w.client.clone(),
            w.base.clone(),
            w.worker.clone(),
            stop.clone(),
        ));
        stop.drop_guard()
    };
    let mut beat = tokio::time::interval(BEAT);
    let mut liveness = tokio::time::interval(Duration::from_secs(1));
    loop {
        if w.leaving.is_some() && w.tasks.is_empty() && roster(&w.worker.registry).jobs.is_empty() {
            w.farewell().await;
            break;
        }
        let leaving = w.leaving;
        tokio::select! {
            biased;
            _ = shutdown.cancelled(), if leaving.is_none() => {
                w.leaving = Some(Instant::now() + timeout);
                w.subs.jobs = None;
                beat.reset_immediately();
            }
            _ = tokio::time::sleep_until(leaving.unwrap_or_else(Instant::now).into()), if leaving.is_some() => {
                w.time_out();
                break;
            }
            Some(done) = w.tasks.join_next() => w.job_ended(done).await,
            Some(checked) = w.lock_check.join_next() => w.lock_checked(checked).await,
            req = next(&mut w.subs.sync) => match req {
                Some(req) => w.synced(req).await,
                None => w.subs.sync = None,
            },
            req = next(&mut w.subs.jobs) => match req {
                Some(req) => w.asked(req).await,
                None => w.subs.jobs = None,
            },
            ack = next(&mut w.subs.ack) => match ack {
                Some(msg) => w.acknowledged(&msg),
                None => w.subs.ack = None,
            },
            req = next(&mut w.subs.record) => match req {
                Some(req) => {
                    tokio::spawn(record_for(w.client.clone(), w.pool.clone(), w.shared.cfg.durable.clone(), req));
                }
                None => w.subs.record = None,
            },
            _ = beat.tick() => w.beat().await,
            _ = liveness.tick() => w.liveness(),
        }
    }
    w.running_gauge.set(0.0);
}

/// Cut this process's calls for the crew the moment its proof lapses. The
/// beat cuts them too, but a beat may wait behind the loop's other work
/// (a report, a sync's lease check, a lock check: up to a few [`PING`]s),
/// and the dispatcher's margins ([`GRACE`](rule::GRACE) after
/// [`MEMBER_PROOF`](rule::MEMBER_PROOF), [`SILENT`] after [`FENCE`]) are
/// counted from the lapse itself. A call already past its handler is not
/// cut (see `stop_jobs`); one cut ends as a panicked job.
async fn cut_at_lapse<H>(shared: Arc<Shared<H>>, stop: CancellationToken) {
    let mut held = true;
    loop {
        // While it holds: until its end (it may have moved on by then).
        // Lapsed: look again each fifth of a beat for it to come back.
        let wake = match shared.proof.ends() {
            Some(end) if held => end.max(Instant::now()),
            _ => Instant::now() + BEAT / 5,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        let holds = shared.proof.holds();
        if held && !holds {
            shared.calls.cut();
        }
        held = holds;
    }
}

/// A helper's loop ([`work`]): its state, and one method per wake-up.
struct Work<H> {
    shared: Arc<Shared<H>>,
    js: jetstream::Context,
    client: async_nats::Client,
    base: String,
    pool: PgPool,
    /// The membership, here between checks; away while one runs
    /// ([`check_member`]).
    member: Option<Member>,
    member_id: i32,
    /// The member-lock check under way: off the loop, so that a Postgres
    /// that does not answer never holds up a beat (a takeover hears a
    /// process by its beats, and counts its silence).
    lock_check: JoinSet<LockCheck>,
    worker: Arc<Worker>,
    readiness: Readiness,
    subs: Subs,
    tasks: JoinSet<JobDone>,
    capacity: usize,
    /// The proof this process's jobs need to start a call.
    standing: Standing,
    /// When the last good member-lock check was sent, and Postgres's clock
    /// as it ran ([`Work::clock_read`]).
    server_clock: Option<(Instant, f64)>,
    /// The proof had lapsed at the last beat.
    unheard: bool,
    /// Shutting down: by when the jobs left must end.
    leaving: Option<Instant>,
    running_gauge: metrics::Gauge,
}

impl<H: Handler> Work<H> {
    /// The member lock was held when a check was sent at `pinged`.
    fn lock_proven(&mut self, pinged: Instant) {
        self.standing.lock_held(pinged);
        if let Some(h) = &self.shared.helper {
            h.member.renew(pinged + rule::MEMBER_PROOF);
        }
        self.prove();
    }

    fn prove(&self) {
        let ends = self.standing.ends();
        // A lapse is a fence: the dispatcher may have taken what ran here
        // for lost, so nothing started before it may call once the proof
        // comes back (`cut_at_lapse` may not have woken yet after a thaw).
        if !self.shared.proof.holds() && ends > Instant::now() {
            self.shared.calls.cut();
        }
        self.shared.proof.set(ends);
    }

    fn time_out(&mut self) {
        tracing::warn!(
            running = self.tasks.len(),
            "shutdown timeout: jobs of the crew left unfinished come again"
        );
        self.shared.stop.cancel();
        self.tasks.abort_all();
    }

    async fn job_ended(&mut self, done: std::result::Result<JobDone, tokio::task::JoinError>) {
        if let Ok(done) = done {
            let id = done.id;
            publish_done(&self.client, &self.base, done).await;
            roster(&self.worker.registry).jobs.remove(&id);
        }
    }

    /// A dispatcher's sync: only the process holding the lease now may
    /// take this one over, so an old dispatcher that has not noticed it
    /// lost the lease cannot take it back from the new one.
    async fn synced(&mut self, req: async_nats::Message) {
        let (Some(reply), Ok(sync)) = (
            req.reply.clone(),
            serde_json::from_slice::<Sync>(&req.payload),
        ) else {
            return;
        };
        let cfg = &self.shared.cfg;
        // Well inside the asker's wait (`SEND_TIMEOUT`): a refusal that
        // comes after it is not heard, and a black-holed Postgres would
        // never let a takeover adopt from this process's beats.
        let holds = tokio::time::timeout(
            SEND_TIMEOUT * 3 / 5,
            super::lease::held_by(&self.pool, &cfg.stream, &cfg.durable, sync.from),
        )
        .await;
        match holds {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                bounded(self.client.publish(reply, "not the dispatcher".into())).await;
                return;
            }
            // Postgres cannot tell: the beat lets a takeover adopt this
            // process's jobs from its later beats.
            Ok(Err(_)) | Err(_) => {
                let beat = self.standing.last_beat();
                roster(&self.worker.registry).refuse_sync(beat);
                let refusal = SyncRefusal {
                    refused_at_beat: beat,
                };
                if let Ok(body) = serde_json::to_vec(&refusal) {
                    bounded(self.client.publish(reply, body.into())).await;
                }
                return;
            }
        }
        // From now on only `sync.from` is served; the answer lists
        // everything started before.
        let hello = {
            let mut r = roster(&self.worker.registry);
            r.serve(sync.from, sync.period);
            self.hello(&r, self.standing.last_beat())
        };
        if let Ok(body) = serde_json::to_vec(&hello) {
            bounded(self.client.publish(reply, body.into())).await;
        }
    }

    /// A job request: admitted by the rule ([`rule::Roster::admit`]) or
    /// refused, the refusal counted.
    async fn asked(&mut self, req: async_nats::Message) {
        let Some(reply) = req.reply.clone() else {
            return;
        };
        // Room first: a full or leaving helper answers "full" without
        // decoding the job (the rule checks it again, for its own callers).
        let room = self.tasks.len() < self.capacity && self.leaving.is_none();
        if !room {
            return self.refuse(reply, JobReply::Refused(Refusal::Full)).await;
        }
        let Some((head, job)) = decode(&req, &self.js) else {
            return self.refuse(reply, JobReply::Other).await;
        };
        let running = Running {
            id: head.id,
            key: head.key.clone(),
            retry: head.retry,
            mine: false,
        };
        let beat_no = self.standing.last_beat();
        // Unheard, a job would soon be stopped again.
        let admitted = roster(&self.worker.registry).admit(
            (head.from, head.period, head.until),
            (beat_no, self.standing.holds(Instant::now()), room),
            head.id,
            running,
        );
        if let Err(why) = admitted {
            return self.refuse(reply, JobReply::Refused(why)).await;
        }
        let admitted = JobReply::Admitted { beat: beat_no }.encode();
        bounded(self.client.publish(reply, admitted.into())).await;
        let shared = self.shared.clone();
        self.tasks.spawn(async move {
            let (how, panicked) = run_caught(&shared, &head.key, job, head.retry).await;
            JobDone {
                id: head.id,
                how,
                panicked,
            }
        });
    }

    /// Answer a job request with a refusal, counted by its reason.
    async fn refuse(&self, reply: async_nats::Subject, why: JobReply) {
        let word = why.encode();
        metrics::counter!(m::CONSUMER_CREW_REFUSALS, "reason" => word.clone()).increment(1);
        bounded(self.client.publish(reply, word.into())).await;
    }

    /// The dispatcher heard a beat. An empty answer is from a dispatcher
    /// that does not name the beat (an older version): dated now.
    fn acknowledged(&mut self, msg: &async_nats::Message) {
        let named = std::str::from_utf8(&msg.payload)
            .ok()
            .and_then(|b| b.parse::<u64>().ok());
        if self.standing.acknowledged(named) {
            self.prove();
        }
    }

    async fn beat(&mut self) {
        // First thing each beat, before anything here may wait: the
        // dispatcher takes this process's jobs for lost once it has not
        // heard it for SILENT, or GRACE after its member lock went: their
        // calls stop first. The proof (the dispatcher's acknowledgement of
        // a recent beat, and the member lock) says whether that can have
        // happened.
        let now_unheard = !self.standing.holds(Instant::now());
        if now_unheard && !self.unheard {
            self.fence("this process cannot prove it is heard by the dispatcher, or holds its member lock (NATS or Postgres unreachable?): cutting the calls it makes for it, which the dispatcher makes again").await;
        }
        self.unheard = now_unheard;
        let beat_no = self.standing.beat(Instant::now());
        let hello = self.hello(&roster(&self.worker.registry), beat_no);
        self.running_gauge.set(hello.running.len() as f64);
        if let Ok(body) = serde_json::to_vec(&hello) {
            bounded(
                self.client
                    .publish(format!("{}.s.hello", self.base), body.into()),
            )
            .await;
        }
        let leaving = self.leaving.is_some();
        if !self.subs.complete(leaving) {
            if let Ok(s) = tokio::time::timeout(
                PING,
                Subs::open(&self.client, &self.base, self.member_id, leaving),
            )
            .await
            {
                self.subs = s;
            }
        }
        if let Some(member) = self.member.take() {
            let cfg = &self.shared.cfg;
            self.lock_check.spawn(check_member(
                member,
                self.pool.clone(),
                cfg.stream.clone(),
                cfg.durable.clone(),
            ));
        }
    }

    /// A last beat, leaving, that lists nothing, sent out before this
    /// process exits: a takeover that heard it running jobs a moment ago
    /// need not wait for it.
    async fn farewell(&mut self) {
        let beat_no = self.standing.beat(Instant::now());
        let hello = self.hello(&roster(&self.worker.registry), beat_no);
        if let Ok(body) = serde_json::to_vec(&hello) {
            bounded(
                self.client
                    .publish(format!("{}.s.hello", self.base), body.into()),
            )
            .await;
            bounded(self.client.flush()).await;
        }
    }

    /// A member-lock check ended ([`check_member`]).
    async fn lock_checked(
        &mut self,
        checked: std::result::Result<LockCheck, tokio::task::JoinError>,
    ) {
        let Ok(c) = checked else {
            // Only a panic: the membership's connection went with it, and
            // its lock; the proof rests on the dispatcher's acknowledgements.
            tracing::error!("the crew membership's check failed; this process's lock is gone");
            return;
        };
        self.member = Some(c.member);
        if let Some((sent, clock)) = c.clock {
            self.clock_read(sent, clock).await;
        }
        if let Some(pinged) = c.proven {
            self.lock_proven(pinged);
        }
    }

    /// Postgres's clock, read by a member-lock check sent at `sent`. Had
    /// this process's own clock stood still since the last (a VM paused
    /// with its clock), its proof proves nothing: the dispatcher may have
    /// taken its jobs for lost, and a lapse is what it acts as.
    async fn clock_read(&mut self, sent: Instant, clock: f64) {
        let before = self.server_clock.replace((sent, clock));
        if !before.is_some_and(|b| rule::clock_stood_still(b, (sent, clock))) {
            return;
        }
        self.shared.calls.cut();
        self.fence("Postgres's clock ran on while this process's stood still (a VM paused with its clock?): its jobs may run elsewhere now, so it cuts the calls it makes for them").await;
    }

    /// The dispatcher may have taken this process's jobs for lost: a period
    /// of it as dispatcher ends (`fences`), and its jobs for the crew stop.
    async fn fence(&mut self, why: &str) {
        self.worker.fences.fetch_add(1, Ordering::Relaxed);
        if self.tasks.is_empty() {
            return;
        }
        tracing::warn!(jobs = self.tasks.len(), "{why}");
        stop_jobs(
            &mut self.tasks,
            &self.worker.registry,
            &self.client,
            &self.base,
            &self.shared.calls,
        )
        .await;
    }

    fn liveness(&self) {
        let cfg = &self.shared.cfg;
        // Off the loop: during a Postgres outage it waits its timeout.
        tokio::spawn(count_processes(
            self.pool.clone(),
            cfg.stream.clone(),
            cfg.durable.clone(),
            self.worker.clone(),
        ));
        if !self.worker.dispatching.load(Ordering::Relaxed) && self.leaving.is_none() {
            let n = self.worker.processes.load(Ordering::Relaxed);
            // The dead letters this process's jobs cannot store yet, as the
            // dispatcher reports its own (the autoscaler and alerts read
            // every process).
            let failing = self.worker.dlq_failing.load(Ordering::Relaxed);
            metrics::gauge!(m::CONSUMER_DLQ_FAILING).set(failing as f64);
            if failing > 0 {
                self.readiness.not_ready(format!(
                    "{failing} dead letter(s) not stored yet: the dead-letter stream refuses them; retrying"
                ));
                return;
            }
            self.readiness.ready();
            self.readiness.note(format!(
                "one of {n} process(es) of durable {}: another dispatches; this one (crew member {}, its advisory lock's objid in pg_locks) runs the jobs it is sent ({} running, room for {})",
                cfg.durable,
                self.member_id,
                self.tasks.len(),
                self.capacity
            ));
        }
    }

    fn hello(&self, r: &Roster, beat: u64) -> Hello {
        // Fenced, it would refuse most requests: it offers none.
        let room = match r.refused_sync {
            Some(_) => 0,
            None => room(&self.shared, self.capacity),
        };
        hello(r, self.member_id, room, self.leaving.is_some(), beat)
    }
}

async fn count_processes(pool: PgPool, stream: String, durable: String, worker: Arc<Worker>) {
    if let Ok(Ok(live)) =
        tokio::time::timeout(Duration::from_secs(2), alive(&pool, &stream, &durable)).await
    {
        worker.processes.store(live.len(), Ordering::Relaxed);
        metrics::gauge!(m::CONSUMER_PROCESSES).set(live.len() as f64);
    }
}

/// A core NATS publish that cannot hold the loop up (with NATS gone, the
/// client's queue fills and a publish waits).
async fn bounded<F: std::future::Future>(publish: F) {
    let _ = tokio::time::timeout(BEAT / 5, publish).await;
}

/// The jobs this process offers to take: none while it cannot prove it is
/// heard (it would refuse them, one request each).
fn room<H>(shared: &Shared<H>, capacity: usize) -> usize {
    if shared.proof.holds() {
        capacity
    } else {
        0
    }
}

fn hello(r: &Roster, member: i32, capacity: usize, leaving: bool, beat: u64) -> Hello {
    Hello {
        member,
        capacity,
        leaving,
        beat,
        running: r.jobs.values().cloned().collect(),
        serving: r.serving,
        period: r.period,
        fenced: r.refused_sync.is_some(),
    }
}

/// Cut the calls in flight of the jobs the dispatcher sent here (no call
/// starts either: the proof is gone) and report those that end. A cut job
/// ends as a panicked one (the dispatcher resets to the ack floor); a job
/// past its call goes on to record its outcome, listed, and is reported
/// when it ends: cutting it would repeat a call that succeeded. Nothing
/// waits longer than [`PING`] here.
async fn stop_jobs(
    tasks: &mut JoinSet<JobDone>,
    registry: &Registry,
    client: &async_nats::Client,
    base: &str,
    calls: &delivery::Calls,
) {
    calls.cut();
    let deadline = Instant::now() + PING;
    while let Ok(Some(done)) = tokio::time::timeout_at(deadline.into(), tasks.join_next()).await {
        if let Ok(done) = done {
            roster(registry).jobs.remove(&done.id);
            publish_done(client, base, done).await;
        }
    }
}

async fn next(sub: &mut Option<async_nats::Subscriber>) -> Option<async_nats::Message> {
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
            let msg = jetstream::Message {
                message,
                context: js.clone(),
            };
            match head.check {
                true => Job::Check(msg),
                false => Job::Deliver(msg),
            }
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
    // Taken as the job starts: a cut from now on fences it.
    let fence = shared.calls.token();
    match std::panic::AssertUnwindSafe(Box::pin(delivery::run_job(shared, key, job, &fence)))
        .catch_unwind()
        .await
    {
        Ok(Some(how)) => (how, false),
        // Cut short before its outcome was settled: nothing of it is in the
        // inbox or acked, which is what a panic leaves too.
        cut => {
            if cut.is_err() {
                tracing::error!(key, "a delivery panicked (the handler?)");
            } else {
                tracing::debug!(
                    key,
                    "a job was cut short (stopping, or no right to start it)"
                );
            }
            // A parked message stays the key's head and is tried again
            // later; a pulled one is unacked and comes again, in order,
            // after a reset.
            match retry {
                Some(seq) => (
                    Finished::Parked {
                        seq,
                        due: Instant::now() + super::config::PANIC_PAUSE,
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
