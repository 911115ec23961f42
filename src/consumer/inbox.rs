//! The inbox: one row per (consumer, message), the consumer's dedupe record
//! and its parking lot.
//!
//! - **Claim** before the handler runs: insert the row or count one more
//!   attempt. A processed row means a duplicate (ACK, no handler call).
//! - A Rust handler runs inside the claim's transaction (the row locked, its
//!   writes committing with `processed_at`: exactly-once effects). An HTTP
//!   handler runs after the claim committed: no transaction idles across a
//!   network call, and a completion that fails to commit is retried without
//!   calling the handler again.
//! - **Park**: a failed attempt waits in its row until `parked_until`, with
//!   its stream sequence and aggregate key; later messages of the aggregate
//!   are parked behind it. JetStream has their acks, so a failing aggregate
//!   holds no ack-pending slot.

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgExecutor, PgPool};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

/// What the claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Not processed yet: the handler runs. `attempts` counts this one.
    Fresh {
        attempts: i32,
    },
    Processed,
    /// Parked already (a redelivery after a reset): it waits its turn, and
    /// its backoff (`wait_ms` more).
    Parked {
        seq: Option<i64>,
        wait_ms: i64,
    },
}

/// Columns the consumer needs, checked at start so a database that missed
/// `outbox-relay migrate` fails with one line instead of on every message.
pub async fn check_schema(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT consumer, message_id, subject, attempts, last_error, processed_at, \
                aggregate_key, stream_seq, parked_until, reopened, stream FROM inbox_messages LIMIT 0",
    )
    .execute(pool)
    .await?;
    sqlx::query("SELECT consumer, stream, from_seq, to_seq, reset_at FROM inbox_resets LIMIT 0")
        .execute(pool)
        .await?;
    sqlx::query("SELECT consumer, message_id, used_at FROM dlq_replays LIMIT 0")
        .execute(pool)
        .await
        .map(|_| ())
}

/// When a processed row is opened again for one more handler call: an
/// explicit `consumer reset` of this durable on this stream, made after the
/// row was processed, covers the message's stream sequence (`inbox_resets`);
/// or a `dlq replay` of the message is pending (`dlq_replays`, marked used
/// by the same statement). An ordinary redelivery matches neither. Returns
/// the statement's `WITH` clause (the pending replays it uses up among `ids`)
/// and the condition on `inbox_messages` (the existing row) and `excluded`.
fn reopen(ids: &str, stream: &str) -> (String, String) {
    (
        format!(
            "WITH replays AS (UPDATE dlq_replays SET used_at = now() \
               WHERE consumer = $1 AND message_id = ANY({ids}) AND used_at IS NULL \
               RETURNING message_id) "
        ),
        format!(
            "(inbox_messages.processed_at IS NOT NULL AND ( \
               EXISTS (SELECT 1 FROM inbox_resets x WHERE x.consumer = excluded.consumer \
                 AND x.stream = {stream} \
                 AND excluded.stream_seq BETWEEN x.from_seq AND x.to_seq \
                 AND x.reset_at > inbox_messages.processed_at) \
               OR excluded.message_id IN (SELECT message_id FROM replays)))"
        ),
    )
}

/// A claim's conflict: one more attempt for a message waiting its turn, and
/// a processed one opened again if [`reopen`] says so.
fn claim_sql(values: &str, ids: &str, stream: &str, returning: &str) -> String {
    let (with, again) = reopen(ids, stream);
    format!(
        "{with} INSERT INTO inbox_messages (consumer, message_id, subject, attempts, stream_seq) {values} \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET (attempts, processed_at, last_error, reopened) = ( \
             SELECT CASE WHEN r.again THEN 1 \
                         WHEN inbox_messages.processed_at IS NULL AND inbox_messages.parked_until IS NULL \
                         THEN inbox_messages.attempts + 1 ELSE inbox_messages.attempts END, \
                    CASE WHEN r.again THEN NULL ELSE inbox_messages.processed_at END, \
                    CASE WHEN r.again THEN NULL ELSE inbox_messages.last_error END, \
                    inbox_messages.reopened + CASE WHEN r.again THEN 1 ELSE 0 END \
             FROM (SELECT {again} AS again) r) \
         RETURNING {returning}"
    )
}

