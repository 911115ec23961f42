//! One job of the [`scheduler`](super::scheduler), start to finish: inbox
//! claim (dedupe) → handler → inbox completion → ACK; or park the message
//! in the inbox (ACK) until its backoff passed; or dead-letter it, acking
//! only once the DLQ stored it (SPEC §6). A parked message is read back from
//! the stream by its sequence when its turn comes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream, AckKind};
use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::config::ConsumeConfig;
use super::dead_letter::{self, DeadLetters};
use super::handler::{self, Delivery, Handler, Outcome};
use super::inbox::{self, Claim};
use super::lease::Proof;
use super::scheduler::{Finished, Job};
use super::transaction::{self, Ran, Transactions};
use crate::backoff::Backoff;
use crate::metrics as m;
use crate::schema::{Schemas, Verdict};
use crate::wire::{self, DlqReason};

/// What to do with a delivery once the handler answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Ack,
    DeadLetter(String),
    Nak(Duration),
}

/// SPEC §6's table. Pure, so the table is tested as a table.
pub fn decide(outcome: &Outcome, delivered: i64, max_deliver: i64, backoff: &[Duration]) -> Action {
    match outcome {
        Outcome::Processed => Action::Ack,
        Outcome::Reject(reason) => Action::DeadLetter(reason.clone()),
        Outcome::Retry(reason) if max_deliver > 0 && delivered >= max_deliver => {
            Action::DeadLetter(format!("last delivery ({delivered}) failed: {reason}"))
        }
        Outcome::Retry(_) => Action::Nak(backoff_after(
            backoff,
            i32::try_from(delivered).unwrap_or(i32::MAX),
        )),
    }
}

pub(super) struct Shared<H> {
    pub pool: PgPool,
    pub handler: std::sync::Arc<H>,
    pub dlq: DeadLetters,
    pub cfg: ConsumeConfig,
    /// The events stream, to read parked messages back.
    pub stream: jetstream::stream::Stream,
    /// Ends every job's waiting (shutdown, or this instance lost its lease).
    pub stop: CancellationToken,
    /// Whether this process may start a handler call for these jobs now:
    /// the lease's proof for the dispatcher's own jobs, the dispatcher's
    /// acknowledgements and the member lock for a helper's. Read right
    /// before each call, so a process that thaws after a freeze, or whose
    /// right lapsed while a job waited, calls nothing.
    pub proof: Proof,
    /// Cuts the handler calls in flight (a process cut off from the crew).
    pub calls: Calls,
    /// Dead letters that could not be stored yet, for `/readyz`.
    pub dlq_failing: std::sync::Arc<AtomicUsize>,
    /// Claims and completions of detached (HTTP) calls, batched.
    pub batcher: inbox::Batcher,
    /// Group transactions for a handler that runs inside one.
    pub transactions: Option<Transactions>,
    /// At a helper: the crew's recorders, and until when its member lock
    /// is proven (see [`persist_here`] and [`Recorder`]).
    pub helper: Option<Helper>,
}

/// How long a helper cut off from Postgres (its member lock unproven) waits
/// for an inbox write before it gives the job up: one that has not called
/// its handler is handed back (the dispatcher runs it again, in order); a
/// success whose completion Postgres does not take is recorded by another
/// process of the crew. So such a helper gives up its work within seconds,
/// and no call that succeeded is made again.
pub(super) const HANDOFF_AFTER: Duration = Duration::from_secs(5);

/// What a helper's jobs need beyond the dispatcher's.
pub(super) struct Helper {
    pub recorder: Recorder,
    /// Renewed by the crew's beats at each good check of the member lock:
    /// while it holds, Postgres answers this process.
    pub member: Proof,
}

/// Asks the crew (any process that reaches Postgres) to record a success
/// this process cannot: a request on `{crew}.record`, answered once the
/// inbox row says processed.
pub(super) struct Recorder {
    pub client: async_nats::Client,
    pub subject: String,
}

impl Recorder {
    /// Whether another process recorded `id` as processed.
    async fn record(&self, id: Uuid) -> bool {
        let ask = self
            .client
            .request(self.subject.clone(), id.to_string().into());
        matches!(
            tokio::time::timeout(HANDOFF_AFTER, ask).await,
            Ok(Ok(reply)) if reply.payload.as_ref() == RECORDED
        )
    }
}

/// The answer to a request to record a success: it is recorded.
pub(super) const RECORDED: &[u8] = b"recorded";

/// Whose jobs a [`Shared`] runs.
pub(super) enum Role {
    /// The dispatcher's own, while its lease's proof holds.
    Dispatcher(Proof),
    /// Jobs other processes' dispatchers send; the proof is renewed by the
    /// crew's beats (see `crew::work`).
    Helper(Recorder),
}

/// The handler calls of jobs started so far, to be cut at once: each job
/// takes the token current when it starts, and a cut replaces it. A cut is
/// a fence: a job started before it never calls its handler after it, even
/// once the process may start calls again (a job admitted before a lapse
/// may have been taken for lost meanwhile), while jobs started later are
/// not cut with them.
#[derive(Default)]
pub(super) struct Calls {
    current: std::sync::Mutex<CancellationToken>,
}

