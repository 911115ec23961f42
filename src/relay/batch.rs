//! Whole transactions as JetStream atomic batches (ADR-50, nats-server
//! 2.12.1+), with the per-event [`Publisher`] beside it for what a batch
//! cannot carry.
//!
//! Transactions queue here as they are read. When no batch awaits its
//! commit ack, the complete transactions at the head of the queue go out
//! as one batch (up to [`MAX_BATCH`] messages and half the byte window), so
//! batches grow with the load and shrink to one transaction when it is
//! light. A transaction larger than a batch goes out as consecutive batches
//! of its own, each message saying which (`Outbox-Txn-Batch`, and on the
//! last batch `Outbox-Txn-Batches`); a batch is cut from an open
//! transaction only when it must be (a full batch, or the byte window), and
//! always leaves one message behind, so the last batch is the one that
//! knows it is last.
//!
//! One batch is in flight at a time. That is the order guarantee: batch
//! i + 1 leaves only once batch i is committed, so nothing can be stored
//! ahead of something lost, and no order check is needed. (The per-event
//! path needs `Nats-Expected-Last-Msg-Id` because it pipelines; batches
//! cannot carry it, and an expected last sequence predicted for a
//! pipelined batch can be met by another writer's message, which would
//! store batch i + 1 after a refused batch i.) So other writers in the
//! stream cost nothing.
//!
//! Every outcome is settled inside the session:
//! - committed: every message is acked;
//! - refused (a definite answer: nothing of the batch is stored): the
//!   batch goes again one event at a time through the per-event path, which
//!   settles each message's own refusal (a duplicate id stored before, a
//!   message too large) the way it always has; a batch the server merely
//!   lost track of (incomplete, too many in flight) goes again as a batch;
//! - unknown (no ack in time, no leader, a dropped connection): the
//!   stream's tail says whether it was stored ([`publish::stored_tail`]);
//!   what is not goes again as a new batch, and ids dedupe a late commit
//!   of the old one (the server then refuses the new batch as a whole,
//!   which the previous rule settles).
//!
//! A batch of one message is an ordinary publish: it is atomic anyway, and
//! the server stages a batch in a store of its own.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, Context};
use pgwire_replication::Lsn;

use super::answer::CommitAnswer;
use super::link::{Heard, Reply};
use super::publish::{self, Ack, Publisher, Tail};
use super::route::OutMessage;
use super::watermark::Ticket;
use crate::backoff::Backoff;
use crate::error::{Error, PublishFailure, Result};
use crate::metrics as m;
use crate::wire::{self, Lineage, Position};

/// Messages per batch: nats-server's default limit
/// (`jetstream.limits.max_batch_size`). A server configured lower refuses
/// larger batches; the limit then halves until they fit.
pub const MAX_BATCH: usize = 1000;
/// Between lookups while the stream does not answer.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_millis(500);
/// The first wait for one look-up of the stream's tail; it doubles after
/// each that goes unanswered, up to the maximum (a scan past many other
/// writers' messages takes longer; one that never fits ends the session
/// after the outage budget, and the next session's scan is unbounded).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_LOOKUP_TIMEOUT: Duration = Duration::from_secs(4);
/// How long the stream may stay unanswering before the session ends.
const OUTAGE_BUDGET: Duration = Duration::from_secs(60);
/// Times a batch the server lost track of goes again as a batch before it
/// goes one event at a time.
const BATCH_RETRIES: u32 = 3;

struct Queued {
    ticket: Ticket,
    commit_micros: i64,
    pos: Position,
    msg: OutMessage,
}

/// The queued messages of one transaction, at the queue's tail end or
/// (once earlier ones went) its head.
#[derive(Debug, Clone, Copy)]
struct Run {
    commit_lsn: Lsn,
    len: usize,
    bytes: usize,
    complete: bool,
    /// Batches of this transaction already sent: non-zero once it is split.
    batches_sent: u32,
}

/// What the head of the queue makes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// These many whole transactions, `len` messages.
    Whole { runs: usize, len: usize },
    /// `len` messages of the head transaction, its batch `number`; `last`
    /// when they are the rest of a complete one.
    Part { len: usize, number: u32, last: bool },
}

