//! Every process's side ([`Worker`], [`work`]): its beats and lock checks,
//! the dispatcher it serves, the jobs it is handed and runs, and the cut
//! of its calls the moment its proof lapses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::member::{alive, Member};
use super::messages::{base, roster, Registry, Roster, Running, SEND_TIMEOUT};
use super::messages::{decode, publish_done, Hello, JobDone, Sync, SyncRefusal};
use super::rule::{self, JobReply, Refusal, Standing, BEAT, OVERHEARD, PING};
use crate::consumer::delivery::{self, Shared};
use crate::consumer::handler::Handler;
use crate::consumer::scheduler::{Finished, Job};
use crate::metrics as m;
use crate::readiness::Readiness;

/// How long a process tries to record another's success before it leaves
/// the request unanswered (the asker asks again).
pub(super) const RECORD_WAIT: Duration = Duration::from_secs(2);

/// Record a success another process of the crew could not, and say so:
/// only once the inbox row says processed does the asker ack the message
/// (no row, no answer: the asker keeps its job and asks again).
pub(super) async fn record_for(
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
    let write = crate::consumer::inbox::record_success(&pool, &durable, id);
    match tokio::time::timeout(RECORD_WAIT, write).await {
        Ok(Ok(crate::consumer::inbox::Recorded::Now)) => {
            tracing::info!(%id, "recorded a success for a process of the crew cut off from Postgres");
        }
        Ok(Ok(crate::consumer::inbox::Recorded::Already)) => {}
        _ => return,
    }
    bounded(client.publish(reply, delivery::RECORDED.into())).await;
}