impl Calls {
    pub fn token(&self) -> CancellationToken {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn cut(&self) {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        current.cancel();
        *current = CancellationToken::new();
    }
}

pub(super) fn header(msg: &jetstream::Message, name: &HeaderName) -> Option<String> {
    msg.headers
        .as_ref()
        .and_then(|h| h.get(name.clone()))
        .map(|v| v.as_str().to_owned())
}

/// The headers a delivery reads, named once: `HeaderMap::get` given a
/// `&str` checks the name and copies it into a new one on every call, a
/// dozen allocations per message. A clone of these copies nothing.
pub(super) mod names {
    use crate::wire;
    use async_nats::HeaderName;

    macro_rules! names {
        ($($name:ident),* $(,)?) => {
            $(pub static $name: HeaderName = HeaderName::from_static(wire::$name);)*
        };
    }

    names!(
        AGGREGATE_ID,
        CAUSATION_ID,
        CORRELATION_ID,
        ENVELOPE,
        EVENT_TYPE,
        EVENT_VERSION,
        MSG_ID,
        OCCURRED_AT,
        REPLAY_FOR,
        REPLAY_OF,
        TRACEPARENT,
    );
}

fn count(result: &'static str) {
    metrics::counter!(m::CONSUMER_MESSAGES, "result" => result).increment(1);
}

/// The longest pause between attempts at a write that must happen (an inbox
/// row, a dead letter): the job keeps its place and retries until it works.
const MAX_PERSIST_BACKOFF: Duration = Duration::from_secs(10);

/// Run one job of the scheduler to its end. A pulled message is acked only
/// after its outcome is in the inbox (or the DLQ), and kept alive with
/// progress acks meanwhile. `None`: cut short (the consumer stops, or this
/// process may no longer start work, see [`Shared::proof`]) before its
/// outcome was settled; the caller handles it as a panicked job.
pub(super) async fn run_job<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    job: Job<jetstream::Message>,
    fence: &CancellationToken,
) -> Option<Finished<Instant>> {
    if let Job::Deliver(msg) | Job::ParkBehind(msg) | Job::Spill(msg) | Job::Check(msg) = &job {
        if header(msg, &names::REPLAY_FOR).is_some_and(|d| d != shared.cfg.durable) {
            // Another durable's replayed dead letter: not ours to handle,
            // nor to park.
            count("skipped");
            let how = match job {
                Job::Spill(_) => Finished::Spilled { seq: None },
                // Its key's parked state is still what the check is for.
                Job::Check(_) => match parked_head(shared, key).await? {
                    Some((seq, wait, _)) => Finished::Parked {
                        seq,
                        due: Instant::now() + wait,
                    },
                    None => Finished::Done,
                },
                _ => Finished::Done,
            };
            return settle_pulled(shared, msg, Some(how)).await;
        }
    }
    match job {
        Job::Spill(msg) => {
            let outcome =
                keep_alive(shared, &msg, std::pin::pin!(park_behind(shared, key, &msg))).await;
            match settle_pulled(shared, &msg, outcome).await? {
                // Parked: the key goes on from it once its running job ends.
                Finished::Parked { seq, .. } => Some(Finished::Spilled { seq: Some(seq) }),
                _ => Some(Finished::Spilled { seq: None }),
            }
        }
        Job::Deliver(ref msg) | Job::Check(ref msg) => {
            use futures::future::Either;
            let work = match job {
                Job::Deliver(_) => Either::Left(deliver_pulled(shared, key, msg, fence)),
                _ => Either::Right(check_parked(shared, key, msg, fence)),
            };
            let outcome = keep_alive(shared, msg, std::pin::pin!(work)).await;
            settle_pulled(shared, msg, outcome).await
        }
        Job::ParkBehind(msg) => {
            let outcome =
                keep_alive(shared, &msg, std::pin::pin!(park_behind(shared, key, &msg))).await;
            // Behind the key's parked head, or, when JetStream delivers an
            // older message again after a reset (a crash while it ran),
            // ahead of it: the scheduler keeps the oldest.
            settle_pulled(shared, &msg, outcome).await
        }
        Job::Retry { seq } => retry(shared, key, seq, fence).await,
    }
}

/// Ack what is settled. A job cut short NAKs, so JetStream delivers the
/// message again at once, unless this process may no longer start work:
/// the message is the next dispatcher's then, and a NAK would only send it
/// a second copy.
async fn settle_pulled<H>(
    shared: &Shared<H>,
    msg: &jetstream::Message,
    outcome: Option<Finished<Instant>>,
) -> Option<Finished<Instant>> {
    match outcome {
        Some(finished) => {
            // A lost ack means a redelivery, which the inbox answers.
            if let Err(e) = msg.ack().await {
                tracing::warn!(error = %e, "ack failed; the message will be redelivered");
            }
            Some(finished)
        }
        None => {
            if shared.proof.holds() {
                let _ = msg.ack_with(AckKind::Nak(None)).await;
            }
            None
        }
    }
}

/// Progress acks while `work` runs: a slow handler or a retried write keeps
/// its delivery instead of passing `ack_wait`.
///
/// `work` comes pinned by the caller: pinned here, it would be stored
/// twice in this future (the argument and the pinned copy), and the job's
/// future, boxed and copied once per message, with it.
async fn keep_alive<H, T>(
    shared: &Shared<H>,
    msg: &jetstream::Message,
    mut work: std::pin::Pin<&mut impl std::future::Future<Output = T>>,
) -> T {
    // Starting a period from now, not with `interval`'s immediate first
    // tick: that tick is a timer due within the millisecond, earlier than
    // any the driver sleeps to, so its registration wrote to the runtime's
    // eventfd on almost every message.
    let period = (shared.cfg.ack_wait / 3).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        tokio::select! {
            out = work.as_mut() => return out,
            _ = tick.tick() => { let _ = msg.ack_with(AckKind::Progress).await; }
        }
    }
}