struct InFlight {
    id: String,
    msgs: Vec<Queued>,
    /// How many were handed to the connection (the sending is resumable:
    /// `next_ack` may be dropped between two messages).
    next: usize,
    /// The reply token of its commit, once handed to the link.
    commit: Option<u64>,
    /// When the commit was handed over: the stall clock.
    committed_at: Instant,
    /// Not sent before this (a pause after a refusal that may pass).
    not_before: Option<Instant>,
    /// Sent again one event at a time from `next` on.
    unbatched: bool,
    /// The commit went unanswered: its fate is looked up in the stream
    /// (resumable too).
    lookup: bool,
    retries: u32,
}

pub struct Batcher {
    per_event: Publisher,
    batches: bool,
    js: Context,
    stream: String,
    lineage: Option<Lineage>,
    /// The stream's tail at session start, if it is inside a transaction
    /// split into batches: its rest continues the numbering.
    resume: Option<Tail>,
    queue: VecDeque<Queued>,
    runs: VecDeque<Run>,
    queued_bytes: usize,
    current: Option<InFlight>,
    current_bytes: usize,
    /// Acks of a committed batch, handed out one by one.
    ready: VecDeque<Ack>,
    /// Batches are off from now on: hand everything queued to `per_event`.
    unbatch_all: bool,
    max_batch: usize,
    max_batch_bytes: usize,
    max_bytes: usize,
    max_count: usize,
    /// How long a commit may go unanswered before the batch's fate is
    /// looked up in the stream.
    stall: Duration,
    /// Since when no batch got a definite answer (a commit ack or a
    /// refusal): the session ends past [`OUTAGE_BUDGET`], as the per-event
    /// path's does, however many look-ups and resends happened meanwhile.
    unanswered_since: Option<Instant>,
    /// The pause before the next resend while unanswered; grows.
    pause: Backoff,
    /// Unique per process and session, so batch ids never meet an old one.
    prefix: String,
    counter: u64,
    /// The last commit's reply token.
    commits: u64,
}

impl Batcher {
    /// `batches`: publish in atomic batches (else everything goes through
    /// `per_event`). The per-event window bounds what is queued and in
    /// flight here too, in bytes, and in count up to two batches.
    pub fn new(per_event: Publisher, batches: bool, stream: String) -> Self {
        let (js, max_count, max_bytes, stall) = per_event.settings();
        metrics::gauge!(m::PUBLISH_BATCHES).set(if batches { 1.0 } else { 0.0 });
        Self {
            per_event,
            batches,
            js,
            stream,
            lineage: None,
            resume: None,
            queue: VecDeque::new(),
            runs: VecDeque::new(),
            queued_bytes: 0,
            current: None,
            current_bytes: 0,
            ready: VecDeque::new(),
            unbatch_all: false,
            // Room for one batch in flight and the next filling behind it;
            // more would only hold memory.
            max_batch: (max_count / 2).clamp(1, MAX_BATCH),
            max_batch_bytes: (max_bytes / 2).max(1),
            max_bytes,
            max_count: max_count.clamp(1, 2 * MAX_BATCH),
            stall,
            unanswered_since: None,
            pause: Backoff::jittered(FIRST_PAUSE, MAX_PAUSE),
            prefix: uuid::Uuid::new_v4().simple().to_string(),
            counter: 0,
            commits: 0,
        }
    }

    /// The per-event path, for what publishes before streaming (backfill).
    pub fn per_event(&mut self) -> &mut Publisher {
        &mut self.per_event
    }

    pub fn batches(&self) -> bool {
        self.batches
    }

    /// Streaming begins: where this source's messages end in the stream,
    /// to settle a batch whose commit went unanswered.
    pub fn streaming(&mut self, lineage: Lineage, resume: Option<Tail>) {
        self.lineage = Some(lineage);
        self.resume = resume;
    }

    pub fn has_room(&self) -> bool {
        if !self.batches {
            return self.per_event.has_room();
        }
        let bytes = self.in_flight_bytes();
        let count = self.in_flight();
        (bytes < self.max_bytes && count < self.max_count)
            // Nothing could go out without another message (an open
            // transaction whose only message fills the window): one more
            // is let in, as the per-event window always lets one through.
            || (self.current.is_none() && self.per_event.in_flight() == 0 && self.plan().is_none())
    }