/// What every process of the crew shares with its dispatcher period.
pub(crate) struct Worker {
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
    /// not. Kept by [`overhear`] and [`super::Crew::send`].
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
pub(super) const DISPATCHER_HEARD: Duration = BEAT.saturating_mul(2).saturating_add(PING);

impl Worker {
    /// `member` may run a job from now on (one was just asked of it).
    pub(super) fn may_run(&self, member: i32) {
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
    pub(super) fn heard_lately(&self) -> Vec<(i32, Instant)> {
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
pub(super) struct LockCheck {
    pub(super) member: Member,
    /// When the check that found the lock held was sent.
    pub(super) proven: Option<Instant>,
    /// Postgres's clock, and when the statement that read it was sent.
    pub(super) clock: Option<(Instant, f64)>,
}

/// The member lock, checked; or taken back under the same id: the
/// dispatcher waits GRACE before it takes a member whose lock went for
/// gone, and a blip (a Postgres restart, a terminated backend) must not
/// cost the jobs running here. The old session, if it lives, holds the id
/// until Postgres ends it (LEASE_TTL).
pub(super) async fn check_member(
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
pub(super) async fn overhear(
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
pub(super) struct Subs {
    pub(super) jobs: Option<async_nats::Subscriber>,
    pub(super) sync: Option<async_nats::Subscriber>,
    pub(super) ack: Option<async_nats::Subscriber>,
    pub(super) record: Option<async_nats::Subscriber>,
}

impl Subs {
    pub(super) async fn open(
        client: &async_nats::Client,
        base: &str,
        member: i32,
        leaving: bool,
    ) -> Subs {
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

    pub(super) fn complete(&self, leaving: bool) -> bool {
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
pub(crate) async fn work<H: Handler>(
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
pub(super) async fn cut_at_lapse<H>(shared: Arc<Shared<H>>, stop: CancellationToken) {
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
pub(super) struct Work<H> {
    pub(super) shared: Arc<Shared<H>>,
    pub(super) js: jetstream::Context,
    pub(super) client: async_nats::Client,
    pub(super) base: String,
    pub(super) pool: PgPool,
    /// The membership, here between checks; away while one runs
    /// ([`check_member`]).
    pub(super) member: Option<Member>,
    pub(super) member_id: i32,
    /// The member-lock check under way: off the loop, so that a Postgres
    /// that does not answer never holds up a beat (a takeover hears a
    /// process by its beats, and counts its silence).
    pub(super) lock_check: JoinSet<LockCheck>,
    pub(super) worker: Arc<Worker>,
    pub(super) readiness: Readiness,
    pub(super) subs: Subs,
    pub(super) tasks: JoinSet<JobDone>,
    pub(super) capacity: usize,
    /// The proof this process's jobs need to start a call.
    pub(super) standing: Standing,
    /// When the last good member-lock check was sent, and Postgres's clock
    /// as it ran ([`Work::clock_read`]).
    pub(super) server_clock: Option<(Instant, f64)>,
    /// The proof had lapsed at the last beat.
    pub(super) unheard: bool,
    /// Shutting down: by when the jobs left must end.
    pub(super) leaving: Option<Instant>,
    pub(super) running_gauge: metrics::Gauge,
}

impl<H: Handler> Work<H> {
    /// The member lock was held when a check was sent at `pinged`.
    pub(super) fn lock_proven(&mut self, pinged: Instant) {
        self.standing.lock_held(pinged);
        if let Some(h) = &self.shared.helper {
            h.member.renew(pinged + rule::MEMBER_PROOF);
        }
        self.prove();
    }

    pub(super) fn prove(&self) {
        let ends = self.standing.ends();
        // A lapse is a fence: the dispatcher may have taken what ran here
        // for lost, so nothing started before it may call once the proof
        // comes back (`cut_at_lapse` may not have woken yet after a thaw).
        if !self.shared.proof.holds() && ends > Instant::now() {
            self.shared.calls.cut();
        }
        self.shared.proof.set(ends);
    }

    pub(super) fn time_out(&mut self) {
        tracing::warn!(
            running = self.tasks.len(),
            "shutdown timeout: jobs of the crew left unfinished come again"
        );
        self.shared.stop.cancel();
        self.tasks.abort_all();
    }

    pub(super) async fn job_ended(
        &mut self,
        done: std::result::Result<JobDone, tokio::task::JoinError>,
    ) {
        if let Ok(done) = done {
            let id = done.id;
            publish_done(&self.client, &self.base, done).await;
            roster(&self.worker.registry).jobs.remove(&id);
        }
    }

    /// A dispatcher's sync: only the process holding the lease now may
    /// take this one over, so an old dispatcher that has not noticed it
    /// lost the lease cannot take it back from the new one.
    pub(super) async fn synced(&mut self, req: async_nats::Message) {
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
            crate::consumer::lease::held_by(&self.pool, &cfg.stream, &cfg.durable, sync.from),
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
    pub(super) async fn asked(&mut self, req: async_nats::Message) {
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
    pub(super) async fn refuse(&self, reply: async_nats::Subject, why: JobReply) {
        let word = why.encode();
        metrics::counter!(m::CONSUMER_CREW_REFUSALS, "reason" => word.clone()).increment(1);
        bounded(self.client.publish(reply, word.into())).await;
    }

    /// The dispatcher heard a beat. An empty answer is from a dispatcher
    /// that does not name the beat (an older version): dated now.
    pub(super) fn acknowledged(&mut self, msg: &async_nats::Message) {
        let named = std::str::from_utf8(&msg.payload)
            .ok()
            .and_then(|b| b.parse::<u64>().ok());
        if self.standing.acknowledged(named) {
            self.prove();
        }
    }

    pub(super) async fn beat(&mut self) {
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
    pub(super) async fn farewell(&mut self) {
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
    pub(super) async fn lock_checked(
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
    pub(super) async fn clock_read(&mut self, sent: Instant, clock: f64) {
        let before = self.server_clock.replace((sent, clock));
        if !before.is_some_and(|b| rule::clock_stood_still(b, (sent, clock))) {
            return;
        }
        self.shared.calls.cut();
        self.fence("Postgres's clock ran on while this process's stood still (a VM paused with its clock?): its jobs may run elsewhere now, so it cuts the calls it makes for them").await;
    }

    /// The dispatcher may have taken this process's jobs for lost: a period
    /// of it as dispatcher ends (`fences`), and its jobs for the crew stop.
    pub(super) async fn fence(&mut self, why: &str) {
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

    pub(super) fn liveness(&self) {
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

    pub(super) fn hello(&self, r: &Roster, beat: u64) -> Hello {
        // Fenced, it would refuse most requests: it offers none.
        let room = match r.refused_sync {
            Some(_) => 0,
            None => room(&self.shared, self.capacity),
        };
        hello(r, self.member_id, room, self.leaving.is_some(), beat)
    }
}

pub(super) async fn count_processes(
    pool: PgPool,
    stream: String,
    durable: String,
    worker: Arc<Worker>,
) {
    if let Ok(Ok(live)) =
        tokio::time::timeout(Duration::from_secs(2), alive(&pool, &stream, &durable)).await
    {
        worker.processes.store(live.len(), Ordering::Relaxed);
        metrics::gauge!(m::CONSUMER_PROCESSES).set(live.len() as f64);
    }
}

/// A core NATS publish that cannot hold the loop up (with NATS gone, the
/// client's queue fills and a publish waits).
pub(super) async fn bounded<F: std::future::Future>(publish: F) {
    let _ = tokio::time::timeout(BEAT / 5, publish).await;
}

/// The jobs this process offers to take: none while it cannot prove it is
/// heard (it would refuse them, one request each).
pub(super) fn room<H>(shared: &Shared<H>, capacity: usize) -> usize {
    if shared.proof.holds() {
        capacity
    } else {
        0
    }
}

pub(super) fn hello(r: &Roster, member: i32, capacity: usize, leaving: bool, beat: u64) -> Hello {
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
pub(super) async fn stop_jobs(
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

pub(super) async fn next(sub: &mut Option<async_nats::Subscriber>) -> Option<async_nats::Message> {
    match sub {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// Run a job here as the dispatcher would, a panic turned into what the
/// dispatcher does with one.
pub(crate) async fn run_caught<H: Handler>(
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
                        due: Instant::now() + crate::consumer::config::PANIC_PAUSE,
                    },
                    false,
                ),
                None if spill => (Finished::Spilled { seq: None }, false),
                None => (Finished::Done, true),
            }
        }
    }
}