/// Retry `op` until it works; `None` once the consumer stops.
async fn persist<H, T, E, F, Fut>(shared: &Shared<H>, what: &str, op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    persist_for(shared, what, op, false).await
}

/// [`persist`] for a write that may be given up with its job: at a helper
/// cut off from Postgres (its member lock unproven), `None` once it has
/// waited [`HANDOFF_AFTER`]; at a dispatcher, once its lease is gone.
/// Never for a write after a successful call.
async fn persist_here<H, T, E, F, Fut>(shared: &Shared<H>, what: &str, op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    persist_for(shared, what, op, true).await
}

async fn persist_for<H, T, E, F, Fut>(
    shared: &Shared<H>,
    what: &str,
    mut op: F,
    may_give_up: bool,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let give_up = async {
        if !may_give_up {
            return std::future::pending().await;
        }
        let Some(helper) = shared.helper.as_ref() else {
            // Cut from here on (the first poll, as the write starts), this
            // job calls nothing any more: its fence is this token, or an
            // older one already cut.
            let cut = shared.calls.token();
            // The dispatcher's own job, its lease gone (its period's
            // proof revoked, for good), or its calls cut (`Finishing`,
            // once another process may take over): it can call nothing
            // now (`may_call`). Handed back, it is reported and runs again
            // elsewhere; waiting, it would hold its aggregate (which the
            // next dispatcher adopts from this process's beats) for as
            // long as this process cannot reach Postgres.
            let lapsed = async {
                while !shared.proof.revoked() {
                    tokio::time::sleep(BEAT_CHECK).await;
                }
            };
            // Only a write Postgres does not answer: one that comes after
            // a failed call while the lease is handed on (a SIGTERM, its
            // Postgres fine) records its backoff.
            tokio::time::sleep(SLOW_WRITE).await;
            tokio::select! {
                () = cut.cancelled() => {}
                () = lapsed => {}
            }
            tracing::warn!(
                "{what} waits on Postgres, and this process no longer dispatches; handing the job back"
            );
            return;
        };
        tokio::time::sleep(HANDOFF_AFTER).await;
        // Postgres answers this process: a slow write is waited for (a
        // job handed back costs a reset to the ack floor).
        while helper.member.holds() {
            tokio::time::sleep(BEAT_CHECK).await;
        }
        tracing::warn!(
            "{what} waits on Postgres, which this process cannot reach; handing the job back"
        );
    };
    tokio::select! {
        done = persist_loop(shared, what, &mut op) => done,
        () = give_up => None,
    }
}

/// How long an ex-dispatcher's write waits before it may be given up.
const SLOW_WRITE: Duration = Duration::from_secs(1);

/// How often a helper's give-up looks at its member lock's proof again.
const BEAT_CHECK: Duration = Duration::from_millis(250);