/// A pulled message: insert its row, or count one more attempt on it.
pub async fn claim<'c>(
    e: impl PgExecutor<'c>,
    consumer: &str,
    id: Uuid,
    subject: &str,
    seq: u64,
    stream: &str,
) -> Result<Claim, sqlx::Error> {
    let sql = claim_sql(
        "VALUES ($1, $2, $3, 1, $4)",
        "ARRAY[$2::uuid]",
        "$5",
        PARKED_RETURNING,
    );
    let (processed, parked, seq, attempts): (bool, Option<i64>, Option<i64>, i32) =
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .bind(subject)
            .bind(seq_param(seq))
            .bind(stream)
            .fetch_one(e)
            .await?;
    Ok(claimed(processed, parked, seq, attempts))
}

/// A row of [`claim_many`]: its id, then what [`claimed`] takes.
type ClaimRow = (Uuid, bool, Option<i64>, Option<i64>, i32);

/// What a claim returns: processed, how long the row is still parked for
/// (none when it is not parked), its sequence, its attempts.
const PARKED_RETURNING: &str = "processed_at IS NOT NULL, \
     (extract(epoch FROM (parked_until - now())) * 1000)::int8, stream_seq, attempts";

fn claimed(processed: bool, parked: Option<i64>, seq: Option<i64>, attempts: i32) -> Claim {
    match parked {
        _ if processed => Claim::Processed,
        Some(wait_ms) => Claim::Parked {
            seq,
            wait_ms: wait_ms.max(0),
        },
        None => Claim::Fresh { attempts },
    }
}

/// A parked message comes up again: count the attempt. `None` when it was
/// processed meanwhile (or its row is gone).
pub async fn claim_parked<'c>(
    e: impl PgExecutor<'c>,
    consumer: &str,
    id: Uuid,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE inbox_messages SET attempts = attempts + 1 \
         WHERE consumer = $1 AND message_id = $2 AND processed_at IS NULL \
         RETURNING attempts",
    )
    .bind(consumer)
    .bind(id)
    .fetch_optional(e)
    .await
}

/// Mark processed (and no longer parked).
pub async fn complete(
    conn: &mut PgConnection,
    consumer: &str,
    id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE inbox_messages SET processed_at = greatest(now(), received_at), parked_until = NULL \
         WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .execute(conn)
    .await?;
    Ok(())
}

const COMPLETE_MANY: &str =
    "UPDATE inbox_messages SET processed_at = greatest(now(), received_at), parked_until = NULL \
     WHERE consumer = $1 AND message_id = ANY($2)";

/// [`complete`] for many ids in one statement. Planned on every call, not
/// cached: a plan made while the inbox was small (or never analyzed) scans
/// the whole table, and a cached one would go on doing so once it is large
/// (measured: 1 ms a statement at 40,000 rows, most of Postgres's CPU). A
/// Rust handler's transaction shares the connection, so the session's
/// planner settings are not ours to change.
pub async fn complete_many<'c>(
    e: impl PgExecutor<'c>,
    consumer: &str,
    ids: &[Uuid],
) -> Result<(), sqlx::Error> {
    sqlx::query(COMPLETE_MANY)
        .persistent(false)
        .bind(consumer)
        .bind(ids)
        .execute(e)
        .await?;
    Ok(())
}

/// What [`record_success`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// This write marked the row processed.
    Now,
    /// The row said processed already (another process's answer).
    Already,
    /// No row, or one this statement could not mark: nothing to say.
    No,
}

/// Record a success another process of the crew made. Every process of
/// the crew may answer one request; one of them writes it.
pub async fn record_success<'c>(
    e: impl PgExecutor<'c>,
    consumer: &str,
    id: Uuid,
) -> Result<Recorded, sqlx::Error> {
    // The outer query sees the row as it was before the update: processed
    // already, or processed by this statement.
    let (now, already): (bool, bool) = sqlx::query_as(
        "WITH done AS (UPDATE inbox_messages \
           SET processed_at = greatest(now(), received_at), parked_until = NULL \
           WHERE consumer = $1 AND message_id = $2 AND processed_at IS NULL RETURNING 1) \
         SELECT EXISTS (SELECT 1 FROM done), EXISTS (SELECT 1 FROM inbox_messages \
           WHERE consumer = $1 AND message_id = $2 AND processed_at IS NOT NULL)",
    )
    .persistent(false)
    .bind(consumer)
    .bind(id)
    .fetch_one(e)
    .await?;
    Ok(match (now, already) {
        (true, _) => Recorded::Now,
        (false, true) => Recorded::Already,
        (false, false) => Recorded::No,
    })
}

