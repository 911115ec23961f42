//! The inbox transactions of a handler that runs inside them (the Rust
//! trait), shared: up to [`MAX_GROUP`] messages of different aggregates
//! commit together, each handler call in a savepoint of its own.
//!
//! One transaction per message made Postgres the consumer's limit: a begin,
//! a claim, a completion and a commit for every message, at 2,200-2,400
//! messages/s with Postgres at 143 % CPU and the consumer at 59 %. A group
//! pays for the claim, the completion and the commit once.
//!
//! What a message gets is unchanged: its claim, its handler's writes and its
//! completion commit together or not at all. A handler that fails (or
//! panics, or answers processed on a failed transaction) rolls back to its
//! savepoint, so only its writes are undone; its claim (the attempt it
//! counted) commits with the group. A group Postgres refuses (a deferred
//! constraint at commit, a deadlock between groups) runs again one message
//! per transaction, so the message at fault fails its own attempt and the
//! others go through; a group cut off (a lost connection) fails every
//! message in it, and each is run again, nothing of it having committed.
//!
//! The calls of a group run one after another: a slow call delays the
//! others in its group, and what a call leaves in the transaction beyond
//! its writes (row locks, `SET LOCAL`) lasts until the group commits.

use std::collections::HashSet;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::handler::{self, Delivery, Handler, Outcome};
use super::inbox::{self, BatchError, Claim};

pub use super::handler::MAX_GROUP;

/// What running the handler came to, before it is settled.
#[derive(Debug)]
pub(super) enum Ran {
    /// Processed (by this call, or before: `duplicate`).
    Processed { duplicate: bool },
    /// Parked already (a redelivery after a reset), for `wait_ms` more.
    Parked { seq: Option<i64>, wait_ms: i64 },
    /// The handler did not succeed. `counted`: the attempt is in the inbox
    /// row (its claim committed).
    Failed {
        outcome: Outcome,
        attempts: i32,
        counted: bool,
    },
    /// Processed meanwhile, or gone (a retry only).
    Gone,
}

/// Requests queued at most: one per running job, so `--concurrency` bounds
/// it in practice; each holds one message's delivery.
const QUEUE: usize = 256;

struct Request {
    delivery: Delivery,
    seq: u64,
    /// The job's right to call, as it stood when queued: a request whose
    /// job was cut meanwhile (its process fenced) is answered without a
    /// call.
    fence: CancellationToken,
    reply: oneshot::Sender<Result<Ran, BatchError>>,
}

/// Handle on the group writers. Dropped (the consumer has stopped), it
/// stops them, a group in progress included: its transaction rolls back and
/// its messages come again. Left running, a writer would go on calling the
/// handler, queued requests too, after `consumer::run` had returned.
pub struct Transactions {
    requests: mpsc::Sender<Request>,
    /// For a parked message's transaction, which runs alone.
    pub(super) begin: Arc<Begin>,
    /// Dropped with the handle, a `JoinSet` aborts its tasks.
    _writers: tokio::task::JoinSet<()>,
}

