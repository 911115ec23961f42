//! The dispatcher's side, for one period as dispatcher ([`Crew`]): every
//! live process synced and its jobs adopted, jobs handed to processes with
//! room, their ends awaited, and a job taken for lost by the rule.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::helper::Worker;
use super::member::{alive, end_transactions, poll_liveness, Fenced};
use super::messages::{base, roster, Registry, Running, SEND_TIMEOUT};
use super::messages::{new_job_id, Done, Hello, JobHead, Sync, SyncRefusal, SyncReply};
use super::rule::{self, Answer, Heard, JobReply, Ledger, Lost, BEAT, FENCE, LIVENESS_WAIT};
use crate::consumer::delivery::{self, Shared};
use crate::consumer::handler::Handler;
use crate::consumer::scheduler::{Finished, Job};
use crate::error::{Error, Result};

/// A new dispatcher that cannot account for every live process by then
/// gives the lease up and asks again.
pub(super) const ADOPT_LIMIT: Duration = Duration::from_secs(30);

/// How a job ended as its dispatcher handles it: `None` when lost.
pub(super) type JobEnded = Option<(Finished<Instant>, bool)>;

pub(super) type EndRx = oneshot::Receiver<JobEnded>;

/// How a job handed to a helper came back.
pub(crate) enum Sent {
    /// Accepted: its end comes through the receiver (`None`: lost).
    Accepted(EndRx),
    /// Refused (no room, no such process): run it here.
    Refused,
}

pub(super) type EndTx = oneshot::Sender<JobEnded>;

/// Jobs the ledger took for lost: their waits end with `None`.
pub(super) fn end_lost(lost: Lost<EndTx>) {
    for (id, w) in lost {
        tracing::warn!(job = id, member = w.member, "a job another process ran is lost; the inbox decides, and JetStream delivers it again if unacked");
        let _ = w.end.send(None);
    }
}

/// The dispatcher's view of the crew, for one period as dispatcher.
#[derive(Clone)]
pub(crate) struct Crew {
    pub(super) inner: Arc<CrewInner>,
}

pub(super) struct CrewInner {
    pub(super) client: async_nats::Client,
    pub(super) base: String,
    /// This dispatcher's name in requests and syncs: the member id this
    /// process had when the period began, and a number drawn for the period.
    pub(super) me: i32,
    pub(super) period: u64,
    pub(super) worker: Arc<Worker>,
    pub(super) state: Mutex<Ledger<EndTx>>,
    /// Set on hand-over: waiting on other processes' jobs stops (the next
    /// dispatcher adopts them).
    pub(super) handover: CancellationToken,
    /// Set once the takeover has adopted what runs: before, a process the
    /// listener syncs lists jobs the takeover is about to adopt.
    pub(super) adopted: AtomicBool,
    /// Until then, each process's newest beat and the jobs it lists: one
    /// that cannot answer the sync is adopted from them
    /// ([`rule::Takeover::adopts_from`]).
    pub(super) beats: Mutex<HashMap<i32, (u64, Vec<Running>)>>,
    /// Refusals of this period's syncs, the listener's too (a process
    /// answers one sync at a time, and the takeover's may time out behind
    /// the listener's): member, and the beat it named.
    pub(super) refusals: Mutex<HashMap<i32, u64>>,
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

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, Ledger<EndTx>> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) async fn listen(
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
    pub(super) fn heard(&self, h: Hello) -> Option<(i32, u64)> {
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
    pub(super) async fn sync(&self, member: i32) -> SyncReply {
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

    pub(super) async fn ask_sync(&self, member: i32) -> Option<bytes::Bytes> {
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

    pub(super) fn own(&self) -> i32 {
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
pub(crate) async fn await_end<H: Handler>(
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
pub(crate) fn register(
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