/// Where a message waits in the inbox.
pub struct Parking<'a> {
    pub consumer: &'a str,
    /// The events stream (which resets apply).
    pub stream: &'a str,
    pub id: Uuid,
    pub subject: &'a str,
    pub key: &'a str,
    pub seq: u64,
}

/// Postgres text cannot hold NUL, and a handler's error may carry one: as
/// it was, the failure could never be recorded and the message was retried
/// for ever.
fn pg_text(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains('\0') {
        std::borrow::Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// The attempt failed: park the row until `after` from now, with its error.
/// `count_attempt` when the claim that counted it was rolled back (a Rust
/// handler's transaction).
pub async fn park(
    pool: &PgPool,
    p: &Parking<'_>,
    after: Duration,
    error: &str,
    count_attempt: bool,
) -> Result<(), sqlx::Error> {
    // A row processed meanwhile stays processed, unless it was opened again
    // (the claim that opened it was rolled back with a Rust handler's
    // transaction).
    let (with, again) = reopen("ARRAY[$2::uuid]", "$9");
    let sql = format!(
        "{with} INSERT INTO inbox_messages \
           (consumer, message_id, subject, attempts, last_error, aggregate_key, stream_seq, parked_until, stream) \
         VALUES ($1, $2, $3, 1, $4, $5, $6, now() + make_interval(secs => $7), $9) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = CASE WHEN inbox_messages.processed_at IS NOT NULL THEN 1 \
                               ELSE inbox_messages.attempts + CASE WHEN $8 THEN 1 ELSE 0 END END, \
               last_error = excluded.last_error, aggregate_key = excluded.aggregate_key, \
               stream_seq = excluded.stream_seq, parked_until = excluded.parked_until, \
               stream = excluded.stream, \
               reopened = inbox_messages.reopened \
                 + CASE WHEN inbox_messages.processed_at IS NOT NULL THEN 1 ELSE 0 END, \
               processed_at = NULL \
         WHERE inbox_messages.processed_at IS NULL OR {again}"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(p.consumer)
        .bind(p.id)
        .bind(p.subject)
        .bind(pg_text(error).as_ref())
        .bind(p.key)
        .bind(seq_param(p.seq))
        .bind(after.as_secs_f64())
        .bind(count_attempt)
        .bind(p.stream)
        .execute(pool)
        .await?;
    Ok(())
}

/// Park a pulled message behind its aggregate's parked ones (due at once:
/// its turn comes when they are done). A processed row stays processed,
/// unless a reset or replay opens it again. A row parked already keeps its
/// place (stream, sequence, key): the pulled message is a copy of it (a
/// republish, or the same durable name on another stream), and the
/// scheduler retries the row where it was parked. Whether the row is
/// parked now.
pub async fn park_behind(pool: &PgPool, p: &Parking<'_>) -> Result<bool, sqlx::Error> {
    let (with, again) = reopen("ARRAY[$2::uuid]", "$6");
    let kept = "(inbox_messages.parked_until IS NOT NULL AND inbox_messages.processed_at IS NULL)";
    let sql = format!(
        "{with} INSERT INTO inbox_messages \
           (consumer, message_id, subject, aggregate_key, stream_seq, parked_until, stream) \
         VALUES ($1, $2, $3, $4, $5, now(), $6) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET aggregate_key = CASE WHEN {kept} THEN inbox_messages.aggregate_key ELSE excluded.aggregate_key END, \
               stream_seq = CASE WHEN {kept} THEN inbox_messages.stream_seq ELSE excluded.stream_seq END, \
               stream = CASE WHEN {kept} THEN inbox_messages.stream ELSE excluded.stream END, \
               parked_until = coalesce(inbox_messages.parked_until, excluded.parked_until), \
               attempts = CASE WHEN inbox_messages.processed_at IS NOT NULL THEN 0 \
                               ELSE inbox_messages.attempts END, \
               last_error = CASE WHEN inbox_messages.processed_at IS NOT NULL THEN NULL \
                                 ELSE inbox_messages.last_error END, \
               reopened = inbox_messages.reopened \
                 + CASE WHEN inbox_messages.processed_at IS NOT NULL THEN 1 ELSE 0 END, \
               processed_at = NULL \
         WHERE inbox_messages.processed_at IS NULL OR {again}"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(p.consumer)
        .bind(p.id)
        .bind(p.subject)
        .bind(p.key)
        .bind(seq_param(p.seq))
        .bind(p.stream)
        .execute(pool)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// How many times the message was opened again after it was processed (a
/// reset or a replay): one dead-lettering of it from the next.
pub async fn reopened(pool: &PgPool, consumer: &str, id: Uuid) -> Result<i32, sqlx::Error> {
    let n: Option<i32> = sqlx::query_scalar(
        "SELECT reopened FROM inbox_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(n.unwrap_or(0))
}

/// Done with, without success: dead-lettered (the DLQ stored it) or gone
/// from the stream. Counts no attempt unless `count_attempt`.
pub async fn finish_failed(
    pool: &PgPool,
    consumer: &str,
    id: Uuid,
    subject: &str,
    error: &str,
    count_attempt: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, subject, attempts, last_error, processed_at) \
         VALUES ($1, $2, $3, 1, $4, now()) \
         ON CONFLICT (consumer, message_id) DO UPDATE \
           SET attempts = inbox_messages.attempts + CASE WHEN $5 THEN 1 ELSE 0 END, \
               last_error = excluded.last_error, parked_until = NULL, \
               processed_at = greatest(now(), inbox_messages.received_at)",
    )
    .bind(consumer)
    .bind(id)
    .bind(subject)
    .bind(pg_text(error).as_ref())
    .bind(count_attempt)
    .execute(pool)
    .await?;
    Ok(())
}

/// The oldest parked message of each aggregate, and how long until it is
/// due, soonest due first, `limit` of them at most: what a consumer taking
/// over resumes from, and reloads while some are held in the inbox only.
/// Also how many aggregates are parked in all.
pub async fn parked_heads(
    pool: &PgPool,
    consumer: &str,
    stream: &str,
    limit: usize,
) -> Result<(Vec<(String, u64, Duration)>, u64), sqlx::Error> {
    let rows: Vec<(String, i64, f64, i64)> = sqlx::query_as(
        "SELECT aggregate_key, stream_seq, \
                greatest(0, extract(epoch FROM parked_until - now()))::float8, \
                count(*) OVER () \
         FROM (SELECT DISTINCT ON (aggregate_key) aggregate_key, stream_seq, parked_until \
               FROM inbox_messages \
               WHERE consumer = $1 AND parked_until IS NOT NULL AND processed_at IS NULL \
                 AND aggregate_key IS NOT NULL AND stream_seq IS NOT NULL \
                 AND (stream = $2 OR stream IS NULL) \
               ORDER BY aggregate_key, stream_seq) heads \
         ORDER BY parked_until, aggregate_key \
         LIMIT $3",
    )
    .bind(consumer)
    .bind(stream)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await?;
    let total = rows.first().map_or(0, |r| u64::try_from(r.3).unwrap_or(0));
    let heads = rows
        .into_iter()
        .map(|(key, seq, wait, _)| {
            (
                key,
                u64::try_from(seq).unwrap_or(0),
                Duration::try_from_secs_f64(wait).unwrap_or(Duration::ZERO),
            )
        })
        .collect();
    Ok((heads, total))
}

/// The oldest parked message of one aggregate: its sequence, how long
/// until it is due, and its attempts so far.
pub async fn parked_head(
    pool: &PgPool,
    consumer: &str,
    stream: &str,
    key: &str,
) -> Result<Option<(u64, Duration, i32)>, sqlx::Error> {
    let row: Option<(i64, f64, i32)> = sqlx::query_as(
        "SELECT stream_seq, greatest(0, extract(epoch FROM parked_until - now()))::float8, attempts \
         FROM inbox_messages \
         WHERE consumer = $1 AND aggregate_key = $2 AND parked_until IS NOT NULL \
           AND processed_at IS NULL AND stream_seq IS NOT NULL \
           AND (stream = $3 OR stream IS NULL) \
         ORDER BY stream_seq LIMIT 1",
    )
    .bind(consumer)
    .bind(key)
    .bind(stream)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(seq, wait, attempts)| {
        (
            u64::try_from(seq).unwrap_or(0),
            Duration::try_from_secs_f64(wait).unwrap_or(Duration::ZERO),
            attempts,
        )
    }))
}

/// The parked message at `seq` of one aggregate (its id, to find the row
/// when the stream no longer has the message).
pub async fn parked_id(
    pool: &PgPool,
    consumer: &str,
    stream: &str,
    key: &str,
    seq: u64,
) -> Result<Option<ParkedRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT message_id, subject, attempts, last_error FROM inbox_messages \
         WHERE consumer = $1 AND aggregate_key = $2 AND stream_seq = $3 \
           AND parked_until IS NOT NULL AND processed_at IS NULL \
           AND (stream = $4 OR stream IS NULL)",
    )
    .bind(consumer)
    .bind(key)
    .bind(seq_param(seq))
    .bind(stream)
    .fetch_optional(pool)
    .await
}