    /// Messages handed over whose ack has not been returned yet.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
            + self.current.as_ref().map_or(0, |c| c.msgs.len())
            + self.ready.len()
            + self.per_event.in_flight()
    }

    pub fn in_flight_bytes(&self) -> usize {
        self.queued_bytes + self.current_bytes + self.per_event.in_flight_bytes()
    }

    pub async fn publish(
        &mut self,
        ticket: Ticket,
        commit_micros: i64,
        pos: Position,
        msg: OutMessage,
    ) -> Result<()> {
        if !self.batches {
            return self.per_event.publish(ticket, commit_micros, msg).await;
        }
        let size = msg.wire_size();
        match self.runs.back_mut() {
            Some(run) if !run.complete && run.commit_lsn == pos.commit_lsn => {
                run.len += 1;
                run.bytes += size;
            }
            _ => {
                // The rest of a split transaction the stream holds the
                // first batches of: its numbering goes on.
                let batches_sent = match self.resume.take() {
                    Some(t) if t.at.commit_lsn == pos.commit_lsn => t.txn_batch.unwrap_or(1),
                    _ => 0,
                };
                self.runs.push_back(Run {
                    commit_lsn: pos.commit_lsn,
                    len: 1,
                    bytes: size,
                    complete: false,
                    batches_sent,
                });
            }
        }
        self.queued_bytes += size;
        self.queue.push_back(Queued {
            ticket,
            commit_micros,
            pos,
            msg,
        });
        Ok(())
    }

    /// The transaction being read committed.
    pub fn end_transaction(&mut self) {
        if let Some(run) = self.runs.back_mut() {
            run.complete = true;
        }
    }

    /// No more input (shutdown): an open transaction's messages are
    /// dropped unsent (the slot was not confirmed past them, so they are
    /// read again), and what is complete drains.
    pub fn close(&mut self) {
        if let Some(run) = self.runs.back().copied().filter(|r| !r.complete) {
            self.runs.pop_back();
            for _ in 0..run.len {
                self.queue.pop_back();
            }
            self.queued_bytes = self.queued_bytes.saturating_sub(run.bytes);
        }
    }

    /// What the head of the queue makes now, if anything.
    fn plan(&self) -> Option<Plan> {
        plan(
            &self.runs,
            self.queue.iter().map(|q| q.msg.wire_size()),
            self.max_batch,
            self.max_batch_bytes,
        )
    }

    /// Take the planned batch off the queue.
    fn form(&mut self) -> Option<InFlight> {
        let plan = self.plan()?;
        let take = |this: &mut Self, n: usize| {
            let msgs: Vec<Queued> = this.queue.drain(..n).collect();
            let bytes: usize = msgs.iter().map(|q| q.msg.wire_size()).sum();
            this.queued_bytes = this.queued_bytes.saturating_sub(bytes);
            (msgs, bytes)
        };
        let msgs = match plan {
            Plan::Whole { runs, len } => {
                self.runs.drain(..runs);
                take(self, len).0
            }
            Plan::Part { len, number, last } => {
                let (mut msgs, bytes) = take(self, len);
                let head = self.runs.front_mut()?;
                head.len -= len;
                head.bytes = head.bytes.saturating_sub(bytes);
                head.batches_sent = number;
                if head.complete && head.len == 0 {
                    self.runs.pop_front();
                }
                for q in &mut msgs {
                    q.msg
                        .headers
                        .push((wire::TXN_BATCH.into(), number.to_string()));
                    if last {
                        q.msg
                            .headers
                            .push((wire::TXN_BATCHES.into(), number.to_string()));
                    }
                }
                msgs
            }
        };
        self.current_bytes = msgs.iter().map(|q| q.msg.wire_size()).sum();
        Some(self.in_flight_batch(msgs))
    }

    fn in_flight_batch(&mut self, msgs: Vec<Queued>) -> InFlight {
        self.counter += 1;
        InFlight {
            id: format!("{}-{}", self.prefix, self.counter),
            msgs,
            next: 0,
            commit: None,
            committed_at: Instant::now(),
            not_before: None,
            unbatched: false,
            lookup: false,
            retries: 0,
        }
    }

    /// The next ack, in publish order. Cancel-safe: every step that
    /// awaits can be dropped and resumes where it stopped.
    pub async fn next_ack(&mut self) -> Option<Ack> {
        if !self.batches {
            return self.per_event.next_ack().await;
        }
        loop {
            if let Some(a) = self.ready.pop_front() {
                return Some(a);
            }
            if self.current.as_ref().is_some_and(|c| c.unbatched) || self.unbatch_all {
                if let Err(e) = self.hand_to_per_event().await {
                    return Some(self.failed(e));
                }
            }
            if !self.batches || self.per_event.in_flight() > 0 {
                return self.per_event.next_ack().await;
            }
            if self.current.is_none() {
                match self.form() {
                    Some(b) => self.current = Some(b),
                    None => return std::future::pending().await,
                }
            }
            match self.send_rest().await {
                Ok(true) => {}
                Ok(false) => {
                    // The link broke under the batch: paced, and counted
                    // against the outage budget, like any unanswered commit.
                    self.settle(Some(Err(PublishError::new(PublishErrorKind::BrokenPipe))));
                    continue;
                }
                Err(e) => return Some(self.failed(e)),
            }
            let Some(cur) = self.current.as_mut() else {
                continue;
            };
            if let Some(at) = cur.not_before.take() {
                if at > Instant::now() {
                    cur.not_before = Some(at);
                    tokio::time::sleep_until(at.into()).await;
                    continue;
                }
            }
            if cur.lookup {
                self.look_up().await;
                continue;
            }
            let Some(token) = cur.commit else {
                // Sent in full without a commit in hand: only a look-up
                // can say what happened.
                cur.lookup = true;
                continue;
            };
            let stall_at = cur.committed_at + self.stall;
            let answer = match self.per_event.link() {
                None => Some(Err(PublishError::new(PublishErrorKind::BrokenPipe))),
                Some(link) => tokio::select! {
                    biased;
                    r = link.next_commit() => match r {
                        Ok(Heard::Answer(t, answer)) if t == token => Some(answer),
                        // An earlier copy's answer, come late.
                        Ok(Heard::Answer(..)) => continue,
                        // A message of the batch the server refused for the
                        // user's permissions never reached the stream: the
                        // batch has a gap and is abandoned, nothing of it
                        // stored. Event by event, that message is
                        // dead-lettered.
                        Ok(Heard::Denied(subject)) => {
                            let cur = self.current.as_ref();
                            if !cur.is_some_and(|c| c.msgs[..c.next].iter().any(|q| q.msg.subject == subject)) {
                                continue;
                            }
                            let denied = super::link::Denied(subject);
                            Some(Err(PublishError::with_source(PublishErrorKind::Other, denied)))
                        }
                        Err(_) => Some(Err(PublishError::new(PublishErrorKind::BrokenPipe))),
                    },
                    _ = tokio::time::sleep_until(stall_at.into()) => None,
                },
            };
            if answer.is_none() {
                if self.per_event.link().is_some_and(|l| l.still_sending()) {
                    // Late because the batch has not left yet (a large one
                    // on a slow network): the clock starts again.
                    if let Some(cur) = self.current.as_mut() {
                        cur.committed_at = Instant::now();
                    }
                    continue;
                }
                // Silence may be a dead connection the socket has not
                // noticed: the next batch goes on a new one.
                self.per_event.drop_link();
            }
            if let Some(cur) = self.current.as_mut() {
                cur.commit = None;
            }
            self.settle(answer);
        }
    }

    /// Hand the current batch's unsent messages to the link, the last as
    /// the commit, whose answer is awaited; `false` if the link broke under
    /// it. Cancel-safe: only a dial is awaited, before anything is handed
    /// over.
    async fn send_rest(&mut self) -> Result<bool> {
        let Some(cur) = self.current.as_mut() else {
            return Ok(true);
        };
        let n = cur.msgs.len();
        if cur.next >= n {
            return Ok(true);
        }
        self.per_event.batch_link().await?;
        // After the dial, which may have waited: nothing of the batch may
        // go out after a pause.
        self.per_event.fenced(Instant::now())?;
        let Some(link) = self.per_event.link() else {
            return Ok(false);
        };
        while cur.next < n {
            let i = cur.next;
            let q = &cur.msgs[i];
            let last = i + 1 == n;
            let sequence = (i + 1).to_string();
            let batch = [
                (wire::BATCH_ID, cur.id.as_str()),
                (wire::BATCH_SEQUENCE, sequence.as_str()),
                (wire::BATCH_COMMIT, "1"),
            ];
            // One message alone is a plain publish; the commit header only on the last.
            let extra = match (n > 1, last) {
                (false, _) => &batch[..0],
                (true, false) => &batch[..2],
                (true, true) => &batch[..],
            };
            // The server answers only the commit; the others carry no
            // reply subject.
            let reply = if last {
                Reply::Commit(self.commits + 1)
            } else {
                Reply::None
            };
            if !link.publish(&q.msg.subject, reply, &q.msg.headers, extra, &q.msg.body) {
                // The link broke mid-batch: the server drops what it got
                // of it as incomplete, and the stream's tail tells.
                metrics::counter!(m::PUBLISH_ERRORS).increment(1);
                cur.next = n;
                cur.commit = None;
                return Ok(false);
            }
            if last {
                self.commits += 1;
                cur.commit = Some(self.commits);
                cur.committed_at = Instant::now();
            }
            cur.next += 1;
        }
        Ok(true)
    }

    /// Settle the current batch by its commit's answer (`None`: none in
    /// time).
    fn settle(&mut self, answer: Option<CommitAnswer>) {
        let Some(cur) = self.current.as_mut() else {
            return;
        };
        let n = cur.msgs.len();
        let code = match &answer {
            Some(Err(e)) => api_code(e),
            _ => None,
        };
        let definite = match &answer {
            Some(Ok(_)) => true,
            Some(Err(e)) => !uncertain(e) && !matches!(code, Some(10158 | 10210)),
            None => false,
        };
        if definite {
            self.unanswered_since = None;
            self.pause.reset();
        } else if self
            .unanswered_since
            .get_or_insert_with(Instant::now)
            .elapsed()
            > OUTAGE_BUDGET
        {
            let e = Error::Publish {
                id: cur
                    .msgs
                    .first()
                    .map(|q| q.msg.msg_id.clone())
                    .unwrap_or_default(),
                failure: PublishFailure::NoStream,
                source: format!("no batch was answered for {OUTAGE_BUDGET:?}").into(),
            };
            let a = self.failed(e);
            self.ready.push_back(a);
            return;
        }
        match answer {
            Some(Ok(ack)) if n == 1 || ack.batch.as_deref() == Some(cur.id.as_str()) => {
                metrics::counter!(m::BATCHES, "result" => "committed").increment(1);
                let cur = self.current.take().expect("checked above");
                self.current_bytes = 0;
                for q in cur.msgs {
                    self.ready.push_back(Ack {
                        ticket: q.ticket,
                        commit_micros: q.commit_micros,
                        result: Ok(ack.duplicate),
                    });
                }
            }
            Some(Ok(_)) => {
                // A server that ignores the batch headers stored each
                // message as it came: no batches from now on, and the ids
                // dedupe this batch sent again event by event.
                tracing::warn!(
                    stream = %self.stream,
                    "the server ignored the atomic batch headers; publishing event by event from now on"
                );
                self.batches_off();
            }
            Some(Err(e)) if uncertain(&e) => self.start_look_up(&e.to_string()),
            None => self.start_look_up("no commit ack in time"),
            Some(Err(e)) => {
                match code {
                    // The ids are "in process": an earlier copy of this
                    // batch is being committed. Its outcome shows in the
                    // tail once it lands.
                    Some(10158) => self.start_look_up(&e.to_string()),
                    // Others' batches (or this relay's abandoned ones, for
                    // up to 10 s) fill the server's slots: wait, not
                    // unbatch.
                    Some(10210) => {
                        tracing::debug!(error = %e, "too many batches in flight on the server; waiting");
                        metrics::counter!(m::BATCHES, "result" => "retried").increment(1);
                        let pause = self.pause.next_pause();
                        self.again();
                        if let Some(cur) = self.current.as_mut() {
                            cur.not_before = Some(Instant::now() + pause);
                        }
                    }
                    Some(10174) => {
                        tracing::warn!(stream = %self.stream, "atomic publish was disabled on the stream; publishing event by event from now on");
                        self.batches_off();
                    }
                    Some(10176) if cur.retries < BATCH_RETRIES => {
                        tracing::debug!(error = %e, "batch lost on the server; sending it again");
                        metrics::counter!(m::BATCHES, "result" => "retried").increment(1);
                        self.again();
                    }
                    Some(10199) if self.max_batch > 1 && n > 1 => {
                        self.max_batch = (n / 2).max(1);
                        tracing::warn!(error = %e, max_batch = self.max_batch, "the server takes smaller batches; smaller batches from now on");
                        self.unbatch();
                    }
                    _ => {
                        tracing::debug!(error = %e, "batch refused; sending it event by event");
                        self.unbatch();
                    }
                }
            }
        }
    }

    /// Send the current batch again as a new batch.
    fn again(&mut self) {
        let Some(cur) = self.current.take() else {
            return;
        };
        let retries = cur.retries + 1;
        let mut b = self.in_flight_batch(cur.msgs);
        b.retries = retries;
        self.current = Some(b);
    }

    /// Send the current batch again one event at a time.
    fn unbatch(&mut self) {
        metrics::counter!(m::BATCHES, "result" => "unbatched").increment(1);
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        // Refusals still to come of the batch's copies are not the next
        // copies'.
        if let Some(link) = self.per_event.link() {
            link.barrier();
        }
        if let Some(cur) = self.current.as_mut() {
            cur.unbatched = true;
            cur.next = 0;
            cur.commit = None;
        }
    }

    /// No batches from now on: the current batch and everything queued
    /// go one event at a time (a session restart asks the stream again).
    fn batches_off(&mut self) {
        self.unbatch();
        self.unbatch_all = true;
        metrics::gauge!(m::PUBLISH_BATCHES).set(0.0);
    }

    /// Hand the unbatched current batch (and with `unbatch_all`, the
    /// queue) to the per-event path, in order. Resumable: each message
    /// leaves the books once the connection took it.
    async fn hand_to_per_event(&mut self) -> Result<()> {
        // Batches went since its last chained message, if any.
        self.per_event.unchain();
        if let Some(cur) = self.current.as_mut().filter(|c| c.unbatched) {
            while cur.next < cur.msgs.len() {
                let q = &cur.msgs[cur.next];
                self.per_event
                    .publish(q.ticket, q.commit_micros, q.msg.clone())
                    .await?;
                cur.next += 1;
            }
            self.current = None;
            self.current_bytes = 0;
        }
        if self.unbatch_all {
            while let Some(q) = self.queue.front() {
                self.per_event
                    .publish(q.ticket, q.commit_micros, q.msg.clone())
                    .await?;
                let size = q.msg.wire_size();
                self.queue.pop_front();
                self.queued_bytes = self.queued_bytes.saturating_sub(size);
            }
            self.runs.clear();
            self.batches = false;
            self.unbatch_all = false;
        }
        Ok(())
    }

    /// The commit went unanswered: find out from the stream's tail what of
    /// the batch it holds (all or nothing, but a tail read is per message),
    /// ack that, and send the rest again as a new batch.
    fn start_look_up(&mut self, why: &str) {
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        tracing::warn!(reason = why, stream = %self.stream, "a batch's commit went unanswered; looking it up in the stream");
        let pause = self.pause.next_pause();
        if let Some(cur) = self.current.as_mut() {
            cur.lookup = true;
            cur.not_before = Some(Instant::now() + pause);
        }
    }

    /// Cancel-safe: nothing changes until the tail is read.
    async fn look_up(&mut self) {
        // The outage clock that `settle` keeps: look-ups and resends share
        // one budget.
        let since = *self.unanswered_since.get_or_insert_with(Instant::now);
        let mut pause = Backoff::jittered(FIRST_PAUSE, MAX_PAUSE);
        // One look-up may wait on a stream with no leader: bounded, so a
        // new leader is asked within about a second of answering.
        let mut wait = Backoff::new(LOOKUP_TIMEOUT, MAX_LOOKUP_TIMEOUT);
        let tail = loop {
            let Some(lineage) = self.lineage.as_ref() else {
                break Err(Error::Publish {
                    id: String::new(),
                    failure: PublishFailure::TimedOut,
                    source: "a batch went unanswered before streaming began".into(),
                });
            };
            let lookup = publish::stored_tail(&self.js, &self.stream, lineage);
            let answer = tokio::time::timeout(wait.peek(), lookup)
                .await
                .unwrap_or_else(|_| {
                    Err(Error::Publish {
                        id: String::new(),
                        failure: PublishFailure::TimedOut,
                        source: format!("no answer from the stream in {:?}", wait.peek()).into(),
                    })
                });
            match answer {
                Ok(t) => break Ok(t),
                Err(e) if since.elapsed() < OUTAGE_BUDGET => {
                    tracing::debug!(error = %e, "the stream does not answer yet");
                    tokio::time::sleep(pause.next_pause()).await;
                    wait.next_pause();
                }
                Err(e) => break Err(e),
            }
        };
        let tail = match tail {
            Ok(t) => t,
            Err(e) => {
                let a = self.failed(e);
                self.ready.push_back(a);
                return;
            }
        };
        let Some(cur) = self.current.take() else {
            return;
        };
        let (done, rest) = stored_part(cur.msgs, tail.as_ref());
        for q in done {
            self.ready.push_back(Ack {
                ticket: q.ticket,
                commit_micros: q.commit_micros,
                result: Ok(true),
            });
        }
        if rest.is_empty() {
            self.current_bytes = 0;
        } else {
            self.current_bytes = rest.iter().map(|q| q.msg.wire_size()).sum();
            let b = self.in_flight_batch(rest);
            self.current = Some(b);
        }
    }

    fn failed(&mut self, e: Error) -> Ack {
        let ticket = self
            .current
            .as_ref()
            .and_then(|c| c.msgs.first())
            .map_or(0, |q| q.ticket);
        Ack {
            ticket,
            commit_micros: 0,
            result: Err(e),
        }
    }
}