async fn persist_loop<H, T, E, F, Fut>(shared: &Shared<H>, what: &str, op: &mut F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut backoff = Backoff::jittered(Duration::from_millis(100), MAX_PERSIST_BACKOFF);
    loop {
        let pause;
        match op().await {
            Ok(v) => return Some(v),
            Err(e) => {
                pause = backoff.next_pause();
                tracing::warn!(error = %e, retry_in = ?pause, "{what} failed; retrying");
            }
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return None,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// What the handler was given, from headers that a pulled or a read-back
/// message both carry.
struct Parts<'a> {
    subject: &'a str,
    headers: Option<&'a HeaderMap>,
    payload: &'a Bytes,
    seq: u64,
}

impl<'a> Parts<'a> {
    fn pulled(msg: &'a jetstream::Message) -> Self {
        Parts {
            subject: msg.subject.as_str(),
            headers: msg.headers.as_ref(),
            payload: &msg.payload,
            seq: msg.info().map(|i| i.stream_sequence).unwrap_or_default(),
        }
    }

    /// The id the handler is given and dead letters carry: the original's
    /// for a replayed dead letter, else `Nats-Msg-Id` (`wire::message_id`).
    fn id_text(&self) -> Option<String> {
        self.header(self.id_key().0)
            .and_then(|raw| wire::message_id(&raw))
            .map(|(_, text)| text)
    }

    /// The header that holds the id: a replayed dead letter carries its
    /// own `Nats-Msg-Id`; the inbox and the handler know it by the
    /// original's.
    fn id_key(&self) -> (&'static HeaderName, &'static str) {
        if self.header(&names::REPLAY_FOR).is_some() {
            (&names::REPLAY_OF, wire::REPLAY_OF)
        } else {
            (&names::MSG_ID, wire::MSG_ID)
        }
    }

    fn header(&self, name: &HeaderName) -> Option<String> {
        self.headers
            .and_then(|h| h.get(name.clone()))
            .map(|v| v.as_str().to_owned())
    }

    fn dead_letter(&self) -> dead_letter::Message<'_> {
        dead_letter::Message {
            subject: self.subject,
            headers: self.headers,
            payload: self.payload,
            seq: self.seq,
        }
    }

    fn delivery(&self, id: Uuid, attempts: i32) -> Delivery {
        Delivery {
            message_id: id,
            id: self.id_text().unwrap_or_else(|| id.to_string()),
            subject: self.subject.to_owned(),
            event_type: self.header(&names::EVENT_TYPE),
            event_version: self
                .header(&names::EVENT_VERSION)
                .and_then(|v| v.parse().ok()),
            occurred_at: self.header(&names::OCCURRED_AT),
            correlation_id: self.header(&names::CORRELATION_ID),
            causation_id: self.header(&names::CAUSATION_ID),
            traceparent: self
                .header(&names::TRACEPARENT)
                .filter(|t| wire::traceparent_valid(t)),
            payload: self.payload.clone(),
            delivered: i64::from(attempts),
        }
    }
}

/// Why a message cannot be handled at all, and its id when it has one.
struct Unusable {
    reason: String,
    id: Option<Uuid>,
}

/// The id, or why the message cannot be handled at all.
fn check(parts: &Parts<'_>, schemas: Option<&Schemas>) -> std::result::Result<Uuid, Unusable> {
    let (name, key) = parts.id_key();
    let id = match parts.header(name) {
        None => {
            return Err(Unusable {
                reason: format!("message has no {key}"),
                id: None,
            })
        }
        Some(raw) => match wire::message_id(&raw) {
            Some((id, _)) => id,
            None => {
                return Err(Unusable {
                    reason: format!("{key} {raw:?} is not a message id"),
                    id: None,
                })
            }
        },
    };
    if serde_json::from_slice::<serde::de::IgnoredAny>(parts.payload).is_err() {
        return Err(Unusable {
            reason: "body is not JSON".into(),
            id: Some(id),
        });
    }
    if let Some(live) = schemas {
        let schemas = live.current();
        let event_type = parts.header(&names::EVENT_TYPE).unwrap_or_default();
        let version = parts
            .header(&names::EVENT_VERSION)
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let verdict = if parts.header(&names::ENVELOPE).is_some() {
            schemas.check_enveloped(&event_type, version, parts.payload)
        } else {
            schemas.check(&event_type, version, parts.payload)
        };
        // The label is the type only when it has a schema (see
        // [`m::SCHEMA_FAILURES`]).
        let failure = match verdict {
            Verdict::Valid(_) => None,
            Verdict::Unchecked => {
                live.note_unchecked("consume", &event_type, version);
                None
            }
            Verdict::Invalid(_, detail) => Some((
                format!("{}: {detail}", DlqReason::SchemaInvalid.as_str()),
                event_type.clone(),
            )),
            Verdict::Missing => Some((
                format!(
                    "{}: no schema for {event_type} version {version}",
                    DlqReason::SchemaMissing.as_str()
                ),
                m::NO_SCHEMA_TYPE.to_owned(),
            )),
        };
        if let Some((reason, label)) = failure {
            metrics::counter!(m::SCHEMA_FAILURES, "stage" => "consume", "event_type" => label)
                .increment(1);
            return Err(Unusable {
                reason,
                id: Some(id),
            });
        }
    }
    Ok(id)
}

/// The id of a pulled message; one that cannot be handled is dead-lettered
/// here (`Some(None)`). `None` once the consumer stops.
async fn usable_id<H>(shared: &Shared<H>, parts: &Parts<'_>) -> Option<Option<Uuid>> {
    match check(parts, shared.cfg.schemas.as_deref()) {
        Ok(id) => Some(Some(id)),
        Err(u) => {
            unusable(shared, parts, u).await?;
            Some(None)
        }
    }
}

/// Dead-letter a message that cannot be handled; with an id, its inbox row
/// says why. No handler call.
async fn unusable<H>(shared: &Shared<H>, parts: &Parts<'_>, u: Unusable) -> Option<()> {
    // Without an id, the stream position stands in, so a redelivery dedupes.
    let stand_in =
        u.id.and_then(|_| parts.id_text())
            .unwrap_or_else(|| format!("{}:{}", shared.cfg.stream, parts.seq));
    dead_letter(shared, parts, &stand_in, &u.reason, 1).await?;
    if let Some(id) = u.id {
        persist(shared, "recording the dead letter", || {
            inbox::finish_failed(
                &shared.pool,
                &shared.cfg.durable,
                id,
                parts.subject,
                &u.reason,
                true,
            )
        })
        .await?;
    }
    Some(())
}

/// Whether this job may call its handler now: its process proves its
/// right, and the job was not cut. A lapsed proof is waited for while it
/// may come back (the lease's slow ping answered); a helper's lapse cuts
/// its jobs, which ends the wait.
async fn may_call<H>(shared: &Shared<H>, fence: &CancellationToken) -> bool {
    if fence.is_cancelled() {
        return false;
    }
    if shared.proof.holds() {
        return true;
    }
    tokio::select! {
        regained = shared.proof.regained() => regained && !fence.is_cancelled(),
        _ = fence.cancelled() => false,
    }
}

/// Claim, call the handler, complete: in one transaction for a handler
/// that needs it, else around a detached call. `parked`: the message is a
/// parked one coming up again (its row exists and is counted differently).
async fn run_handler<H: Handler>(
    shared: &Shared<H>,
    parts: &Parts<'_>,
    id: Uuid,
    parked: bool,
    fence: &CancellationToken,
) -> Option<Ran> {
    let cfg = &shared.cfg;
    let consumer = cfg.durable.as_str();
    // The Rust handler's paths are boxed: inline, their transactions made
    // every job's future (boxed and copied once per message, the HTTP
    // handler's too) 15 KB larger.
    if !may_call(shared, fence).await {
        return None;
    }
    if let (Some(group), false) = (&shared.transactions, parked) {
        let delivery = parts.delivery(id, 0);
        // Each try asks for the right to call again: a group that failed
        // (its transaction ended by the crew, which took the job for lost)
        // committed nothing, and its messages run elsewhere.
        return Box::pin(persist(shared, "the inbox transaction", || {
            let run = (shared.proof.holds() && !fence.is_cancelled())
                .then(|| group.run(delivery.clone(), parts.seq, fence.clone()));
            async move {
                match run {
                    Some(run) => run.await.map(Some),
                    None => Ok(None),
                }
            }
        }))
        .await
        .flatten();
    }
    if let Some(group) = shared.transactions.as_ref().filter(|_| parked) {
        // Cut, the transaction rolls back: nothing of the call is kept.
        let cut = fence;
        return Box::pin(async {
            tokio::select! {
                    ran = persist(shared, "the inbox transaction", || async {
                let mut tx = group.begin.begin().await?;
                let attempts = if parked {
                    match inbox::claim_parked(&mut *tx, consumer, id).await? {
                        Some(a) => a,
                        None => return Ok::<_, sqlx::Error>(Ran::Gone),
                    }
                } else {
                    match inbox::claim(
                        &mut *tx,
                        consumer,
                        id,
                        parts.subject,
                        parts.seq,
                        &cfg.stream,
                    )
                    .await?
                    {
                        Claim::Fresh { attempts } => attempts,
                        Claim::Processed => {
                            tx.commit().await?;
                            return Ok(Ran::Processed { duplicate: true });
                        }
                        Claim::Parked { seq, wait_ms } => {
                            tx.commit().await?;
                            return Ok(Ran::Parked { seq, wait_ms });
                        }
                    }
                };
                let delivery = parts.delivery(id, attempts);
                let outcome = handler::call(|| shared.handler.handle(&mut tx, &delivery)).await;
                let outcome = match outcome {
                    Outcome::Processed => match inbox::complete(&mut tx, consumer, id).await {
                        Ok(()) => {
                            return match tx.commit().await {
                                Ok(()) => Ok(Ran::Processed { duplicate: false }),
                                // Refused at the end (a deferred constraint the
                                // handler broke): a failed attempt, or the
                                // message would come back uncounted forever.
                                Err(e @ sqlx::Error::Database(_))
                                    if !transaction::connection_lost(&e) =>
                                {
                                    Ok(Ran::Failed {
                                    outcome: Outcome::Retry(format!(
                                        "its transaction failed to commit: {e}"
                                    )),
                                    attempts,
                                    counted: false,
                                })
                                }
                                Err(e) => Err(e),
                            };
                        }
                        // The handler swallowed an error of its transaction: its
                        // attempt failed, and counts (retrying the statement
                        // would fail the same way forever).
                        Err(e) if transaction::aborted(&e) => Outcome::Retry(format!(
                            "the handler answered processed but left its transaction failed: {e}"
                        )),
                        Err(e) => return Err(e),
                    },
                    other => other,
                };
                tx.rollback().await?;
                Ok(Ran::Failed {
                    outcome,
                    attempts,
                    counted: false,
                })
            }) => ran,
                    _ = cut.cancelled() => None,
                }
        })
        .await;
    }
    let attempts = if parked {
        match persist_here(shared, "the inbox claim", || {
            inbox::claim_parked(&shared.pool, consumer, id)
        })
        .await?
        {
            Some(a) => a,
            None => return Some(Ran::Gone),
        }
    } else {
        // Nothing called yet: handed back, it runs again elsewhere.
        match persist_here(shared, "the inbox claim", || {
            shared.batcher.claim(id, parts.subject, parts.seq)
        })
        .await?
        {
            Claim::Fresh { attempts } => attempts,
            Claim::Processed => return Some(Ran::Processed { duplicate: true }),
            Claim::Parked { seq, wait_ms } => return Some(Ran::Parked { seq, wait_ms }),
        }
    };
    // The claim may have waited (a batch, a retried write): the right to
    // call is checked again right before the call.
    if !may_call(shared, fence).await {
        return None;
    }
    let delivery = parts.delivery(id, attempts);
    let outcome = tokio::select! {
        outcome = handler::call(|| shared.handler.handle_detached(&delivery)) => outcome,
        _ = fence.cancelled() => return None,
    };
    if outcome != Outcome::Processed {
        return Some(Ran::Failed {
            outcome,
            attempts,
            counted: true,
        });
    }
    // The handler succeeded: never call it again for a failed commit.
    let complete = persist(shared, "the inbox completion", || {
        shared.batcher.complete(id)
    });
    let Some(helper) = shared.helper.as_ref() else {
        complete.await?;
        return Some(Ran::Processed { duplicate: false });
    };
    // At a helper cut off from Postgres, another process of the crew
    // records it; asked again until one does, or this one can. The job
    // stays listed meanwhile, its message unacked.
    let mut complete = std::pin::pin!(complete);
    loop {
        tokio::select! {
            done = &mut complete => {
                done?;
                break;
            }
            () = tokio::time::sleep(HANDOFF_AFTER) => {
                if !helper.member.holds() && helper.recorder.record(id).await {
                    tracing::info!(%id, "the handler succeeded; Postgres does not answer this process, and another process of the crew recorded it");
                    break;
                }
            }
        }
    }
    Some(Ran::Processed { duplicate: false })
}

/// A pulled message: handle it, or park it after a failure.
async fn deliver_pulled<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    msg: &jetstream::Message,
    fence: &CancellationToken,
) -> Option<Finished<Instant>> {
    let parts = Parts::pulled(msg);
    let Some(id) = usable_id(shared, &parts).await? else {
        return Some(Finished::Done);
    };
    match run_handler(shared, &parts, id, false, fence).await? {
        Ran::Processed { duplicate } => {
            count(if duplicate { "duplicate" } else { "processed" });
            Some(Finished::Done)
        }
        // Its backoff still runs: a redelivery does not cut it short.
        Ran::Parked { seq, wait_ms } => Some(Finished::Parked {
            seq: seq.and_then(|s| u64::try_from(s).ok()).unwrap_or(parts.seq),
            due: Instant::now() + Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0)),
        }),
        Ran::Gone => Some(Finished::Done),
        Ran::Failed {
            outcome,
            attempts,
            counted,
        } => after_failure(shared, key, &parts, id, outcome, attempts, counted).await,
    }
}