/// A parked row: its message id, subject, attempts so far and last error.
pub type ParkedRow = (Uuid, String, i32, Option<String>);

/// Stream sequences fit a bigint (JetStream's are far below 2^63).
fn seq_param(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// Claims and completions for handlers outside the inbox transaction (HTTP),
/// many per statement: requests gather while the previous statement runs,
/// so a busy consumer pays one round trip per batch, not per message, and
/// an idle one waits for no timer.
#[derive(Clone)]
pub struct Batcher {
    claims: mpsc::Sender<ClaimRequest>,
    completions: mpsc::Sender<CompleteRequest>,
}

/// A batch's statement failed (every request in it gets the error's text).
#[derive(Debug, Clone)]
pub struct BatchError(pub String);

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Rows per statement at most; queued requests at most per kind (a request
/// holds an id and a subject: the queue stays within a few hundred KiB).
const MAX_BATCH: usize = 512;
const QUEUE: usize = 1024;
/// How long a writer waits for its connection to open before the batch
/// fails (and is retried by its callers), as the pools' acquire timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Batcher {
    /// The two writer tasks end when every handle is dropped. Each writes
    /// one statement at a time, as in a group commit: the next batch forms
    /// while it runs. Under load that makes batches large and statements
    /// few, which is what Postgres's CPU, shared with everything else on
    /// the box, pays for (consumer bench at concurrency 128: 9,200–9,400
    /// messages/s with one in flight, 8,000–8,200 with two, 5,700–6,100
    /// with four).
    ///
    /// Each writer keeps a connection of its own, not a pool's: a pool
    /// pings a connection when it is taken and again when it is given back
    /// (sqlx 0.9), two more round trips to Postgres per statement, each
    /// waking its backend and this process. Its sequential scans are off:
    /// every statement finds rows by key, and a plan cached while the inbox
    /// looked tiny (new, or never analyzed) would otherwise scan the whole
    /// table on every batch once it is large, until the next ANALYZE.
    pub fn start(pool: PgPool, consumer: String, stream: String) -> Self {
        let statement_timeout = STATEMENT_LIMIT.as_millis().to_string();
        let options = (*pool.connect_options()).clone().options([
            ("enable_seqscan", "off"),
            ("statement_timeout", statement_timeout.as_str()),
        ]);
        let (claims, claim_rx) = mpsc::channel(QUEUE);
        let (completions, complete_rx) = mpsc::channel(QUEUE);
        tokio::spawn(write_claims(
            Writer::new(options.clone()),
            consumer.clone(),
            stream,
            claim_rx,
        ));
        tokio::spawn(write_completions(
            Writer::new(options),
            consumer,
            complete_rx,
        ));
        Self {
            claims,
            completions,
        }
    }

    pub async fn claim(&self, id: Uuid, subject: &str, seq: u64) -> Result<Claim, BatchError> {
        let (reply, answer) = oneshot::channel();
        self.claims
            .send((id, subject.to_owned(), seq, reply))
            .await
            .map_err(|_| BatchError("the inbox writer stopped".into()))?;
        answer
            .await
            .map_err(|_| BatchError("the inbox writer stopped".into()))?
    }

    pub async fn complete(&self, id: Uuid) -> Result<(), BatchError> {
        let (reply, answer) = oneshot::channel();
        self.completions
            .send((id, reply))
            .await
            .map_err(|_| BatchError("the inbox writer stopped".into()))?;
        answer
            .await
            .map_err(|_| BatchError("the inbox writer stopped".into()))?
    }
}

/// Take what is queued, up to [`MAX_BATCH`], after waiting for the first.
async fn gather<T>(rx: &mut mpsc::Receiver<T>, batch: &mut Vec<T>) -> bool {
    match rx.recv().await {
        Some(first) => batch.push(first),
        None => return false,
    }
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(next) => batch.push(next),
            Err(_) => break,
        }
    }
    true
}