/// What the head of the queue makes now, if anything: `runs` are the
/// queued transactions in order, `sizes` their messages' sizes in order.
fn plan(
    runs: &VecDeque<Run>,
    sizes: impl Iterator<Item = usize>,
    max_batch: usize,
    max_batch_bytes: usize,
) -> Option<Plan> {
    let head = runs.front()?;
    let fits = |len: usize, bytes: usize| len <= max_batch && bytes <= max_batch_bytes;
    if head.batches_sent == 0 && head.complete && fits(head.len, head.bytes) {
        let (mut n, mut len, mut bytes) = (0, 0, 0);
        for r in runs.iter().take_while(|r| r.complete) {
            if !fits(len + r.len, bytes + r.bytes) {
                break;
            }
            n += 1;
            len += r.len;
            bytes += r.bytes;
        }
        return Some(Plan::Whole { runs: n, len });
    }
    if head.complete && head.batches_sent > 0 && fits(head.len, head.bytes) {
        return Some(Plan::Part {
            len: head.len,
            number: head.batches_sent + 1,
            last: true,
        });
    }
    // An open transaction is cut only when it must be: a full batch, or
    // the byte window. (Checked first: this runs on every poll while a
    // large transaction is read.)
    let must = head.complete || head.len > max_batch || head.bytes > max_batch_bytes;
    if !must {
        return None;
    }
    // A part: as many as fit, and of an open transaction never all
    // (its last batch must be the one sent at its commit).
    let keep = usize::from(!head.complete);
    let (mut len, mut bytes) = (0, 0);
    for size in sizes.take(head.len.saturating_sub(keep)) {
        if len > 0 && !fits(len + 1, bytes + size) {
            break;
        }
        len += 1;
        bytes += size;
    }
    if len == 0 {
        return None;
    }
    if head.batches_sent == 0 && head.complete && len == head.len {
        // One message over the byte bound: whole, alone.
        return Some(Plan::Whole { runs: 1, len });
    }
    Some(Plan::Part {
        len,
        number: head.batches_sent + 1,
        last: head.complete && len == head.len,
    })
}