/// A failed attempt: dead-letter it (a rejection, or the last allowed
/// attempt), else park it until its backoff has passed.
async fn after_failure<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    parts: &Parts<'_>,
    id: Uuid,
    outcome: Outcome,
    attempts: i32,
    counted: bool,
) -> Option<Finished<Instant>> {
    let cfg = &shared.cfg;
    let count_attempt = !counted;
    match decide(&outcome, i64::from(attempts), cfg.max_deliver, &cfg.backoff) {
        Action::Ack => Some(Finished::Done),
        Action::DeadLetter(reason) => {
            let original = parts.id_text().unwrap_or_else(|| id.to_string());
            dead_letter(shared, parts, &original, &reason, attempts).await?;
            persist(shared, "recording the dead letter", || {
                inbox::finish_failed(
                    &shared.pool,
                    &cfg.durable,
                    id,
                    parts.subject,
                    &reason,
                    count_attempt,
                )
            })
            .await?;
            Some(Finished::Done)
        }
        Action::Nak(delay) => {
            let reason = match &outcome {
                Outcome::Retry(r) => r.as_str(),
                _ => "",
            };
            let parking = inbox::Parking {
                consumer: &cfg.durable,
                stream: &cfg.stream,
                id,
                subject: parts.subject,
                key,
                seq: parts.seq,
            };
            persist_here(shared, "parking the message", || {
                inbox::park(&shared.pool, &parking, delay, reason, count_attempt)
            })
            .await?;
            tracing::info!(%id, attempts, ?delay, reason, "handler failed; parked until its retry");
            count("retried");
            Some(Finished::Parked {
                seq: parts.seq,
                due: Instant::now() + delay,
            })
        }
    }
}