type ClaimRequest = (
    Uuid,
    String,
    u64,
    oneshot::Sender<Result<Claim, BatchError>>,
);

/// A batch writer's connection, opened when a batch needs it and dropped
/// after any failed statement (the next batch opens a fresh one).
///
/// What a pool's pings did is kept where it costs nothing under load: a
/// connection that sat unused for [`IDLE_CHECK_AFTER`] is pinged first (a
/// middlebox may have dropped the idle flow without a reset, or Postgres
/// ended the session), and every statement has a time limit, Postgres's
/// and then ours. TCP alone would leave a statement on a path gone silent
/// waiting about 15 minutes, a successful call unrecorded all that time.
struct Writer {
    options: PgConnectOptions,
    conn: Option<PgConnection>,
    used: Instant,
}

/// How long a writer's connection may sit unused before it is pinged.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(1);
/// How long a ping may take before its connection is given up, as long as
/// the pools wait for a connection.
const PING_LIMIT: Duration = Duration::from_secs(10);
/// How long a batch statement may run: Postgres cancels it then (the
/// writers' `statement_timeout`), a lock wait included, and the batch fails
/// and is retried by its callers. Far past what a statement of a few
/// hundred rows takes. Cancelled by Postgres, it leaves nothing behind; a
/// client that merely gave up would leave the statement to commit later
/// (one more attempt counted per retry) and its backend open.
const STATEMENT_LIMIT: Duration = Duration::from_secs(30);
/// How long the writer waits for a statement's answer before it takes the
/// path for gone silent and gives the connection up: past
/// [`STATEMENT_LIMIT`], so a live Postgres answers first.
const ANSWER_LIMIT: Duration = Duration::from_secs(35);