impl Transactions {
    /// `workers` transactions run at once, each on a connection of `pool`.
    pub fn start<H: Handler>(pool: PgPool, handler: Arc<H>, settings: Settings) -> Self {
        let (requests, rx) = mpsc::channel(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let workers = settings.workers.max(1);
        let begin = Arc::new(Begin {
            pool: pool.clone(),
            name: mark_name(&settings.stream, &settings.consumer),
            mark: tokio::sync::OnceCell::new(),
            member: settings.member,
            call_timeout: handler.call_timeout(),
        });
        let ctx = Arc::new(Context {
            handler,
            consumer: settings.consumer,
            stream: settings.stream,
            max_group: settings.max_group.clamp(1, MAX_GROUP),
            begin: begin.clone(),
        });
        let mut writers = tokio::task::JoinSet::new();
        for _ in 0..workers {
            writers.spawn(work(ctx.clone(), rx.clone()));
        }
        Self {
            requests,
            begin,
            _writers: writers,
        }
    }

    /// Claim, handle and complete `delivery` (its `delivered` is set from
    /// the claim) in the next group transaction.
    pub async fn run(
        &self,
        delivery: Delivery,
        seq: u64,
        fence: CancellationToken,
    ) -> Result<Ran, BatchError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || BatchError("the inbox transaction writer stopped".into());
        self.requests
            .send(Request {
                delivery,
                seq,
                fence,
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// Who the transactions are for, and how many run at once.
pub struct Settings {
    pub consumer: String,
    pub stream: String,
    /// This process's crew member id: its transactions carry it as a mark
    /// (see [`mark_name`]).
    pub member: i32,
    pub workers: usize,
    /// Messages per transaction at most ([`Handler::max_group`]).
    pub max_group: usize,
}

struct Context<H> {
    handler: Arc<H>,
    consumer: String,
    stream: String,
    max_group: usize,
    begin: Arc<Begin>,
}

/// The name of the mark every inbox transaction of a Rust handler carries:
/// a shared advisory lock keyed by its process's member id, held until it
/// commits. The crew ends the transactions that carry the mark of a
/// process whose jobs it takes for lost.
pub(super) fn mark_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay crew transactions {stream}/{durable}")
}

/// How an inbox transaction of a Rust handler begins, a parked message's
/// included.
///
/// A process frozen inside a call (SIGSTOP, a VM pause) would hold its
/// inbox rows, and with them the message's next run elsewhere, for as long
/// as it stays frozen: Postgres ends the transaction instead, once it has
/// been idle longer than any live call may take. A statement stuck past a
/// call's time (a lock wait) is cancelled, so a call the timeout dropped
/// does not hold the group. The mark lets the crew end the transaction
/// sooner, once it takes this process's jobs for lost
/// (the crew's `end_transactions`). All of it is sent
/// with the BEGIN, which goes with the claim: no round trip of its own.
pub(super) struct Begin {
    pool: PgPool,
    /// The mark's name, and `hashtext` of it, asked of Postgres once: the
    /// BEGIN carries it as a number (no round trip, nothing to quote).
    name: String,
    mark: tokio::sync::OnceCell<i32>,
    member: i32,
    call_timeout: std::time::Duration,
}

impl Begin {
    pub(super) async fn begin(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let (limit, idle) = handler::call_limits(self.call_timeout);
        let mark = self
            .mark
            .get_or_try_init(|| {
                sqlx::query_scalar::<_, i32>("SELECT hashtext($1)")
                    .bind(&self.name)
                    .fetch_one(&self.pool)
            })
            .await?;
        // Parenthesised: -2147483648 alone reads as a bigint.
        self.pool
            .begin_with(sqlx::AssertSqlSafe(format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}; \
                 SET LOCAL statement_timeout = {}; \
                 SELECT pg_advisory_xact_lock_shared(({mark})::int4, {})",
                idle.as_millis(),
                limit.as_millis(),
                self.member,
            )))
            .await
    }
}

/// One writer: take what is queued (a group forms while the others run),
/// run it as one transaction, answer every request.
async fn work<H: Handler>(ctx: Arc<Context<H>>, rx: Arc<Mutex<mpsc::Receiver<Request>>>) {
    // A message may be claimed once per statement (ON CONFLICT): a second
    // request for the same id waits for the next group.
    let mut later: Vec<Request> = Vec::new();
    loop {
        let mut group = std::mem::take(&mut later);
        // With requests held back, never wait for the queue: an idle
        // worker may hold it, waiting for a message that does not come.
        let queue = if group.is_empty() {
            Some(rx.lock().await)
        } else {
            rx.try_lock().ok()
        };
        if let Some(mut queue) = queue {
            if group.is_empty() {
                match queue.recv().await {
                    Some(first) => group.push(first),
                    None => return,
                }
            }
            while group.len() < ctx.max_group {
                match queue.try_recv() {
                    Ok(next) => group.push(next),
                    Err(_) => break,
                }
            }
        }
        let (cut, group): (Vec<_>, Vec<_>) =
            group.into_iter().partition(|r| r.fence.is_cancelled());
        for r in cut {
            let _ = r.reply.send(Err(BatchError(CUT.into())));
        }
        if group.is_empty() {
            continue;
        }
        let mut seen = HashSet::with_capacity(group.len());
        let (now, next): (Vec<_>, Vec<_>) = group
            .into_iter()
            .partition(|r| seen.insert(r.delivery.message_id));
        later = next;
        let answers = match guarded(&ctx, &now).await {
            Ok(done) => done.into_iter().map(Ok).collect(),
            // Postgres refused the group: run each message alone, so the
            // one it refuses fails its own attempt, counted, and the others
            // go through (their calls are repeated; their writes were rolled
            // back with the group).
            Err(e @ sqlx::Error::Database(_)) if now.len() > 1 && !connection_lost(&e) => {
                let mut answers = Vec::with_capacity(now.len());
                for request in &now {
                    if request.fence.is_cancelled() {
                        answers.push(Err(BatchError(CUT.into())));
                        continue;
                    }
                    answers.push(
                        guarded(&ctx, std::slice::from_ref(request))
                            .await
                            .map_err(|e| BatchError(e.to_string()))
                            .and_then(|mut done| {
                                done.pop().ok_or_else(|| {
                                    BatchError("a group of one came back empty".into())
                                })
                            }),
                    );
                }
                answers
            }
            Err(e) => {
                let e = BatchError(e.to_string());
                now.iter().map(|_| Err(e.clone())).collect::<Vec<_>>()
            }
        };
        for (request, answer) in now.into_iter().zip(answers) {
            let _ = request.reply.send(answer);
        }
    }
}

/// [`run_group`], with a panic of ours a failed group rather than a dead
/// writer (the handler's own panics are caught per call).
async fn guarded<H: Handler>(ctx: &Context<H>, group: &[Request]) -> Result<Vec<Ran>, sqlx::Error> {
    use futures::FutureExt;
    std::panic::AssertUnwindSafe(run_group(ctx, group))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            Err(sqlx::Error::Protocol(
                "the group transaction panicked".into(),
            ))
        })
}