/// Publish to the DLQ until it is stored: a DLQ outage is a wait, shown on
/// `/readyz`, never a loss. `None` once the consumer stops.
async fn dead_letter<H>(
    shared: &Shared<H>,
    parts: &Parts<'_>,
    original_id: &str,
    reason: &str,
    attempts: i32,
) -> Option<()> {
    let mut backoff = Backoff::jittered(Duration::from_millis(200), MAX_PERSIST_BACKOFF);
    let mut failing = false;
    let began = Instant::now();
    let stored = loop {
        // Which dead-lettering of the message this is: a retried publish of
        // it must dedupe, a later one (after a reset or replay) must not.
        let generation = match wire::message_id(original_id) {
            Some((id, _)) => inbox::reopened(&shared.pool, &shared.cfg.durable, id)
                .await
                .map_err(crate::error::Error::pg(
                    "reading the inbox row to dead-letter it",
                )),
            None => Ok(0),
        };
        let published = match generation {
            Ok(generation) => {
                shared
                    .dlq
                    .publish(
                        &parts.dead_letter(),
                        original_id,
                        reason,
                        i64::from(attempts),
                        generation,
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        let pause;
        match published {
            Ok(()) => break true,
            Err(e) => {
                if !failing {
                    failing = true;
                    shared.dlq_failing.fetch_add(1, Ordering::Relaxed);
                }
                pause = backoff.next_pause();
                tracing::warn!(id = original_id, error = %e, retry_in = ?pause, "the dead-letter stream did not store the message; retrying");
            }
        }
        // A helper cut off from Postgres hands the job back (see
        // `persist_here`); a dead letter stored meanwhile dedupes.
        let cut_off = shared
            .helper
            .as_ref()
            .is_some_and(|h| !h.member.holds() && began.elapsed() >= HANDOFF_AFTER);
        if cut_off {
            break false;
        }
        tokio::select! {
            _ = shared.stop.cancelled() => break false,
            _ = tokio::time::sleep(pause) => {}
        }
    };
    if failing {
        shared.dlq_failing.fetch_sub(1, Ordering::Relaxed);
    }
    if !stored {
        return None;
    }
    tracing::warn!(id = original_id, reason, "dead-lettered");
    count("dead_lettered");
    Some(())
}

/// A pulled message of a key the dispatcher holds no parked state for while
/// some keys are parked in the inbox only: parked behind them if its key is
/// one (the dispatcher learns the key's head), else delivered.
async fn check_parked<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    msg: &jetstream::Message,
    fence: &CancellationToken,
) -> Option<Finished<Instant>> {
    let Some((head, wait, _)) = parked_head(shared, key).await? else {
        return deliver_pulled(shared, key, msg, fence).await;
    };
    let parked = park_behind(shared, key, msg).await?;
    let seq = Parts::pulled(msg).seq;
    Some(match parked {
        // Older than the head (delivered again after a reset): it leads.
        Finished::Parked { .. } if seq < head => Finished::Parked {
            seq,
            due: Instant::now(),
        },
        _ => Finished::Parked {
            seq: head,
            due: Instant::now() + wait,
        },
    })
}

/// A pulled message of an aggregate with parked messages waits behind them.
async fn park_behind<H>(
    shared: &Shared<H>,
    key: &str,
    msg: &jetstream::Message,
) -> Option<Finished<Instant>> {
    let parts = Parts::pulled(msg);
    let Some(id) = usable_id(shared, &parts).await? else {
        return Some(Finished::Done);
    };
    let parking = inbox::Parking {
        consumer: &shared.cfg.durable,
        stream: &shared.cfg.stream,
        id,
        subject: parts.subject,
        key,
        seq: parts.seq,
    };
    let parked = persist_here(shared, "parking the message", || {
        inbox::park_behind(&shared.pool, &parking)
    })
    .await?;
    // Parked (reported with its sequence), or processed already.
    Some(if parked {
        Finished::Parked {
            seq: parts.seq,
            due: Instant::now(),
        }
    } else {
        Finished::Done
    })
}

/// The oldest parked message of `key` comes up: read it back from the stream
/// and run it. `None` once the consumer stops.
async fn retry<H: Handler>(
    shared: &Shared<H>,
    key: &str,
    seq: u64,
    fence: &CancellationToken,
) -> Option<Finished<Instant>> {
    let consumer = shared.cfg.durable.as_str();
    let Some((row_id, row_subject, attempts, last_error)) =
        persist_here(shared, "reading a parked row", || {
            inbox::parked_id(&shared.pool, consumer, &shared.cfg.stream, key, seq)
        })
        .await?
    else {
        // Done with meanwhile.
        return Some(Finished::Retried {
            next: next_parked(shared, key).await?,
        });
    };
    let mut backoff = Backoff::jittered(Duration::from_millis(100), MAX_PERSIST_BACKOFF);
    let raw = loop {
        let pause;
        match shared.stream.get_raw_message(seq).await {
            Ok(m) => break Some(m),
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) => {
                break None
            }
            Err(e) => {
                pause = backoff.next_pause();
                tracing::warn!(seq, error = %e, retry_in = ?pause, "cannot read a parked message back; retrying");
            }
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return None,
            _ = tokio::time::sleep(pause) => {}
        }
    };
    let parts = raw.as_ref().map(|raw| Parts {
        subject: raw.subject.as_str(),
        headers: Some(&raw.headers),
        payload: &raw.payload,
        seq,
    });
    // The stream must still hold this very message: it may have aged out,
    // or the stream been recreated with other messages at that sequence.
    // It passed its schema when first delivered: only its id is checked.
    let id = match parts.as_ref().map(|p| check(p, None)) {
        Some(Ok(id)) if id == row_id => id,
        found => {
            let why = match found {
                None => "left the stream before its retry (max age or limits)",
                _ => "the stream holds another message at its sequence now",
            };
            // Never dropped: dead-lettered from what the inbox row keeps
            // (its body and headers went with the stream).
            let reason = format!(
                "expired: {why}; last error: {}",
                last_error.as_deref().unwrap_or("none")
            );
            tracing::error!(id = %row_id, seq, why, "a parked message cannot be read back; dead-lettering it from its inbox row");
            count("expired");
            let empty = Bytes::new();
            // Said so, for `dlq replay`: there is no body to replay.
            let mut omitted = HeaderMap::new();
            omitted.insert(wire::DLQ_PAYLOAD_OMITTED, wire::EXPIRED);
            let letter = Parts {
                subject: &row_subject,
                headers: Some(&omitted),
                payload: &empty,
                seq,
            };
            dead_letter(shared, &letter, &row_id.to_string(), &reason, attempts).await?;
            persist_here(shared, "recording the expired message", || {
                inbox::finish_failed(&shared.pool, consumer, row_id, &row_subject, &reason, false)
            })
            .await?;
            return Some(Finished::Retried {
                next: next_parked(shared, key).await?,
            });
        }
    };
    let parts = parts?;
    match run_handler(shared, &parts, id, true, fence).await? {
        Ran::Processed { duplicate } => {
            count(if duplicate { "duplicate" } else { "processed" });
        }
        Ran::Parked { .. } | Ran::Gone => {}
        Ran::Failed {
            outcome,
            attempts,
            counted,
        } => {
            if let Some(parked @ Finished::Parked { .. }) =
                after_failure(shared, key, &parts, id, outcome, attempts, counted).await
            {
                return Some(parked);
            }
        }
    }
    Some(Finished::Retried {
        next: next_parked(shared, key).await?,
    })
}

/// The key's oldest parked message, if any: its sequence, how long until it
/// is due, its attempts (`None` once the consumer stops).
pub(super) async fn parked_head<H>(
    shared: &Shared<H>,
    key: &str,
) -> Option<Option<(u64, Duration, i32)>> {
    persist_here(shared, "reading the key's parked messages", || {
        inbox::parked_head(&shared.pool, &shared.cfg.durable, &shared.cfg.stream, key)
    })
    .await
}

/// The retry delay after `attempts` attempts (`--backoff`).
pub(super) fn backoff_after(shared_backoff: &[Duration], attempts: i32) -> Duration {
    let i = usize::try_from(attempts.max(1) - 1).unwrap_or(usize::MAX);
    shared_backoff
        .get(i)
        .or(shared_backoff.last())
        .copied()
        .unwrap_or(Duration::from_secs(1))
}

/// How long a message may wait parked over all its retries: the backoff
/// after each attempt but the last (`max_deliver` below 1: unbounded, the
/// longest step counted once, as the least that must fit).
pub(super) fn longest_parked(backoff: &[Duration], max_deliver: i64) -> Duration {
    if max_deliver < 1 {
        return backoff.iter().max().copied().unwrap_or_default();
    }
    let waits = i32::try_from(max_deliver - 1).unwrap_or(i32::MAX);
    (1..=waits).map(|a| backoff_after(backoff, a)).sum()
}

/// The key's oldest parked message, if any (`None` once the consumer stops).
async fn next_parked<H>(shared: &Shared<H>, key: &str) -> Option<Option<u64>> {
    Some(parked_head(shared, key).await?.map(|(seq, ..)| seq))
}

/// The processing state a job needs, one per dispatcher period and one for
/// the jobs the crew sends this process.
#[allow(clippy::too_many_arguments)]
pub(super) fn new_shared<H: Handler>(
    cfg: &ConsumeConfig,
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    dlq: &DeadLetters,
    handler: std::sync::Arc<H>,
    stop: CancellationToken,
    role: Role,
    member: i32,
) -> std::sync::Arc<Shared<H>> {
    let (proof, helper) = match role {
        Role::Dispatcher(proof) => (proof, None),
        Role::Helper(recorder) => (
            Proof::default(),
            Some(Helper {
                recorder,
                member: Proof::default(),
            }),
        ),
    };
    std::sync::Arc::new(Shared {
        pool: pool.clone(),
        handler: handler.clone(),
        dlq: dlq.clone(),
        cfg: cfg.clone(),
        stream: stream.clone(),
        stop,
        proof,
        calls: Default::default(),
        dlq_failing: Default::default(),
        helper,
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
                    member,
                    workers,
                    max_group,
                },
            )
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names a delivery looks headers up by are the ones async-nats
    /// makes of what it reads off the wire (`HeaderName::from_str`).
    #[test]
    fn header_names_match_the_wire() {
        use std::str::FromStr;
        for (name, text) in [
            (&names::AGGREGATE_ID, wire::AGGREGATE_ID),
            (&names::CAUSATION_ID, wire::CAUSATION_ID),
            (&names::CORRELATION_ID, wire::CORRELATION_ID),
            (&names::ENVELOPE, wire::ENVELOPE),
            (&names::EVENT_TYPE, wire::EVENT_TYPE),
            (&names::EVENT_VERSION, wire::EVENT_VERSION),
            (&names::MSG_ID, wire::MSG_ID),
            (&names::OCCURRED_AT, wire::OCCURRED_AT),
            (&names::REPLAY_FOR, wire::REPLAY_FOR),
            (&names::REPLAY_OF, wire::REPLAY_OF),
            (&names::TRACEPARENT, wire::TRACEPARENT),
        ] {
            assert_eq!(name, &HeaderName::from_str(text).unwrap(), "{text}");
            let mut map = HeaderMap::new();
            map.insert(text, "v");
            assert!(map.get(name.clone()).is_some(), "{text}");
        }
    }

    const B: [Duration; 3] = [
        Duration::from_secs(1),
        Duration::from_secs(5),
        Duration::from_secs(30),
    ];

    #[test]
    fn a_message_may_wait_parked_for_every_backoff_but_the_last_attempts() {
        let s = Duration::from_secs;
        assert_eq!(longest_parked(&B, 1), s(0), "one attempt: never parked");
        assert_eq!(longest_parked(&B, 3), s(6));
        assert_eq!(longest_parked(&B, 5), s(1 + 5 + 30 + 30));
        assert_eq!(longest_parked(&B, -1), s(30), "unbounded: the longest step");
    }

    #[test]
    fn spec_table() {
        assert_eq!(decide(&Outcome::Processed, 1, 20, &B), Action::Ack);
        assert_eq!(
            decide(&Outcome::Reject("bad".into()), 1, 20, &B),
            Action::DeadLetter("bad".into())
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 1, 20, &B),
            Action::Nak(B[0])
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 2, 20, &B),
            Action::Nak(B[1])
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 9, 20, &B),
            Action::Nak(B[2])
        );
        assert!(matches!(
            decide(&Outcome::Retry("500".into()), 20, 20, &B),
            Action::DeadLetter(r) if r.contains("last delivery")
        ));
        assert_eq!(
            decide(&Outcome::Retry("x".into()), 99, -1, &B),
            Action::Nak(B[2]),
            "unlimited"
        );
        assert_eq!(
            decide(&Outcome::Processed, 20, 20, &B),
            Action::Ack,
            "success on the last try"
        );
    }
}