fn timed_out(what: &str, limit: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} took over {} s", limit.as_secs()),
    ))
}

impl Writer {
    fn new(options: PgConnectOptions) -> Self {
        Self {
            options,
            conn: None,
            used: Instant::now(),
        }
    }

    async fn conn(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if let Some(conn) = &mut self.conn {
            if self.used.elapsed() > IDLE_CHECK_AFTER {
                match tokio::time::timeout(PING_LIMIT, conn.ping()).await {
                    Ok(Ok(())) => {}
                    // A session Postgres ended (an `idle_session_timeout`,
                    // a restart): expected, and the next one simply opens.
                    Ok(Err(e)) => {
                        tracing::info!(error = %e, "an idle inbox connection failed its check; opening another");
                        self.conn = None;
                    }
                    Err(_) => {
                        tracing::warn!(
                            "an idle inbox connection did not answer its check in {} s; opening another",
                            PING_LIMIT.as_secs()
                        );
                        self.conn = None;
                    }
                }
            }
        }
        match &mut self.conn {
            Some(conn) => Ok(conn),
            slot @ None => {
                let conn = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    PgConnection::connect_with(&self.options),
                )
                .await
                .map_err(|_| {
                    timed_out("connecting to Postgres for the inbox", CONNECT_TIMEOUT)
                })??;
                Ok(slot.insert(conn))
            }
        }
    }

    /// The statement's result; a failure drops the connection, whatever
    /// state it was left in.
    fn settle<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, BatchError> {
        match result {
            Ok(v) => {
                self.used = Instant::now();
                Ok(v)
            }
            Err(e) => {
                self.conn = None;
                Err(BatchError(e.to_string()))
            }
        }
    }
}