/// What of an unanswered batch the stream holds, by the newest message of
/// this source it stores: a message of the batch, that very one by id, and
/// then everything before it too (a batch is stored whole or not at all; a
/// per-event fallback may have stored a prefix). A tail past the batch that
/// is none of its messages is another WAL history's (a disk-snapshot
/// restore reuses positions): nothing of the batch is stored.
fn stored_part(msgs: Vec<Queued>, tail: Option<&Tail>) -> (Vec<Queued>, Vec<Queued>) {
    let upto = tail.and_then(|t| {
        msgs.iter()
            .position(|q| q.pos == t.at && q.msg.msg_id == t.id)
    });
    let mut msgs = msgs;
    match upto {
        Some(i) => {
            let rest = msgs.split_off(i + 1);
            (msgs, rest)
        }
        None => (Vec::new(), msgs),
    }
}

/// No answer that says what happened to the batch.
fn uncertain(e: &PublishError) -> bool {
    matches!(
        e.kind(),
        PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
            | PublishErrorKind::StreamNotFound
    )
}

fn api_code(e: &PublishError) -> Option<u64> {
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>())?;
    Some(api.error_code().0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(len: usize, complete: bool, batches_sent: u32) -> Run {
        Run {
            commit_lsn: Lsn(0),
            len,
            bytes: len * 100,
            complete,
            batches_sent,
        }
    }

    /// Messages of 100 bytes; batches of at most 10 and 1,000 bytes.
    fn plan_of(runs: &[Run]) -> Option<Plan> {
        let runs: VecDeque<Run> = runs.iter().copied().collect();
        let total: usize = runs.iter().map(|r| r.len).sum();
        plan(&runs, std::iter::repeat_n(100, total), 10, 1000)
    }

    #[test]
    fn whole_transactions_share_a_batch_up_to_the_limit() {
        assert_eq!(
            plan_of(&[run(3, true, 0), run(4, true, 0), run(5, false, 0)]),
            Some(Plan::Whole { runs: 2, len: 7 })
        );
        assert_eq!(
            plan_of(&[run(6, true, 0), run(6, true, 0)]),
            Some(Plan::Whole { runs: 1, len: 6 })
        );
        assert_eq!(
            plan_of(&[run(10, true, 0), run(1, true, 0)]),
            Some(Plan::Whole { runs: 1, len: 10 })
        );
    }

    #[test]
    fn an_open_transaction_waits_for_its_commit_while_it_fits() {
        assert_eq!(plan_of(&[run(1, false, 0)]), None);
        assert_eq!(plan_of(&[run(9, false, 0)]), None);
        assert_eq!(plan_of(&[]), None);
    }

    #[test]
    fn an_open_transaction_over_the_limit_is_cut_and_keeps_one_back() {
        // Exactly a batch's worth still fits whole: it waits for its commit.
        assert_eq!(plan_of(&[run(10, false, 0)]), None);
        // Over the limit: cut, but its last message stays for the batch
        // that will know it is the last.
        assert_eq!(
            plan_of(&[run(11, false, 0)]),
            Some(Plan::Part {
                len: 10,
                number: 1,
                last: false
            })
        );
        assert_eq!(
            plan_of(&[run(25, false, 2)]),
            Some(Plan::Part {
                len: 10,
                number: 3,
                last: false
            })
        );
    }

    #[test]
    fn a_large_complete_transaction_goes_in_numbered_parts_the_last_marked() {
        assert_eq!(
            plan_of(&[run(25, true, 0), run(1, true, 0)]),
            Some(Plan::Part {
                len: 10,
                number: 1,
                last: false
            })
        );
        assert_eq!(
            plan_of(&[run(5, true, 2), run(1, true, 0)]),
            Some(Plan::Part {
                len: 5,
                number: 3,
                last: true
            })
        );
    }

    #[test]
    fn a_message_over_the_byte_bound_goes_alone() {
        let runs: VecDeque<Run> = [Run {
            bytes: 5000,
            ..run(1, true, 0)
        }]
        .into_iter()
        .collect();
        assert_eq!(
            plan(&runs, [5000].into_iter(), 10, 1000),
            Some(Plan::Whole { runs: 1, len: 1 })
        );
        // Open, it waits for a second message (or its commit).
        let runs: VecDeque<Run> = [Run {
            bytes: 5000,
            ..run(1, false, 0)
        }]
        .into_iter()
        .collect();
        assert_eq!(plan(&runs, [5000].into_iter(), 10, 1000), None);
    }

    fn queued(lsn: u64, index: u32, id: &str) -> Queued {
        Queued {
            ticket: lsn,
            commit_micros: 0,
            pos: Position {
                commit_lsn: Lsn(lsn),
                index,
            },
            msg: OutMessage {
                subject: "s".into(),
                msg_id: id.into(),
                headers: Vec::new(),
                body: bytes::Bytes::new(),
                dlq_reason: None,
                stream: None,
            },
        }
    }

    fn tail(lsn: u64, index: u32, id: &str) -> Tail {
        Tail {
            at: Position {
                commit_lsn: Lsn(lsn),
                index,
            },
            id: id.into(),
            seq: 9,
            txn_batch: None,
        }
    }

    #[test]
    fn an_unanswered_batch_is_stored_only_as_far_as_its_own_ids_show() {
        let batch = || vec![queued(5, 0, "a"), queued(5, 1, "b"), queued(6, 0, "c")];
        let ids = |q: &[Queued]| q.iter().map(|q| q.msg.msg_id.clone()).collect::<Vec<_>>();
        // The tail is the batch's last message: all of it.
        let (done, rest) = stored_part(batch(), Some(&tail(6, 0, "c")));
        assert_eq!(
            (ids(&done), ids(&rest).len()),
            (
                vec!["a", "b", "c"].into_iter().map(String::from).collect(),
                0
            )
        );
        // A prefix a per-event fallback stored.
        let (done, rest) = stored_part(batch(), Some(&tail(5, 1, "b")));
        assert_eq!((done.len(), ids(&rest)), (2, vec!["c".to_owned()]));
        // Past the batch, or at its position under another id: another WAL
        // history's message, nothing of this batch.
        for t in [tail(7, 0, "x"), tail(6, 0, "x"), tail(4, 0, "x")] {
            let (done, rest) = stored_part(batch(), Some(&t));
            assert_eq!((done.len(), rest.len()), (0, 3), "{t:?}");
        }
        let (done, rest) = stored_part(batch(), None);
        assert_eq!((done.len(), rest.len()), (0, 3));
    }
}