async fn run_group<H: Handler>(
    ctx: &Context<H>,
    group: &[Request],
) -> Result<Vec<Ran>, sqlx::Error> {
    let (limit, _) = handler::call_limits(ctx.handler.call_timeout());
    let mut tx = ctx.begin.begin().await?;
    let ids: Vec<Uuid> = group.iter().map(|r| r.delivery.message_id).collect();
    let subjects: Vec<&str> = group.iter().map(|r| r.delivery.subject.as_str()).collect();
    let seqs: Vec<i64> = group
        .iter()
        .map(|r| i64::try_from(r.seq).unwrap_or(i64::MAX))
        .collect();
    let claims =
        inbox::claim_many(&mut *tx, &ctx.consumer, &ids, &subjects, &seqs, &ctx.stream).await?;
    let mut books = Books {
        done: Vec::with_capacity(group.len()),
        processed: Vec::with_capacity(group.len()),
        last_call: None,
    };
    for r in group {
        let id = r.delivery.message_id;
        let attempts = match claims.get(&id) {
            None => {
                return Err(sqlx::Error::Protocol(format!(
                    "no inbox row came back for {id}"
                )))
            }
            Some(Claim::Processed) => {
                books.done.push(Ran::Processed { duplicate: true });
                continue;
            }
            Some(Claim::Parked { seq, wait_ms }) => {
                books.done.push(Ran::Parked {
                    seq: *seq,
                    wait_ms: *wait_ms,
                });
                continue;
            }
            Some(Claim::Fresh { attempts }) => *attempts,
        };
        let mut delivery = r.delivery.clone();
        delivery.delivered = i64::from(attempts);
        // Never released: COMMIT ends them all, and a savepoint left open
        // nests the next message's inside it, where rolling back to the
        // newest of this name undoes that message alone. One round trip a
        // message, not two; round trips are most of Postgres's CPU here.
        loop {
            match sqlx::raw_sql(SAVEPOINT).execute(&mut *tx).await {
                Ok(_) => break,
                Err(e) => books.blame_last_call(&mut tx, e).await?,
            }
        }
        // A panic is this message's failure, not the group's; so is a call
        // over its time, which Postgres would otherwise end with the group.
        let (outcome, dropped) = match tokio::time::timeout(
            limit,
            handler::call(|| ctx.handler.handle(&mut tx, &delivery)),
        )
        .await
        {
            Ok(outcome) => (outcome, false),
            // The dropped call was timed as it was dropped.
            Err(_) => {
                let why = format!("the handler did not answer within {limit:?}");
                (Outcome::Retry(why), true)
            }
        };
        if outcome == Outcome::Processed {
            books.processed.push(id);
            books.last_call = Some((books.done.len(), attempts));
            books.done.push(Ran::Processed { duplicate: false });
        } else {
            // A statement the dropped call left running ends (at the
            // latest at statement_timeout) with its own answer, which the
            // next statement reads first: then once more.
            if let Err(e) = sqlx::raw_sql(ROLLBACK_TO).execute(&mut *tx).await {
                if !dropped {
                    return Err(e);
                }
                sqlx::raw_sql(ROLLBACK_TO).execute(&mut *tx).await?;
            }
            books.last_call = None;
            books.done.push(Ran::Failed {
                outcome,
                attempts,
                counted: true,
            });
        }
    }
    let finished = async {
        while !books.processed.is_empty() {
            match inbox::complete_many(&mut *tx, &ctx.consumer, &books.processed).await {
                Ok(()) => break,
                Err(e) => books.blame_last_call(&mut tx, e).await?,
            }
        }
        tx.commit().await
    }
    .await;
    match finished {
        Ok(()) => Ok(books.done),
        // Postgres refused a lone message's transaction at the end (a
        // deferred constraint its handler broke, a setting it changed): its
        // attempt failed, counted when it is parked, or it would come back
        // uncounted forever.
        Err(e @ sqlx::Error::Database(_)) if group.len() == 1 && !connection_lost(&e) => {
            match books.last_call {
                Some((_, attempts)) => Ok(vec![Ran::Failed {
                    outcome: Outcome::Retry(format!("its transaction failed to commit: {e}")),
                    attempts,
                    counted: false,
                }]),
                None => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

/// What a request whose job was cut before its group ran is answered.
const CUT: &str = "the job was cut before its transaction began";

/// Postgres ended the session, not the statement: the server shut down or
/// the session was terminated (SQLSTATE class 08, 57P01-57P03: the crew
/// ends a fenced process's transactions), it sat idle in its transaction
/// too long (25P03), or the error is FATAL. Nothing of the transaction
/// committed, and no call of it failed: the messages are run again (if
/// their job may still run), never counted as a failed attempt.
pub fn connection_lost(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(d) = e else {
        return false;
    };
    let fatal = d
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some_and(|p| {
            matches!(
                p.severity(),
                sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
            )
        });
    fatal
        || d.code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "25P03")
}

/// The transaction is failed (SQLSTATE 25P02): an earlier statement in it
/// failed and nothing but a rollback runs.
pub fn aborted(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("25P02"))
}

const SAVEPOINT: &str = "SAVEPOINT outbox_relay_message";
const ROLLBACK_TO: &str = "ROLLBACK TO SAVEPOINT outbox_relay_message";

/// A group's outcomes so far.
struct Books {
    done: Vec<Ran>,
    processed: Vec<Uuid>,
    /// The newest call (its index in `done`, its attempts), while it stands
    /// as processed.
    last_call: Option<(usize, i32)>,
}

impl Books {
    /// The statement after a handler call failed. If the call left the
    /// transaction failed (an error it swallowed, answering `Processed`),
    /// that call failed, not the group: roll it back to its savepoint and
    /// count it failed, and the caller runs the statement again. Anything
    /// else fails the group.
    async fn blame_last_call(
        &mut self,
        tx: &mut sqlx::PgConnection,
        e: sqlx::Error,
    ) -> Result<(), sqlx::Error> {
        let Some((i, attempts)) = self.last_call.take().filter(|_| aborted(&e)) else {
            return Err(e);
        };
        sqlx::raw_sql(ROLLBACK_TO).execute(&mut *tx).await?;
        self.processed.pop();
        let Some(Ran::Processed { .. }) = self.done.get(i) else {
            return Err(e);
        };
        self.done[i] = Ran::Failed {
            outcome: Outcome::Retry(format!(
                "the handler answered processed but left its transaction failed: {e}"
            )),
            attempts,
            counted: true,
        };
        Ok(())
    }
}