/// `statement`'s answer within [`ANSWER_LIMIT`].
async fn limited<T>(
    statement: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(ANSWER_LIMIT, statement)
        .await
        .unwrap_or_else(|_| {
            Err(timed_out(
                "waiting for Postgres to answer an inbox batch statement",
                ANSWER_LIMIT,
            ))
        })
}

async fn write_claims(
    mut writer: Writer,
    consumer: String,
    stream: String,
    mut rx: mpsc::Receiver<ClaimRequest>,
) {
    // A row may be named once per statement (ON CONFLICT); a second claim
    // of the same id waits for the next one.
    let mut later: Vec<ClaimRequest> = Vec::new();
    loop {
        let mut batch: Vec<ClaimRequest> = Vec::new();
        if later.is_empty() {
            if !gather(&mut rx, &mut batch).await {
                return;
            }
        } else {
            batch.append(&mut later);
        }
        let mut seen = std::collections::HashSet::new();
        let (now, next): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|(id, _, _, _)| seen.insert(*id));
        later = next;
        let ids: Vec<Uuid> = now.iter().map(|(id, _, _, _)| *id).collect();
        let subjects: Vec<&str> = now.iter().map(|(_, s, _, _)| s.as_str()).collect();
        let seqs: Vec<i64> = now.iter().map(|(_, _, q, _)| seq_param(*q)).collect();
        let result = match writer.conn().await {
            Ok(conn) => limited(claim_many(conn, &consumer, &ids, &subjects, &seqs, &stream)).await,
            Err(e) => Err(e),
        };
        let result = writer.settle(result);
        for (id, _, _, reply) in now {
            let answer = match &result {
                Ok(claims) => claims
                    .get(&id)
                    .copied()
                    .ok_or_else(|| BatchError(format!("no inbox row came back for {id}"))),
                Err(e) => Err(e.clone()),
            };
            let _ = reply.send(answer);
        }
    }
}

type CompleteRequest = (Uuid, oneshot::Sender<Result<(), BatchError>>);

async fn write_completions(
    mut writer: Writer,
    consumer: String,
    mut rx: mpsc::Receiver<CompleteRequest>,
) {
    loop {
        let mut batch: Vec<CompleteRequest> = Vec::new();
        if !gather(&mut rx, &mut batch).await {
            return;
        }
        let ids: Vec<Uuid> = batch.iter().map(|(id, _)| *id).collect();
        let result = match writer.conn().await {
            Ok(conn) => limited(complete_batch(conn, &consumer, &ids)).await,
            Err(e) => Err(e),
        };
        let result = writer.settle(result);
        for (_, reply) in batch {
            let _ = reply.send(result.clone());
        }
    }
}

/// [`complete_many`] on a batch writer's connection: prepared once, since
/// that connection plans with sequential scans off.
async fn complete_batch(
    conn: &mut PgConnection,
    consumer: &str,
    ids: &[Uuid],
) -> Result<(), sqlx::Error> {
    sqlx::query(COMPLETE_MANY)
        .bind(consumer)
        .bind(ids)
        .execute(conn)
        .await?;
    Ok(())
}

/// [`claim`] for many distinct ids in one statement.
pub async fn claim_many<'c>(
    e: impl PgExecutor<'c>,
    consumer: &str,
    ids: &[Uuid],
    subjects: &[&str],
    seqs: &[i64],
    stream: &str,
) -> Result<std::collections::HashMap<Uuid, Claim>, sqlx::Error> {
    let sql = claim_sql(
        "SELECT $1, id, subject, 1, seq FROM unnest($2::uuid[], $3::text[], $4::int8[]) AS t(id, subject, seq)",
        "$2::uuid[]",
        "$5",
        &format!("message_id, {PARKED_RETURNING}"),
    );
    let rows: Vec<ClaimRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(consumer)
        .bind(ids)
        .bind(subjects)
        .bind(seqs)
        .bind(stream)
        .fetch_all(e)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, processed, parked, seq, attempts)| {
            (id, claimed(processed, parked, seq, attempts))
        })
        .collect())
}
