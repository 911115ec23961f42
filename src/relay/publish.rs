//! Publishing to JetStream in commit order, pipelined.
//!
//! Up to `max_inflight` publishes await their ack at once. Order in the
//! stream is kept by the server, not by hope: every publish carries
//! `Nats-Expected-Last-Msg-Id` = the previous event's id in the same stream,
//! so if one message is lost (a connection drop with later messages still
//! queued in the client, a rejected publish), every message after it is
//! refused too, instead of being stored ahead of it. The refusals the
//! session can settle (another writer, a message the server will never take,
//! no leader for a while: [`Publisher::next_ack`]) are settled in it; any
//! other failed ack ends the session, and the relay reconnects, finds its
//! last message in the stream ([`stored_tail`]) and resumes.
//!
//! The first publish of a session has nothing to chain from (the stream's
//! last message may not be ours), so it goes alone, unconditionally, and the
//! pipeline opens once it is answered. Its `Nats-Msg-Id` still dedupes it if
//! an earlier session stored it; but a duplicate does not become the
//! stream's last message, so nothing can chain from it either: while solo
//! publishes come back as duplicates (a backfill republishing what the
//! stream holds), each next one of that stream goes solo too.

use std::time::Duration;

use std::collections::{HashMap, VecDeque};

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream, Context};
use async_nats::HeaderMap;
use futures::stream::StreamExt;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

use super::acks::{Inbox, Lane, Next};
use super::config::PublishMode;
use super::fence::Fence;
use super::link::{Denied, Dialer, Link, LinkError};
use super::route::{dead_letter, subject_matches, OutMessage};
use super::watermark::Ticket;
use crate::backoff::Backoff;
use crate::durability::Placement;
use crate::error::{Error, PublishFailure, Result};
use crate::metrics as m;
use crate::wire::{self, DlqReason, Position};

/// How long a scan of the stream's tail may take. Other writers (consumer
/// dead letters, foreign publishers) may sit after the relay's last message;
/// a budget in time, unlike a count of messages, is one they cannot exhaust
/// faster than the relay reads.
const TAIL_SCAN_BUDGET: Duration = Duration::from_secs(10);

pub struct StreamSettings<'a> {
    pub name: &'a str,
    /// The stream a context uses by default, for the error that suggests it.
    pub default_name: &'a str,
    pub subjects: String,
    /// `{context}.dlq.relay`: the stream must capture it.
    pub dlq_subject: &'a str,
    pub replicas: u8,
    pub max_age: Duration,
    pub max_bytes: i64,
    pub duplicate_window: Duration,
    pub mode: PublishMode,
    /// The server takes atomic batches ([`server_batches`]).
    pub server_batches: bool,
}

/// Whether a server of this version (INFO `version`) takes atomic batches
/// whose messages carry `Nats-Msg-Id`: 2.12.0 added atomic batches but
/// refused any message id in them; 2.12.1 allowed them.
pub fn server_batches(version: &str) -> bool {
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let v = (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    );
    v >= (2, 12, 1)
}

/// Bytes kept free in every message for the headers the publisher adds
/// after routing: `Nats-Expected-Last-Msg-Id` event by event;
/// `Nats-Batch-Id`, `-Sequence`, `-Commit` and `Outbox-Txn-Batch(es)` in
/// batches (about 150 bytes). Without it a row just under the limit passes
/// routing and is refused at publish.
pub const HEADER_RESERVE: usize = 256;

/// The `Nats-Expected-Last-Msg-Id` header a message may gain when sent
/// (its name, an id of up to `MAX_ID_BYTES` and the separators), within
/// [`HEADER_RESERVE`].
const CHAIN_RESERVE: usize = wire::EXPECTED_LAST_MSG_ID.len() + 4 + super::outbox_row::MAX_ID_BYTES;
const _: () = assert!(CHAIN_RESERVE <= HEADER_RESERVE);

/// Create the stream when missing; an existing stream is used as it is.
pub(crate) fn stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(ref j)
            if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// What the relay publishes into: the stream's subject filters, and the
/// largest message it takes.
#[derive(Debug, Clone)]
pub struct StreamShape {
    pub subjects: Vec<String>,
    /// `max_msg_size`, when the stream sets one.
    pub max_msg_size: Option<usize>,
    /// The stream takes atomic batches: publish in them.
    pub batches: bool,
    /// Replicas, storage and server: for the durability judgement.
    pub placement: Placement,
}

/// Create the stream when missing; an existing stream is used as it is, but
/// must capture the relay's dead-letter subject: a stream that cannot store
/// the relay's dead letters is refused here, in one line, instead of
/// wedging the relay on the first bad row.
pub async fn ensure_stream(js: &Context, s: &StreamSettings<'_>) -> Result<StreamShape> {
    let want_batches = s.mode != PublishMode::Event && s.server_batches;
    if s.mode == PublishMode::Batch && !s.server_batches {
        return Err(Error::setup(
            "--publish-mode batch needs nats-server 2.12.1 or later (atomic batch publish); upgrade the server, or use --publish-mode auto or event",
        ));
    }
    let (mut config, mut placement) = match js.get_stream(s.name).await {
        Ok(mut stream) => {
            let info = stream
                .info()
                .await
                .map_err(Error::nats(format!("reading stream {}", s.name)))?;
            (info.config.clone(), Placement::of(info))
        }
        Err(e) if stream_not_found(&e) => {
            let config = stream::Config {
                name: s.name.to_owned(),
                subjects: vec![s.subjects.clone()],
                storage: stream::StorageType::File,
                num_replicas: usize::from(s.replicas),
                max_age: s.max_age,
                max_bytes: s.max_bytes,
                duplicate_window: s.duplicate_window,
                allow_atomic_publish: want_batches,
                ..Default::default()
            };
            js.create_stream(config.clone())
                .await
                .map_err(|e| Error::Setup {
                    message: format!(
                        "cannot create stream {} on {}: {e}; create it yourself or pass --stream with an existing one",
                        s.name, s.subjects
                    ),
                    source: Some(Box::new(e)),
                })?;
            tracing::info!(stream = s.name, subjects = %s.subjects, "created stream");
            // What the server made of it: one that does not know the
            // setting leaves it out.
            let mut stream = js
                .get_stream(s.name)
                .await
                .map_err(Error::nats(format!("reading stream {}", s.name)))?;
            let info = stream
                .info()
                .await
                .map_err(Error::nats(format!("reading stream {}", s.name)))?;
            (info.config.clone(), Placement::of(info))
        }
        Err(e) => return Err(Error::nats(format!("looking up stream {}", s.name))(e)),
    };
    if !config
        .subjects
        .iter()
        .any(|f| subject_matches(f, s.dlq_subject))
    {
        return Err(Error::setup(format!(
            "stream {} (subjects {}) does not capture the relay's dead-letter subject {}: add {} to its subjects, or pass --stream with a stream that captures them (default: {} on {})",
            s.name,
            config.subjects.join(", "),
            s.dlq_subject,
            s.subjects,
            s.default_name,
            s.subjects,
        )));
    }
    if s.mode == PublishMode::Batch && !config.allow_atomic_publish {
        // Asked for in so many words: switch the stream on (an additive
        // setting; other writers are unaffected).
        config.allow_atomic_publish = true;
        let info = js.update_stream(&config).await.map_err(|e| Error::Setup {
            message: format!(
                "--publish-mode batch: cannot allow atomic publish on stream {}: {e}; set allow_atomic on it yourself, or use --publish-mode auto",
                s.name
            ),
            source: Some(Box::new(e)),
        })?;
        config = info.config;
        placement.replicas = config.num_replicas;
        tracing::info!(
            stream = s.name,
            "allowed atomic batch publish on the stream"
        );
    }
    // nats-server stages an atomic batch of a one-replica file stream in a
    // file store of its own, created and removed per batch: about 2 ms of
    // server CPU per transaction, more than the whole latency budget at
    // moderate load (docs/guide/benchmarks.md). `auto` publishes event by
    // event there; `--publish-mode batch` keeps transactions whole. A
    // replicated or memory stream stages in memory, and batches win.
    let staged_on_disk = config.num_replicas <= 1 && config.storage == stream::StorageType::File;
    let want_batches = if s.mode == PublishMode::Auto && want_batches && staged_on_disk {
        tracing::info!(
            stream = s.name,
            "one-replica file stream: publishing event by event, in commit order (nats-server stages each atomic batch on disk, ~2 ms per transaction); --publish-mode batch keeps each transaction whole in the stream at that cost"
        );
        false
    } else {
        want_batches
    };
    let batches = want_batches && config.allow_atomic_publish;
    if want_batches && !batches {
        tracing::info!(
            stream = s.name,
            "the stream does not allow atomic batch publish: publishing event by event; set allow_atomic on it (or run once with --publish-mode batch) to publish whole transactions"
        );
    }
    Ok(StreamShape {
        batches,
        placement,
        subjects: config.subjects,
        max_msg_size: usize::try_from(config.max_message_size)
            .ok()
            .filter(|&m| m > 0),
    })
}

/// The streams `--streams` names, as they are now (SPEC §13 multi-stream
/// routing): each found one's subjects, and the smallest `max_msg_size`
/// among them. One that does not exist is not an error: its rows are
/// dead-lettered (`stream_missing`) until it does ([`watch_missing`]).
pub async fn routed_streams(js: &Context, names: &[String], own: &str) -> Result<Routed> {
    let mut streams = super::route::Streams {
        own: own.to_owned(),
        ..Default::default()
    };
    let mut max_msg_size: Option<usize> = None;
    let mut shapes = Vec::new();
    for name in names {
        match js.get_stream(name).await {
            Ok(mut stream) => {
                let info = stream
                    .info()
                    .await
                    .map_err(Error::nats(format!("reading stream {name}")))?;
                if let Ok(max) = usize::try_from(info.config.max_message_size) {
                    if max > 0 {
                        max_msg_size = Some(max_msg_size.map_or(max, |m| m.min(max)));
                    }
                }
                streams
                    .found
                    .push((Arc::from(name.as_str()), info.config.subjects.clone()));
                shapes.push(Placement::of(info));
            }
            Err(e) if stream_not_found(&e) => {
                tracing::warn!(
                    stream = %name,
                    "--streams names a stream that does not exist: rows naming it are dead-lettered (stream_missing) until it is created"
                );
                streams.missing.push(name.clone());
            }
            Err(e) => return Err(Error::nats(format!("looking up stream {name}"))(e)),
        }
    }
    Ok((streams, max_msg_size, shapes))
}

/// The streams `--streams` names as found: their routing, the smallest
/// message size of theirs, and where each one lives (for the durability
/// judgement, SPEC §14).
pub type Routed = (super::route::Streams, Option<usize>, Vec<Placement>);

/// How often streams `--streams` names that were missing are looked up
/// again: rows naming one are dead-lettered until then, after it exists.
pub const MISSING_RECHECK: Duration = Duration::from_secs(2);

/// Look up the `missing` streams every [`MISSING_RECHECK`] until `stop`, and
/// send the first that exists again: the session then starts over, and
/// reads every routed stream's subjects and limits afresh (a stream made
/// again may take other subjects, or smaller messages). Nothing is sent,
/// and nothing looked up, when none is missing.
pub fn watch_missing(
    js: Context,
    missing: Vec<String>,
) -> (tokio::sync::mpsc::Receiver<String>, CancellationToken) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let stop = CancellationToken::new();
    if missing.is_empty() {
        return (rx, stop);
    }
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(MISSING_RECHECK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = every.tick() => {}
            }
            for name in &missing {
                // An error other than "not found" (NATS away) says nothing.
                if js.get_stream(name).await.is_ok() {
                    let _ = tx.send(name.clone()).await;
                    return;
                }
            }
        }
    });
    (rx, stop)
}

/// The last message this source stored in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    pub at: Position,
    /// Its `Nats-Msg-Id`: a position alone does not name a message, since
    /// after a disk-snapshot restore the same positions carry other rows.
    pub id: String,
    /// Its stream sequence.
    pub seq: u64,
    /// Its `Outbox-Txn-Batch`: it belongs to a transaction split into
    /// batches, this one of them.
    pub txn_batch: Option<u32>,
}

/// The last message this source stored in the stream, if any.
pub async fn stored_tail(
    js: &Context,
    stream_name: &str,
    lineage: &wire::Lineage,
) -> Result<Option<Tail>> {
    let found = scan_tail(js, stream_name, |h| {
        let at = lineage_position(h, lineage)?;
        let id = h.get(wire::MSG_ID)?.as_str().to_owned();
        let txn_batch = h.get(wire::TXN_BATCH).and_then(|k| k.as_str().parse().ok());
        Some((at, id, txn_batch))
    })
    .await?
    .map(|(seq, (at, id, txn_batch))| Tail {
        at,
        id,
        seq,
        txn_batch,
    });
    if found.is_none() {
        tracing::info!(
            stream = stream_name,
            "no message of this relay in the stream's tail; relying on the duplicate window"
        );
    }
    Ok(found)
}

/// The position of a message this WAL history's relay wrote (not a
/// consumer's dead letter, not another source's event).
pub(super) fn lineage_position(h: &HeaderMap, lineage: &wire::Lineage) -> Option<Position> {
    let get = |name: &str| h.get(name).map(|v| v.as_str());
    if get(wire::DLQ_CONSUMER).is_some() {
        return None;
    }
    let at = Position::from_headers(get)?;
    lineage.holds(get(wire::SOURCE)?, at).then_some(at)
}

/// The newest event in the stream that a relay of this server and database
/// wrote (any timeline, any slot): what tells a lost slot from a first start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailEvent {
    pub id: String,
    pub occurred_at: Option<String>,
    pub commit_lsn: Option<String>,
    /// Set when it was backfilled: which rows that backfill published.
    pub backfill: Option<String>,
    /// The last message of a backfill run that finished.
    pub backfill_end: bool,
    /// Its [`wire::XID_HORIZON`].
    pub xid_horizon: Option<u64>,
}

pub async fn last_event_of_database(
    js: &Context,
    stream_name: &str,
    system_id: &str,
    database: &str,
) -> Result<Option<TailEvent>> {
    scan_tail(js, stream_name, |h| {
        let get = |name: &str| h.get(name).map(|v| v.as_str().to_owned());
        let source = get(wire::SOURCE)?;
        if !wire::same_database(&source, system_id, database)
            || get(wire::DLQ_CONSUMER).is_some()
            || get(wire::REPAIR).is_some()
        {
            return None;
        }
        Some(TailEvent {
            id: get(wire::MSG_ID)?,
            occurred_at: get(wire::OCCURRED_AT),
            commit_lsn: get(wire::COMMIT_LSN),
            backfill: get(wire::BACKFILL),
            backfill_end: get(wire::BACKFILL_END).is_some(),
            xid_horizon: get(wire::XID_HORIZON).and_then(|x| x.parse().ok()),
        })
    })
    .await
    .map(|found| found.map(|(_, event)| event))
}

/// Walk the stream back from its last message until `found` says yes, the
/// first message is passed, or [`TAIL_SCAN_BUDGET`] is spent; the sequence
/// of the message found comes with it. A missing stream is an empty one.
async fn scan_tail<T>(
    js: &Context,
    stream_name: &str,
    found: impl Fn(&HeaderMap) -> Option<T>,
) -> Result<Option<(u64, T)>> {
    let mut stream = match js.get_stream(stream_name).await {
        Ok(s) => s,
        Err(e) if stream_not_found(&e) => return Ok(None),
        Err(e) => return Err(Error::nats("reading stream info")(e)),
    };
    let state = crate::nats::stream_state(&mut stream).await?;
    if state.messages == 0 {
        return Ok(None);
    }
    let deadline = std::time::Instant::now() + TAIL_SCAN_BUDGET;
    let mut seq = state.last_sequence;
    while seq >= state.first_sequence && seq > 0 {
        if std::time::Instant::now() > deadline {
            tracing::warn!(
                stream = stream_name,
                from = state.last_sequence,
                to = seq,
                "tail scan stopped after {TAIL_SCAN_BUDGET:?}"
            );
            break;
        }
        match stream.get_raw_message(seq).await {
            Ok(m) => {
                if let Some(t) = found(&m.headers) {
                    return Ok(Some((seq, t)));
                }
            }
            // Deleted or expired messages leave gaps.
            Err(e) if matches!(e.kind(), stream::RawMessageErrorKind::NoMessageFound) => {}
            Err(e) => return Err(Error::nats(format!("reading stream message {seq}"))(e)),
        }
        seq -= 1;
    }
    Ok(None)
}

/// Read the stream's headers forward from `start` through `last` with an
/// ordered consumer, handing each to `each`, until `deadline`. Whether
/// `last` was reached.
async fn read_headers(
    stream: &stream::Stream,
    start: u64,
    last: u64,
    deadline: Instant,
    context: &str,
    mut each: impl FnMut(&HeaderMap),
) -> Result<bool> {
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            headers_only: true,
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await
        .map_err(Error::nats(context))?;
    let mut messages = consumer.messages().await.map_err(Error::nats(context))?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = match tokio::time::timeout(left, messages.next()).await {
            Ok(Some(msg)) => msg.map_err(Error::nats(context))?,
            Ok(None) | Err(_) => return Ok(false),
        };
        let seq = msg
            .info()
            .map_err(|source| Error::Nats {
                context: context.into(),
                source,
            })?
            .stream_sequence;
        if let Some(h) = msg.headers.as_ref() {
            each(h);
        }
        if seq >= last {
            return Ok(true);
        }
    }
}

/// The kind of id a bound can be put on: one whose order the SQL and this
/// process agree on (uuid bytes; integers; text by its UTF-8 bytes, which
/// the backfill orders by `convert_to(id, 'UTF8')`, whatever the
/// collation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    Uuid,
    Int,
    Text,
}

/// An id, ordered as the backfill's SQL orders it. A table's ids are of
/// one kind, so the variants are never compared with each other.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum OrderId {
    Uuid(uuid::Uuid),
    Int(i64),
    Text(String),
}

impl OrderId {
    /// The id a message carries (`Nats-Msg-Id`), read as `kind`.
    pub fn parse(kind: IdKind, msg_id: &str) -> Option<OrderId> {
        match kind {
            IdKind::Uuid => msg_id.parse().ok().map(OrderId::Uuid),
            IdKind::Int => msg_id.parse().ok().map(OrderId::Int),
            // A text id in a UUID's shape goes out in the UUID's canonical
            // text, whatever form the column holds (`A5FF…`, braces): its
            // order here may not be the column's.
            IdKind::Text if uuid::Uuid::parse_str(msg_id).is_ok() => None,
            IdKind::Text => Some(OrderId::Text(msg_id.to_owned())),
        }
    }

    pub fn kind(&self) -> IdKind {
        match self {
            OrderId::Uuid(_) => IdKind::Uuid,
            OrderId::Int(_) => IdKind::Int,
            OrderId::Text(_) => IdKind::Text,
        }
    }

    /// As a SQL value compared with the backfill's order expression for
    /// the id: never quoted text (a text id goes as its bytes).
    pub fn sql(&self) -> String {
        match self {
            OrderId::Uuid(u) => format!("'{u}'::uuid"),
            // Quoted: `-9223372036854775808::int8` is out of range.
            OrderId::Int(n) => format!("'{n}'::int8"),
            OrderId::Text(t) => format!("'\\x{}'::bytea", hex(t.as_bytes())),
        }
    }

    /// In [`wire::BACKFILL_COVERED`]: a uuid as itself (as before other
    /// kinds had bounds), `i:` and the number, `t:` and the hex of the
    /// text (which may hold spaces and commas).
    fn encode(&self) -> String {
        match self {
            OrderId::Uuid(u) => u.to_string(),
            OrderId::Int(n) => format!("i:{n}"),
            OrderId::Text(t) => format!("t:{}", hex(t.as_bytes())),
        }
    }

    fn decode(s: &str) -> Option<OrderId> {
        if let Some(n) = s.strip_prefix("i:") {
            return n.parse().ok().map(OrderId::Int);
        }
        if let Some(h) = s.strip_prefix("t:") {
            // As `parse`: a text id in a UUID's shape has no place in the
            // column's order (an older relay may have passed one on).
            let text = String::from_utf8(unhex(h)?).ok()?;
            return uuid::Uuid::parse_str(&text)
                .is_err()
                .then_some(OrderId::Text(text));
        }
        s.parse().ok().map(OrderId::Uuid)
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Every row of a backfill run's snapshot ordered before `(at, id)` whose
/// transaction ended before `horizon` (the run's snapshot horizon: such a
/// transaction's rows were all in that snapshot) is in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Covered {
    pub at: time::OffsetDateTime,
    pub id: OrderId,
    pub horizon: u64,
}

impl Covered {
    /// At most this many are passed on: one per interrupted run that
    /// proved its own, less those another one covers. Dropping one costs
    /// repeats, never a loss.
    const MAX: usize = 4;

    fn covers(&self, other: &Covered) -> bool {
        (self.at, &self.id) >= (other.at, &other.id) && self.horizon >= other.horizon
    }

    /// Without those another one covers; the newest horizons first.
    pub fn merge(mut all: Vec<Covered>) -> Vec<Covered> {
        all.sort_by(|a, b| (b.horizon, b.at, &b.id).cmp(&(a.horizon, a.at, &a.id)));
        let mut kept: Vec<Covered> = Vec::new();
        for c in all {
            if !kept.iter().any(|k| k.covers(&c)) {
                kept.push(c);
            }
        }
        kept.truncate(Self::MAX);
        kept
    }

    /// The [`wire::BACKFILL_COVERED`] value.
    pub fn header(list: &[Covered]) -> String {
        list.iter()
            .filter_map(|c| {
                let at =
                    c.at.format(&time::format_description::well_known::Rfc3339)
                        .ok()?;
                Some(format!("{at} {} {}", c.id.encode(), c.horizon))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Read back: an item it cannot read is left out (a repeat, not a loss).
    pub fn parse_header(value: &str) -> Vec<Covered> {
        value
            .split(',')
            .filter_map(|item| {
                let mut f = item.split_whitespace();
                let at = time::OffsetDateTime::parse(
                    f.next()?,
                    &time::format_description::well_known::Rfc3339,
                )
                .ok()?;
                Some(Covered {
                    at,
                    id: OrderId::decode(f.next()?)?,
                    horizon: f.next()?.parse().ok()?,
                })
            })
            .collect()
    }
}

/// What an interrupted backfill left in the streams, read back so the next
/// one resumes instead of publishing every row again (the duplicate window
/// is long gone after a backfill of hours).
#[derive(Debug, Default)]
pub struct BackfillResume {
    /// Ids of the backfill's messages read back: stored, skip them.
    pub stored: std::collections::HashSet<wire::IdKey>,
    /// What the interrupted runs are known to have stored, beyond `stored`.
    pub covered: Vec<Covered>,
}

impl BackfillResume {
    /// What every listed stream showed, together.
    pub fn of(reads: Vec<StreamRead>) -> Self {
        let mut covered: Vec<Covered> = reads.iter().flat_map(|r| r.inherited.clone()).collect();
        covered.extend(prove(&reads));
        BackfillResume {
            stored: reads.into_iter().flat_map(|r| r.stored).collect(),
            covered: Covered::merge(covered),
        }
    }
}

/// One run of a backfill, as its messages name it: its snapshot's horizon
/// and, from [`wire::BACKFILL_RUN`], its own id (absent on messages of
/// relays before it: runs are then told apart by their horizon alone,
/// which two runs may share).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct RunId {
    horizon: u64,
    run: Option<String>,
}

/// What one stream showed of one run.
#[derive(Debug, Default, Clone)]
struct RunSeen {
    /// The (time, id) of each of its messages read that has both; a row
    /// stored twice counts once.
    keys: std::collections::BTreeSet<(time::OffsetDateTime, OrderId)>,
    /// Its publish window: its own, from [`wire::BACKFILL_RUN`], else the
    /// current `--max-inflight`.
    window: usize,
}

/// What one stream showed of an interrupted backfill, read back from its
/// end.
#[derive(Debug, Default)]
pub struct StreamRead {
    /// Ids of the backfill's messages read.
    pub stored: std::collections::HashSet<wire::IdKey>,
    /// What the newest message read said the runs before it proved.
    pub inherited: Vec<Covered>,
    runs: HashMap<RunId, RunSeen>,
    /// The oldest run read (the smallest horizon), and whether a message of
    /// the database's older history was (another backfill, streamed
    /// events): past it, a run's messages in this stream are all read.
    oldest_run: Option<u64>,
    history: bool,
    /// Read from the stream's first message.
    whole: bool,
    /// Stopped by the time budget: the newest part of its last chunk may be
    /// unread, so it proves nothing.
    cut: bool,
}

impl StreamRead {
    /// Whether every message run `horizon` has in this stream was read.
    fn passed(&self, horizon: u64) -> bool {
        self.whole || self.history || self.oldest_run.is_some_and(|o| o < horizon)
    }

    /// Whether some run shows two windows of its own here.
    fn shows_a_run(&self) -> bool {
        self.runs
            .values()
            .any(|r| r.keys.len() as u64 >= (r.window as u64).saturating_mul(2))
    }
}

/// The bounds the runs read back prove. A run published in its rows'
/// order, and a message lost in flight had at most a window published
/// after it (the window is counted from the oldest unanswered message):
/// with the newest two windows of a run's messages read, in every stream,
/// everything it published before the oldest of them was acked. Those
/// messages are the run's newest across the streams (each stream keeps its
/// own order, the window is shared), so the bound holds only where every
/// stream was read back that far, or past the run's start. A message
/// without its time (an undecodable row's dead letter) counts for nothing.
///
/// One run's messages alone, under its own window: an older relay's runs
/// (no [`wire::BACKFILL_RUN`]) prove nothing, since runs sharing a horizon
/// cannot be told apart (across several streams, a row lost in one at
/// each of them would have other runs' messages counted past it) and
/// their window is not known (a restart with a smaller one would count
/// too few).
fn prove(reads: &[StreamRead]) -> Vec<Covered> {
    if reads.iter().any(|r| r.cut) || reads.iter().all(|r| r.whole) {
        // Read whole, the ids alone say what is stored.
        return Vec::new();
    }
    let runs: std::collections::BTreeSet<&RunId> =
        reads.iter().flat_map(|r| r.runs.keys()).collect();
    runs.into_iter()
        .filter(|run| run.run.is_some())
        .filter_map(|run| {
            let seen: Vec<&RunSeen> = reads.iter().filter_map(|r| r.runs.get(run)).collect();
            let window = seen.iter().map(|s| s.window).max()?;
            let nth = window.checked_mul(2)?.checked_sub(1)?;
            let mut keys: Vec<&(time::OffsetDateTime, OrderId)> =
                seen.iter().flat_map(|s| s.keys.iter()).collect();
            keys.sort_unstable_by(|a, b| b.cmp(a));
            keys.dedup();
            let bound = *keys.get(nth)?;
            let reached = reads.iter().all(|r| {
                r.passed(run.horizon)
                    || r.runs
                        .get(run)
                        .and_then(|s| s.keys.first())
                        .is_some_and(|oldest| oldest <= bound)
            });
            reached.then(|| Covered {
                at: bound.0,
                id: bound.1.clone(),
                horizon: run.horizon,
            })
        })
        .collect()
}

/// Read back, headers only, the newest messages of this database's
/// interrupted backfill (`header` is its `Outbox-Backfill`) in one stream.
/// `window`: the publisher's in-flight limit. Bounded by
/// [`TAIL_SCAN_BUDGET`]; what is not read is published again (repeats,
/// never a loss).
///
/// Runs are told apart by their snapshot's horizon (`Outbox-Xid-Horizon`).
/// The stream is read back from its end, four windows at a time, until a
/// run shows two windows of its own, the start is reached, or a message of
/// the database's older history is: every message of the runs after that
/// one is read, so their ids say what they stored, and [`prove`] finds
/// their bounds. The newest run also passes on what the runs before it
/// proved ([`wire::BACKFILL_COVERED`]): a run interrupted before it stored
/// two windows proves nothing itself and must not make the next one
/// forget. `ids`: the kind of the table's ids, where a bound can be put on
/// them (none: the ids read back alone say what is stored).
pub async fn backfill_resume(
    js: &Context,
    stream_name: &str,
    database: (&str, &str),
    header: &str,
    window: usize,
    ids: Option<IdKind>,
) -> Result<StreamRead> {
    let context = "reading back the interrupted backfill";
    let mut read = StreamRead::default();
    let mut stream = match js.get_stream(stream_name).await {
        Ok(s) => s,
        // A listed stream not created yet holds nothing of it.
        Err(e) if stream_not_found(&e) => {
            read.whole = true;
            return Ok(read);
        }
        Err(e) => return Err(Error::nats(context)(e)),
    };
    let state = stream
        .info()
        .await
        .map_err(Error::nats(context))?
        .state
        .clone();
    if state.messages == 0 {
        read.whole = true;
        return Ok(read);
    }
    let want = window.saturating_mul(2) as u64;
    // Other sources may interleave: four windows at a time for two of ours.
    let chunk = want.saturating_mul(2).max(1);
    let deadline = Instant::now() + TAIL_SCAN_BUDGET;
    // The newest message's of this backfill, and the chunk it was read in.
    let mut inherited: Option<(usize, String)> = None;
    let mut end = state.last_sequence;
    for n in 0.. {
        let start = end
            .saturating_sub(chunk - 1)
            .max(state.first_sequence)
            .max(1);
        read.whole = start <= state.first_sequence;
        let complete = read_headers(&stream, start, end, deadline, context, |h| {
            let get = |name: &str| h.get(name).map(|v| v.as_str());
            let database_ours = get(wire::SOURCE)
                .is_some_and(|s| wire::same_database(s, database.0, database.1))
                && get(wire::DLQ_CONSUMER).is_none();
            if !database_ours {
                return;
            }
            if get(wire::BACKFILL) != Some(header) {
                // Older than every run of this backfill.
                read.history = true;
                return;
            }
            let Some(msg_id) = get(wire::MSG_ID) else {
                return;
            };
            read.stored.insert(wire::IdKey::of(msg_id));
            if inherited.as_ref().is_none_or(|(i, _)| *i == n) {
                inherited = Some((n, get(wire::BACKFILL_COVERED).unwrap_or("").to_owned()));
            }
            // A bound is a place in (occurred_at, id) order, which the SQL
            // and this process agree on for some kinds of ids only.
            let Some(id) = ids.and_then(|kind| OrderId::parse(kind, msg_id)) else {
                return;
            };
            let Some(horizon) = get(wire::XID_HORIZON).and_then(|x| x.parse().ok()) else {
                return;
            };
            read.oldest_run = Some(read.oldest_run.map_or(horizon, |o| o.min(horizon)));
            let at = get(wire::OCCURRED_AT).and_then(|t| {
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
            });
            let Some(at) = at else {
                return;
            };
            // `<run> <window>`; without it (an older relay's), the run is
            // its horizon and the window today's.
            let named = get(wire::BACKFILL_RUN).and_then(|v| {
                let (run, w) = v.split_once(' ')?;
                Some((run.to_owned(), w.parse::<usize>().ok()?))
            });
            let (run, run_window) = match named {
                Some((run, w)) => (Some(run), w),
                None => (None, window),
            };
            let seen = read.runs.entry(RunId { horizon, run }).or_default();
            seen.window = run_window.max(1);
            seen.keys.insert((at, id));
        })
        .await?;
        read.cut = !complete;
        if read.cut || read.whole || read.history || read.shows_a_run() {
            break;
        }
        end = start - 1;
    }
    // What the runs before proved holds however little of the last was read.
    read.inherited = inherited
        .map(|(_, h)| Covered::parse_header(&h))
        .unwrap_or_default();
    if read.cut {
        tracing::warn!(
            stream = stream_name,
            read = read.stored.len(),
            "stopped reading back the interrupted backfill after {TAIL_SCAN_BUDGET:?}: its rows not read back are published again (the inboxes drop repeats)"
        );
    }
    Ok(read)
}

/// JetStream's answer to one publish.
pub struct Ack {
    pub ticket: Ticket,
    /// The event's commit time in Postgres micros, for the latency metric.
    pub commit_micros: i64,
    /// `Ok(duplicate)`: stored, or already stored before.
    pub result: Result<bool>,
}

/// How long the oldest message may wait for its ack before the publisher
/// takes its leader for gone: a fifth of `--publish-timeout`, this at least
/// (or the timeout itself, if shorter). A stream leader that dies takes the
/// acks of what it held with it, and with no later publish to fail fast,
/// only the wait tells; a slow but healthy cluster is told by a longer
/// timeout.
const STALL: Duration = Duration::from_secs(2);

fn stall(publish_timeout: Duration) -> Duration {
    (publish_timeout / 5).max(STALL.min(publish_timeout))
}
/// During an outage, the first wait for a probe's ack; it doubles after
/// each probe that times out, up to `--publish-timeout`.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// The pause between probes grows from the first to the last: publishing
/// resumes within [`MAX_PAUSE`] of a new leader answering.
const FIRST_PAUSE: Duration = Duration::from_millis(20);
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// How long the stream may stay unanswering before the session ends and
/// the relay reconnects from scratch (a deleted stream is recreated there).
const OUTAGE_BUDGET: Duration = Duration::from_secs(60);

/// A message handed to the connection, kept until JetStream answers: it is
/// sent again after an order refusal or a leader outage, or dead-lettered
/// after a refusal of its own. The body is shared (`Bytes`), so keeping it
/// costs its headers.
#[derive(Clone)]
struct Sent {
    ticket: Ticket,
    commit_micros: i64,
    msg: OutMessage,
    /// When this copy was handed over: the stall clock.
    at: Instant,
}

/// What became of a message handed to the link.
enum Sending {
    Sent,
    /// The link broke; the message is given back.
    Broken(Sent, String),
    /// The link's server is leaving and answers what is in flight on it
    /// first, or there is no link and the caller may not dial: the message
    /// is given back, to go on the next link.
    Held(Sent),
}

/// Where a message the server refuses goes instead.
#[derive(Debug, Clone)]
pub struct Refusals {
    pub dlq_subject: String,
    /// The smaller of the server's `max_payload` and the stream's
    /// `max_msg_size`.
    pub max_message: usize,
}

/// The stream stopped answering (no leader, or a leader that died with our
/// acks): one message at a time probes for a new leader, the rest wait.
#[derive(Debug, Clone, Copy)]
struct Outage {
    since: Instant,
    /// The pause before the next probe; grows.
    pause: Backoff,
    /// How long a probe waits for its answer; grows each time one does not
    /// come.
    probe_timeout: Backoff,
    next_probe: Instant,
}

/// The id each publish must follow, per stream: `Nats-Expected-Last-Msg-Id`
/// is checked against the stream the message lands in, and with the
/// `stream` role (SPEC §13) rows go to several. A stream with none yet
/// gets its next message alone. Each stream keeps its [`Lane`] number for
/// the publisher's life (0: the relay's own).
#[derive(Debug, Default)]
struct Chains {
    /// The relay's own stream (and every message without a `stream`).
    own: Option<String>,
    /// The streams rows named, few: a scan beats a map. Lane `i + 1`.
    named: Vec<(Arc<str>, Option<String>)>,
}

impl Chains {
    /// The id `lane`'s next message follows, if any.
    fn last(&self, lane: Lane) -> Option<&str> {
        match lane {
            0 => self.own.as_deref(),
            l => self
                .named
                .get(usize::try_from(l - 1).ok()?)
                .and_then(|(_, id)| id.as_deref()),
        }
    }

    /// `stream`'s lane; a stream met for the first time gets the next.
    fn lane(&mut self, stream: &Option<Arc<str>>) -> Lane {
        let Some(s) = stream else {
            return 0;
        };
        let i = match self.named.iter().position(|(n, _)| n == s) {
            Some(i) => i,
            None => {
                self.named.push((s.clone(), None));
                self.named.len() - 1
            }
        };
        Lane::try_from(i + 1).unwrap_or(Lane::MAX)
    }

    fn id_mut(&mut self, lane: Lane) -> Option<&mut Option<String>> {
        match lane {
            0 => Some(&mut self.own),
            l => self
                .named
                .get_mut(usize::try_from(l - 1).ok()?)
                .map(|(_, id)| id),
        }
    }

    /// The next message of `lane` follows `id`.
    fn set(&mut self, lane: Lane, id: &str) {
        if let Some(slot) = self.id_mut(lane) {
            match slot {
                Some(last) => {
                    last.clear();
                    last.push_str(id);
                }
                None => *slot = Some(id.to_owned()),
            }
        }
    }

    /// The next message of `lane` goes alone.
    fn forget(&mut self, lane: Lane) {
        if let Some(slot) = self.id_mut(lane) {
            *slot = None;
        }
    }

    fn clear(&mut self) {
        self.own = None;
        for (_, id) in &mut self.named {
            *id = None;
        }
    }
}

pub struct Publisher {
    js: Context,
    /// Opens the publish link: at the session's start ([`Self::connect`]),
    /// and again when it broke or went silent.
    dialer: Option<Dialer>,
    /// A dial under way. It runs as a task of its own, so a caller that is
    /// dropped (the session's select) does not cut it short: the next call
    /// waits for the same dial, which ends in a link or an error.
    dialing: tokio::task::JoinSet<(Dialer, std::result::Result<Link, LinkError>)>,
    /// The link and the answers to what is in flight on it.
    acks: Option<Inbox>,
    /// The messages behind `acks`, in the same order.
    sent: VecDeque<Sent>,
    /// Messages queued to go out again, in order, before anything new (see
    /// [`Publisher::next_ack`]).
    parked: VecDeque<Sent>,
    /// The `wire_size` of everything in `sent` and `parked`: the window is
    /// bounded in bytes as well.
    bytes: usize,
    /// Per stream, the id of the message the next publish must follow.
    chain: Chains,
    /// The `max_payload` of the session's first link, which routing used:
    /// a later link with a smaller one gets messages checked against it.
    routed_for: usize,
    /// The newest message sent alone, until its answer is taken: nothing
    /// new goes meanwhile (if it was stored before, nothing may chain
    /// from it).
    solo: Option<Ticket>,
    max_inflight: usize,
    max_bytes: usize,
    refusals: Refusals,
    stall: Duration,
    max_probe_timeout: Duration,
    outage: Option<Outage>,
    /// A stand-in for a `Sent::at` not yet handed over, so a new message
    /// costs no clock read before the one taken when it is.
    epoch: Instant,
    /// Nothing is sent once the process was paused long enough to lose
    /// its slot.
    fence: Option<Fence>,
}

impl Publisher {
    /// `publish_timeout` is the context's ack timeout (async-nats bounds each
    /// ack by it); a stall is declared well before it.
    pub fn new(
        js: Context,
        dialer: Dialer,
        max_inflight: usize,
        max_bytes: usize,
        publish_timeout: Duration,
        refusals: Refusals,
    ) -> Self {
        Self {
            js,
            dialer: Some(dialer),
            dialing: tokio::task::JoinSet::new(),
            acks: None,
            sent: VecDeque::new(),
            parked: VecDeque::new(),
            bytes: 0,
            chain: Chains::default(),
            routed_for: usize::MAX,
            solo: None,
            max_inflight,
            max_bytes,
            refusals,
            stall: stall(publish_timeout),
            max_probe_timeout: publish_timeout.max(PROBE_TIMEOUT),
            outage: None,
            epoch: Instant::now(),
            fence: None,
        }
    }

    /// From now on, nothing is sent once `fence` broke.
    pub fn set_fence(&mut self, fence: Fence) {
        if let Some(link) = self.link() {
            link.set_fence(fence.clone());
        }
        self.fence = Some(fence);
    }

    /// An error if the process was paused past the fence's limit as of
    /// `now`: nothing may be sent.
    pub(super) fn fenced(&self, now: Instant) -> Result<()> {
        match &self.fence {
            Some(f) if !f.holds(tokio::time::Instant::from_std(now)) => {
                Err(Error::Paused { paused: f.paused() })
            }
            _ => Ok(()),
        }
    }

    /// What the batch path shares: the context, the window (count and
    /// bytes) and the stall clock.
    /// Messages handed over from now on go alone first: the last message
    /// chained to may no longer be the stream's last (batches went since).
    pub(super) fn unchain(&mut self) {
        if self.sent.is_empty() && self.parked.is_empty() {
            self.chain.clear();
            self.solo = None;
        }
    }

    pub(super) fn settings(&self) -> (Context, usize, usize, Duration) {
        (
            self.js.clone(),
            self.max_inflight,
            self.max_bytes,
            self.stall,
        )
    }

    /// The largest message that fits the stream and the connection, with
    /// room for what the publisher adds.
    pub fn max_message(&self) -> usize {
        self.refusals.max_message
    }

    /// Whether another message may be handed over. One message is always
    /// let through when nothing is in flight, whatever its size.
    pub fn has_room(&self) -> bool {
        self.solo.is_none()
            && self.parked.is_empty()
            && self.unanswered() < self.max_inflight
            && (self.bytes < self.max_bytes || self.unanswered() == 0)
    }

    /// Copies handed to the connection whose answer has not been taken.
    fn unanswered(&self) -> usize {
        self.acks.as_ref().map_or(0, |a| a.queue.len())
    }

    /// Messages handed over and not yet acked, including any waiting to be
    /// sent again.
    pub fn in_flight(&self) -> usize {
        self.sent.len() + self.parked.len()
    }

    pub fn in_flight_bytes(&self) -> usize {
        self.bytes
    }

    /// Hand one message to the connection. Returns once it is queued; its ack
    /// comes out of [`next_ack`](Self::next_ack), in publish order.
    pub async fn publish(
        &mut self,
        ticket: Ticket,
        commit_micros: i64,
        msg: OutMessage,
    ) -> Result<()> {
        let size = msg.wire_size();
        let sent = Sent {
            ticket,
            commit_micros,
            msg,
            // Set when handed over (`send`); only a sent message's is read.
            at: self.epoch,
        };
        // Counted first: `send` may put a smaller dead letter in its place.
        self.bytes += size;
        if self.parked.is_empty() {
            // Never a dial here: the session cannot stop while this
            // runs. Without a link the message waits, and `next_ack`
            // dials.
            match self.send(sent, false, false).await? {
                Sending::Sent => {}
                Sending::Broken(sent, why) => {
                    self.parked.push_back(sent);
                    self.ride_out(None, &why, false);
                }
                Sending::Held(sent) => self.parked.push_back(sent),
            }
        } else {
            // Never ahead of what waits to go again: the caller's select
            // checked `has_room` before `next_ack` parked them (in the same
            // poll), and a message sent now would go unchained, before its
            // predecessors.
            self.parked.push_back(sent);
        }
        Ok(())
    }

    /// Open the publish link (the session's first dial, made while the
    /// session opens and can still be stopped).
    pub async fn connect(&mut self) -> Result<()> {
        if self.acks.is_none() {
            let link = self.dial().await.map_err(|e| {
                let servers = self
                    .dialer
                    .as_ref()
                    .map_or_else(String::new, Dialer::servers);
                Error::NatsConnect {
                    servers: format!("{servers} (publish connection)"),
                    source: Box::new(e),
                }
            })?;
            self.open(link);
        }
        Ok(())
    }

    /// Cancel-safe: a dropped call leaves the dial running.
    async fn dial(&mut self) -> std::result::Result<Link, LinkError> {
        if self.dialing.is_empty() {
            let Some(mut dialer) = self.dialer.take() else {
                return Err(LinkError::Config("no dialer".into()));
            };
            self.dialing.spawn(async move {
                let link = dialer.dial().await;
                (dialer, link)
            });
        }
        match self.dialing.join_next().await {
            Some(Ok((dialer, link))) => {
                self.dialer = Some(dialer);
                link
            }
            Some(Err(e)) => Err(LinkError::Config(format!("the dial failed: {e}"))),
            None => Err(LinkError::Config("no dial under way".into())),
        }
    }

    /// The link, for the batch path's messages, dialed if there is none
    /// or it broke. Batches go only while nothing per-event is in flight.
    pub(super) async fn batch_link(&mut self) -> Result<&mut Link> {
        let leaving = |a: &Inbox| a.broken() || a.leaving();
        if self.acks.as_ref().is_some_and(leaving) && self.unanswered() == 0 {
            self.move_off();
        }
        self.ensure_link("").await?;
        self.link().ok_or_else(|| Error::Publish {
            id: String::new(),
            failure: PublishFailure::Send,
            source: "no publish connection".into(),
        })
    }

    /// The link as it is, if any (the batch path awaits its commits on it).
    pub(super) fn link(&mut self) -> Option<&mut Link> {
        self.acks.as_mut().map(Inbox::link)
    }

    /// The link went silent: the next message goes on a new one. Only
    /// while nothing per-event is in flight on it.
    pub(super) fn drop_link(&mut self) {
        if self.unanswered() == 0 {
            self.acks = None;
        }
    }

    /// Leave the link whose server is leaving (or that broke), with
    /// nothing in flight on it: the next message dials another server.
    fn move_off(&mut self) {
        if let Some(mut acks) = self.acks.take() {
            if acks.leaving() && !acks.broken() {
                tracing::info!(
                    from = acks.link().server(),
                    "every answer is in from the server that is leaving; the publish connection moves"
                );
            }
        }
    }

    /// Dial a link if there is none. No server taking one ends the
    /// session (`id`: the event waiting for it, if any).
    async fn ensure_link(&mut self, id: &str) -> Result<()> {
        if self.acks.is_none() {
            let link = self.dial().await.map_err(|e| {
                metrics::counter!(m::PUBLISH_ERRORS).increment(1);
                Error::Publish {
                    id: id.to_owned(),
                    failure: PublishFailure::Send,
                    source: Box::new(e),
                }
            })?;
            self.open(link);
        }
        Ok(())
    }

    fn open(&mut self, link: Link) {
        // The session routes under the first link's limit.
        if self.routed_for == usize::MAX {
            self.routed_for = link.max_payload();
        }
        tracing::debug!(server = link.server(), "publish connection open");
        if let Some(fence) = &self.fence {
            link.set_fence(fence.clone());
        }
        // A dead letter must fit the server the link landed on too.
        let fits = link.max_payload().saturating_sub(HEADER_RESERVE);
        self.refusals.max_message = self.refusals.max_message.min(fits);
        self.acks = Some(Inbox::new(link));
    }

    /// Hand one message to the link; with `may_dial`, dial one first if
    /// there is none or it broke. Cancel-safe: nothing changes until the
    /// link took the message. A `probe` waits for its ack a shorter time,
    /// growing per outage. A message the link could not take comes back,
    /// with why; no server taking a new link ends the session (the relay
    /// reconnects from scratch, as it does when NATS is down at start).
    async fn send(&mut self, mut sent: Sent, probe: bool, may_dial: bool) -> Result<Sending> {
        let broken = |sent, why: &str| Ok(Sending::Broken(sent, why.into()));
        if self.acks.as_ref().is_some_and(Inbox::broken) {
            if self.unanswered() > 0 {
                // What is in flight on it must go again first.
                return broken(sent, "the publish connection broke");
            }
            self.acks = None;
        }
        if self.acks.as_ref().is_some_and(Inbox::leaving) {
            if self.unanswered() > 0 {
                return Ok(Sending::Held(sent));
            }
            self.move_off();
        }
        if self.acks.is_none() {
            if !may_dial {
                // Nothing is in flight: not an outage, only a link to dial
                // (the next `next_ack` does).
                return Ok(Sending::Held(sent));
            }
            self.ensure_link(&sent.msg.msg_id).await?;
        }
        let Some(acks) = self.acks.as_mut() else {
            return broken(sent, "no publish connection");
        };
        let now = Instant::now();
        if let Some(f) = &self.fence {
            if !f.holds(tokio::time::Instant::from_std(now)) {
                return Err(Error::Paused { paused: f.paused() });
            }
        }
        // Routed under a larger limit than this link's (a server with a
        // smaller `max_payload` took over, or a later INFO lowered it): the
        // link would refuse it unsent, and a message chained to it would
        // then wait on an id the stream never got. Its dead letter goes
        // in its place.
        let limit = acks.link().max_payload();
        if limit < self.routed_for
            && sent.msg.dlq_reason.is_none()
            && sent.msg.wire_size() + CHAIN_RESERVE > limit
        {
            let before = sent.msg.wire_size();
            tracing::warn!(id = %sent.msg.msg_id, size = before, max_payload = limit, "the event is over the connection's max_payload; dead-lettering it");
            metrics::counter!(m::EVENTS_DEAD_LETTERED, "reason" => DlqReason::TooLarge.as_str())
                .increment(1);
            let detail = format!("{before} bytes, over the connection's max_payload of {limit}");
            sent.msg = dead_letter(
                sent.msg,
                &self.refusals.dlq_subject,
                DlqReason::TooLarge,
                Some(&detail),
                self.refusals.max_message,
            );
            self.bytes = self.bytes.saturating_sub(before) + sent.msg.wire_size();
        }
        let lane = self.chain.lane(&sent.msg.stream);
        let prev = self.chain.last(lane);
        if !acks.publish(&sent.msg, prev) {
            return broken(sent, "the publish connection broke");
        }
        let probe_deadline = self
            .outage
            .filter(|_| probe)
            .map(|o| now + o.probe_timeout.peek());
        acks.queue.push(probe_deadline, lane);
        if prev.is_none() {
            self.solo = Some(sent.ticket);
        }
        self.chain.set(lane, &sent.msg.msg_id);
        sent.at = now;
        self.sent.push_back(sent);
        Ok(Sending::Sent)
    }

    /// The next ack, in publish order. Three kinds of refusal are settled
    /// here, inside the session, because a new session cannot help them:
    ///
    /// - out of order (`Nats-Expected-Last-Msg-Id` did not match): every
    ///   earlier message of its stream is stored (one stream's acks come in
    ///   order), this one and the later ones of its stream were refused,
    ///   since each expects its predecessor. Another writer appended to the
    ///   stream. That stream's are sent again from this one, alone first
    ///   (see [`Publisher::resend_lane`]): a foreign message costs a round
    ///   trip, not a session, and the other streams nothing.
    /// - the server refuses this message itself (too large for the stream,
    ///   a header block over 64 KiB): it is dead-lettered in its place, and
    ///   the messages after it are sent again behind the dead letter.
    /// - no leader answers (an election after a node died): see
    ///   [`Publisher::ride_out`].
    ///
    /// Cancel-safe: the session's select drops this future whenever new WAL
    /// arrives first. Every change of the books is made without an await in
    /// between, and a message leaves `parked` only once it is handed over,
    /// so a dropped call loses nothing (it may send one message twice, which
    /// dedupes by id).
    pub async fn next_ack(&mut self) -> Option<Ack> {
        loop {
            // Outside an outage, what waits to go again goes at once, beside
            // the other streams' messages still in flight (see
            // `resend_lane`); in one, a probe goes only when nothing is.
            if !self.parked.is_empty() && (self.unanswered() == 0 || self.outage.is_none()) {
                if let Some(o) = self.outage {
                    if o.since.elapsed() > OUTAGE_BUDGET {
                        let e = self.gave_up();
                        return Some(self.failed(e));
                    }
                    tokio::time::sleep_until(o.next_probe.into()).await;
                }
                if let Err(e) = self.flush().await {
                    return Some(self.failed(e));
                }
            }
            if self.unanswered() == 0 {
                if self.parked.is_empty() {
                    return None;
                }
                // Nothing went out (no link, or a broken one): the outage
                // clock, set by then, paces the next try.
                continue;
            }
            let stall_at = self.sent.front().map(|s| s.at + self.stall);
            let Some(acks) = self.acks.as_mut() else {
                continue;
            };
            let result = tokio::select! {
                biased;
                next = acks.next() => match next? {
                    Next::Ack(r) => r,
                    Next::Trouble => {
                        self.ride_out(None, "the stream refused a later message", false);
                        continue;
                    }
                    Next::Reorder(token) => {
                        if let Some(from) = acks.queue.index(token) {
                            self.resend_lane(None, from);
                        }
                        continue;
                    }
                    Next::Denied(subject) => {
                        // Refusals come in send order, and a subject the
                        // user may not publish to is refused every time:
                        // the oldest unanswered message to it is this one.
                        let sent = &self.sent;
                        let token = acks
                            .queue
                            .unanswered_where(|i| sent.get(i).is_some_and(|s| s.msg.subject == subject));
                        if let Some(token) = token {
                            let e = PublishError::with_source(PublishErrorKind::Other, Denied(subject));
                            acks.queue.answer(token, Err(e));
                        }
                        continue;
                    }
                },
                _ = tokio::time::sleep_until(stall_at.unwrap_or_else(Instant::now).into()),
                    if stall_at.is_some() => {
                    if acks.link().still_sending() {
                        // Late because it has not left yet: the clock
                        // starts again.
                        if let Some(oldest) = self.sent.front_mut() {
                            oldest.at = Instant::now();
                        }
                        continue;
                    }
                    self.ride_out(None, "no ack in time", false);
                    // Silence may be a dead connection the socket has not
                    // noticed: the probes go on a new one.
                    self.acks = None;
                    continue;
                }
            };
            let Some(sent) = self.sent.pop_front() else {
                continue;
            };
            match result {
                Ok(duplicate) => {
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    if let Some(o) = self.outage.take() {
                        tracing::info!(
                            after = ?o.since.elapsed(),
                            waiting = self.parked.len(),
                            "the stream answers again; sending what waited"
                        );
                    }
                    if self.solo == Some(sent.ticket) {
                        self.solo = None;
                        // A duplicate is not the stream's last message, so
                        // nothing may chain from it: the next of its stream
                        // goes alone too. Chained, the repeats after it
                        // would pass (the server tells a duplicate before it
                        // checks the order), but the first new event would
                        // be refused, and a replicated stream's leader keeps
                        // a refused id as "in process" for the duplicate
                        // window: sent again, it is not stored until then.
                        if duplicate && !self.sent.iter().any(|s| s.msg.stream == sent.msg.stream) {
                            let lane = self.chain.lane(&sent.msg.stream);
                            self.chain.forget(lane);
                        }
                    }
                    // What waited behind it goes out on the next call.
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Ok(duplicate),
                    });
                }
                Err(e) if matches!(e.kind(), PublishErrorKind::WrongLastMessageId) => {
                    self.resend_lane(Some(sent), 0);
                }
                Err(e) if sent.msg.dlq_reason.is_some() && denied(&e) => {
                    // The dead letter itself may not go: nothing can be
                    // done for the row until the permission is granted.
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Err(Error::setup(format!(
                            "the relay's NATS user may not publish to its dead-letter subject {} (event {} was refused: {}): grant it publish permission on {} and on the stream's subjects",
                            sent.msg.subject,
                            sent.msg.msg_id,
                            sent.msg.dlq_reason.map_or("", |r| r.as_str()),
                            sent.msg.subject
                        ))),
                    });
                }
                Err(e)
                    if sent.msg.dlq_reason.is_none()
                        && (refuses_the_message(&e)
                            || (sent.msg.stream.is_some() && stream_full(&e))) =>
                {
                    let detail = e.to_string();
                    // A routed stream at its limits refuses every row for
                    // it, but must not stop the others (SPEC §13: §9 holds
                    // per stream).
                    let reason = if stream_full(&e) {
                        DlqReason::StreamFull
                    } else {
                        DlqReason::Refused
                    };
                    tracing::warn!(id = %sent.msg.msg_id, stream = ?sent.msg.stream, reason = %detail, "the server refused the event; dead-lettering it");
                    metrics::counter!(m::EVENTS_DEAD_LETTERED, "reason" => reason.as_str())
                        .increment(1);
                    let Sent {
                        ticket,
                        commit_micros,
                        msg,
                        at,
                    } = sent;
                    let before = msg.wire_size();
                    let msg = dead_letter(
                        msg,
                        &self.refusals.dlq_subject,
                        reason,
                        Some(&detail),
                        self.refusals.max_message,
                    );
                    self.bytes = self.bytes.saturating_sub(before) + msg.wire_size();
                    self.requeue(Some(Sent {
                        ticket,
                        commit_micros,
                        msg,
                        at,
                    }));
                }
                Err(e) if in_process(&e) => {
                    // An earlier copy of this message waits for its quorum:
                    // stored or dropped, the probes that follow will tell.
                    self.ride_out(Some(sent), &e.to_string(), false);
                }
                Err(e) if leaderless(&e) => {
                    let timed_out = matches!(e.kind(), PublishErrorKind::TimedOut);
                    self.ride_out(Some(sent), &e.to_string(), timed_out);
                    if timed_out {
                        // As for a stall: a new connection for the next probe.
                        self.acks = None;
                    }
                }
                Err(e) => {
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Err(refused(sent.msg.msg_id, e)),
                    });
                }
            }
        }
    }

    /// The stream did not answer: no leader (an election after a node
    /// died), or a leader that died holding our acks. Stored or not,
    /// everything unacked is sent again from the oldest: its predecessor is
    /// stored (acks come in order), so it may go alone, and each later one
    /// chains to it, so order holds and ids dedupe what was stored. Until
    /// the stream answers, only that oldest message goes, at growing
    /// pauses: a probe. The session ends only past [`OUTAGE_BUDGET`].
    /// `timed_out`: a probe went unanswered, so the next waits longer.
    fn ride_out(&mut self, first: Option<Sent>, why: &str, timed_out: bool) {
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        self.requeue(first);
        let now = Instant::now();
        let o = match self.outage {
            None => {
                tracing::warn!(
                    reason = why,
                    unacked = self.parked.len(),
                    "the stream stopped answering; resending from the oldest unacked event until it does"
                );
                Outage {
                    since: now,
                    pause: Backoff::jittered(FIRST_PAUSE, MAX_PAUSE),
                    probe_timeout: Backoff::new(PROBE_TIMEOUT, self.max_probe_timeout),
                    next_probe: now,
                }
            }
            Some(mut o) => {
                tracing::debug!(reason = why, "probe failed");
                if timed_out {
                    o.probe_timeout.next_pause();
                }
                o.next_probe = now + o.pause.next_pause();
                o
            }
        };
        self.outage = Some(o);
    }

    fn gave_up(&self) -> Error {
        let id = self
            .parked
            .front()
            .map(|s| s.msg.msg_id.clone())
            .unwrap_or_default();
        Error::Publish {
            id,
            failure: PublishFailure::NoStream,
            source: format!("the stream did not answer for {OUTAGE_BUDGET:?}").into(),
        }
    }

    /// Another writer appended to a stream between two of ours, so the
    /// order chain refused the second: every earlier message of that stream
    /// is stored, and this one and the later ones of its stream in flight
    /// (each chained to the one before) were refused or will be. They go
    /// again, the first alone, before anything of theirs not yet sent. The
    /// other streams' messages stay in flight: a foreign writer costs its
    /// stream's window, not everyone's. `first`: the refused message, just
    /// taken off the books (it was the oldest); else it is the one at
    /// index `from`.
    fn resend_lane(&mut self, first: Option<Sent>, from: usize) {
        let lane = match &first {
            Some(sent) => self.chain.lane(&sent.msg.stream),
            None => match self.acks.as_ref().and_then(|a| a.queue.lane_at(from)) {
                Some(lane) => lane,
                None => return,
            },
        };
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        let taken = match self.acks.as_mut() {
            Some(acks) => acks.queue.take_lane(from, lane),
            None => Vec::new(),
        };
        let mut again: VecDeque<Sent> = first.into_iter().collect();
        if !taken.is_empty() {
            let mut next = taken.iter().copied().peekable();
            let mut kept = VecDeque::with_capacity(self.sent.len() - taken.len());
            for (i, s) in self.sent.drain(..).enumerate() {
                if next.next_if_eq(&i).is_some() {
                    again.push_back(s);
                } else {
                    kept.push_back(s);
                }
            }
            self.sent = kept;
        }
        if let Some(head) = again.front() {
            tracing::debug!(id = %head.msg.msg_id, stream = ?head.msg.stream, again = again.len(), "another writer appended to the stream; sending its events again from here");
        }
        again.extend(self.parked.drain(..));
        self.parked = again;
        self.chain.forget(lane);
    }

    /// Put everything unacked back in the queue, `first` (just taken off
    /// the books) at its head, and forget the old copies' answers. What
    /// was in flight was refused or is unknown. On the same link the server
    /// handles old copies before new ones. Copies left on a link that was
    /// dropped may still be handled after the new ones: a chained copy
    /// then fails its order check or dedupes, and a solo one dedupes by id
    /// within the duplicate window; the dropped link resets its socket
    /// (zero linger), so its unsent bytes never arrive late.
    fn requeue(&mut self, first: Option<Sent>) {
        let mut queue: VecDeque<Sent> = first.into_iter().collect();
        queue.extend(self.sent.drain(..));
        queue.extend(self.parked.drain(..));
        self.parked = queue;
        if let Some(acks) = self.acks.as_mut() {
            acks.queue.forget();
            acks.link().barrier();
        }
        self.chain.clear();
        self.solo = None;
    }

    /// Hand queued messages to the connection, in order, each stream's
    /// first unchained where its chain was forgotten; during an outage only
    /// the first, as a probe.
    async fn flush(&mut self) -> Result<()> {
        let probe = self.outage.is_some();
        while let Some(front) = self.parked.front() {
            let next = front.clone();
            match self.send(next, probe, true).await? {
                Sending::Sent => {}
                Sending::Broken(back, why) => {
                    // It stays at the head, as `send` left it (a dead
                    // letter in its place is counted so already); the
                    // outage paces the next try.
                    if let Some(head) = self.parked.front_mut() {
                        *head = back;
                    }
                    self.ride_out(None, &why, false);
                    return Ok(());
                }
                // It stays at the head until the old link's answers are in.
                Sending::Held(_) => return Ok(()),
            }
            self.parked.pop_front();
            if probe {
                break;
            }
        }
        Ok(())
    }

    /// A resend that could not be handed to a link ends the session.
    fn failed(&mut self, e: Error) -> Ack {
        let ticket = self
            .sent
            .front()
            .or(self.parked.front())
            .map_or(0, |s| s.ticket);
        Ack {
            ticket,
            commit_micros: 0,
            result: Err(e),
        }
    }
}

/// No leader took the message: nobody listens on the stream's subjects
/// (between a leader's death and the election), or no answer came.
fn leaderless(e: &PublishError) -> bool {
    matches!(
        e.kind(),
        PublishErrorKind::StreamNotFound
            | PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
    )
}

/// 10158: a copy of the message (same id) is being stored right now; its
/// outcome is not known yet.
fn in_process(e: &PublishError) -> bool {
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    api.is_some_and(|a| a.error_code().0 == 10158)
}

/// Whether the server refused this message for what it is (so it will
/// refuse it again), not for the stream's or the connection's state.
fn refuses_the_message(e: &PublishError) -> bool {
    if matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded) || denied(e) {
        return true;
    }
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    matches!(
        api.map(|a| a.error_code()),
        Some(
            jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                | jetstream::ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
                // Nats-Expected-Stream: the row's subject lands elsewhere
                // now (the streams changed since the session began).
                | jetstream::ErrorCode::STREAM_NOT_MATCH
        )
    )
}

/// Refused because the stream is at its limits with discard new (10077:
/// maximum messages, bytes, or messages per subject exceeded): a full
/// stream, not a store that failed.
fn stream_full(e: &PublishError) -> bool {
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    api.is_some_and(|a| {
        a.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED
            && a.to_string().contains("maximum")
    })
}

/// Refused for the NATS user's permissions ([`Denied`]).
pub(super) fn denied(e: &PublishError) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.downcast_ref::<Denied>().is_some())
}

fn refused(id: String, e: PublishError) -> Error {
    metrics::counter!(m::PUBLISH_ERRORS).increment(1);
    let failure = match e.kind() {
        PublishErrorKind::WrongLastMessageId => PublishFailure::OutOfOrder,
        PublishErrorKind::StreamNotFound => PublishFailure::NoStream,
        PublishErrorKind::TimedOut => PublishFailure::TimedOut,
        _ if stream_full(&e) => PublishFailure::StreamFull,
        _ => PublishFailure::Other,
    };
    Error::Publish {
        id,
        failure,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        hex, prove, server_batches, stall, Chains, Covered, IdKind, OrderId, RunId, StreamRead,
    };
    use std::sync::Arc;

    #[test]
    fn each_stream_chains_to_its_own_last_message() {
        let mut c = Chains::default();
        let (a, b): (Option<Arc<str>>, Option<Arc<str>>) = (Some("A".into()), Some("B".into()));
        let (own, la, lb) = (c.lane(&None), c.lane(&a), c.lane(&b));
        assert_eq!(c.last(own), None);
        c.set(own, "own-1");
        c.set(la, "a-1");
        c.set(la, "a-2");
        assert_eq!(
            (c.last(own), c.last(la), c.last(lb)),
            (Some("own-1"), Some("a-2"), None)
        );
        c.set(lb, "b-1");
        assert_eq!(c.last(lb), Some("b-1"));
        c.forget(la);
        assert_eq!(
            (c.last(own), c.last(la), c.last(lb)),
            (Some("own-1"), None, Some("b-1")),
            "one stream's chain forgotten alone"
        );
        c.clear();
        assert_eq!((c.last(own), c.last(la)), (None, None));
        // Lanes keep their numbers across a clear: slots in flight name them.
        assert_eq!((c.lane(&None), c.lane(&a), c.lane(&b)), (own, la, lb));
        assert_ne!(la, lb);
    }
    use std::time::Duration;

    fn covered(at: &str, id: u128, horizon: u64) -> Covered {
        Covered {
            at: time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
                .unwrap(),
            id: OrderId::Uuid(uuid::Uuid::from_u128(id)),
            horizon,
        }
    }

    #[test]
    fn a_bound_on_any_kind_of_id_survives_its_header() {
        let at = "2026-01-01T00:00:00Z";
        let with = |id: OrderId| Covered {
            id,
            ..covered(at, 0, 9)
        };
        let list = vec![
            with(OrderId::Int(-42)),
            with(OrderId::Text("ord 1, \"two\" é".into())),
            with(OrderId::Text(String::new())),
            with(OrderId::Uuid(uuid::Uuid::from_u128(7))),
        ];
        for c in list {
            let header = Covered::header(std::slice::from_ref(&c));
            assert_eq!(Covered::parse_header(&header), vec![c], "{header}");
        }
        // A uuid reads as it did before other kinds had bounds.
        let old = format!("{at} {} 9", uuid::Uuid::from_u128(7));
        assert_eq!(
            Covered::parse_header(&old)[0].id,
            OrderId::Uuid(uuid::Uuid::from_u128(7))
        );
        assert!(Covered::parse_header(&format!("{at} t:4 9")).is_empty());
        let shaped = hex(b"A5FFFFFF-0000-4000-8000-000000000000");
        assert!(
            Covered::parse_header(&format!("{at} t:{shaped} 9")).is_empty(),
            "a UUID-shaped text id passed on by an older relay"
        );
        assert!(Covered::parse_header(&format!("{at} i:x 9")).is_empty());
    }

    #[test]
    fn ids_order_as_the_backfill_sql_orders_them() {
        let int = |s| OrderId::parse(IdKind::Int, s).unwrap();
        assert!(int("9") < int("10"), "numbers, not their text");
        let text = |s| OrderId::parse(IdKind::Text, s).unwrap();
        // By UTF-8 bytes (convert_to(id, 'UTF8')), not by a collation.
        assert!(text("ord-10") < text("ord-9"));
        assert!(text("Z") < text("a"));
        assert!(text("z") < text("é"));
        assert_eq!(OrderId::parse(IdKind::Uuid, "not a uuid"), None);
        // Sent in canonical form whatever the column holds: no place in
        // the column's order.
        assert_eq!(
            OrderId::parse(IdKind::Text, "A5FFFFFF-0000-4000-8000-000000000000"),
            None
        );
        assert_eq!(
            int(&i64::MIN.to_string()).sql(),
            "'-9223372036854775808'::int8"
        );
        assert_eq!(
            text("it's").sql(),
            "'\\x69742773'::bytea",
            "text goes as its bytes, never quoted"
        );
    }

    #[test]
    fn what_earlier_backfill_runs_stored_survives_its_header_and_keeps_what_nothing_covers() {
        let a = covered("2026-01-01T00:00:00Z", 1, 100);
        let b = covered("2026-01-02T00:00:00Z", 2, 200);
        // Later and with a newer horizon: b covers a.
        assert_eq!(Covered::merge(vec![a.clone(), b.clone()]), vec![b.clone()]);
        // Earlier but newer horizon: neither covers the other.
        let c = covered("2025-12-31T00:00:00Z", 3, 300);
        assert_eq!(
            Covered::merge(vec![a.clone(), b.clone(), c.clone()]),
            vec![c.clone(), b.clone()]
        );
        let list = Covered::merge(vec![a, b.clone(), c]);
        assert_eq!(Covered::parse_header(&Covered::header(&list)), list);
        // An item it cannot read is left out, not the rest.
        let text = format!("nonsense, {}", Covered::header(std::slice::from_ref(&b)));
        assert_eq!(Covered::parse_header(&text), vec![b]);
        // Bounded: the newest horizons stay.
        let many: Vec<Covered> = (0..10)
            .map(|i| {
                covered(
                    &format!("2026-01-{:02}T00:00:00Z", 20 - i),
                    i as u128,
                    100 + i,
                )
            })
            .collect();
        let kept = Covered::merge(many);
        assert_eq!(kept.len(), Covered::MAX);
        assert_eq!(kept[0].horizon, 109);
    }

    /// A stream read back: for each (run, window, keys), that run's
    /// messages (horizon 7, time 0, int ids).
    fn read_of(runs: &[(Option<&str>, usize, Vec<i64>)]) -> StreamRead {
        let at = time::OffsetDateTime::UNIX_EPOCH;
        let mut r = StreamRead::default();
        for (run, window, keys) in runs {
            let seen = r
                .runs
                .entry(RunId {
                    horizon: 7,
                    run: run.map(str::to_owned),
                })
                .or_default();
            seen.window = *window;
            seen.keys
                .extend(keys.iter().map(|&k| (at, OrderId::Int(k))));
            r.oldest_run = Some(7);
        }
        r
    }

    fn bound(c: &[Covered]) -> Vec<(i64, u64)> {
        c.iter()
            .map(|c| match c.id {
                OrderId::Int(k) => (k, c.horizon),
                _ => unreachable!(),
            })
            .collect()
    }

    const A: Option<&str> = Some("a");

    #[test]
    fn a_run_proves_its_bound_only_with_two_windows_of_timed_messages() {
        assert!(prove(&[read_of(&[(A, 5, (1..=9).collect())])]).is_empty());
        // The tenth newest: every message before it was acked.
        assert_eq!(
            bound(&prove(&[read_of(&[(A, 5, (1..=25).collect())])])),
            [(16, 7)]
        );
        // Under its own window, not today's.
        assert!(prove(&[read_of(&[(A, 20, (1..=25).collect())])]).is_empty());
        let mut whole = read_of(&[(A, 5, (1..=25).collect())]);
        whole.whole = true;
        assert!(prove(&[whole]).is_empty(), "read whole: ids say it all");
        let mut cut = read_of(&[(A, 5, (1..=25).collect())]);
        cut.cut = true;
        assert!(prove(&[cut]).is_empty(), "a cut read proves nothing");
        // Runs sharing a horizon are not counted together.
        let two = read_of(&[
            (A, 5, (1..=6).collect()),
            (Some("b"), 5, (7..=12).collect()),
        ]);
        assert!(prove(&[two]).is_empty());
    }

    #[test]
    fn a_run_over_several_streams_proves_a_bound_only_where_each_was_read_back_that_far() {
        // Keys 1..=30, odd ones to stream a, even ones to b; a read back to
        // 21, b only to 28: the tenth newest overall is 21, but b may hold
        // unread messages from 22 to 26, lost in flight or not.
        let odd = |lo: i64| read_of(&[(A, 5, (lo..=30).filter(|k| k % 2 == 1).collect())]);
        let even = |lo: i64| read_of(&[(A, 5, (lo..=30).filter(|k| k % 2 == 0).collect())]);
        assert!(prove(&[odd(1), even(28)]).is_empty());
        assert_eq!(bound(&prove(&[odd(1), even(20)])), [(21, 7)]);
        // A stream read past the run's start (an older run there) holds
        // nothing more of it: the tenth newest of what both hold.
        let mut past = even(28);
        past.oldest_run = Some(6);
        assert_eq!(bound(&prove(&[odd(1), past])), [(15, 7)]);
        let mut history = even(28);
        history.history = true;
        assert_eq!(bound(&prove(&[odd(1), history])), [(15, 7)]);
        // A stream none of whose messages of the run was read proves
        // nothing for it, unless read whole.
        let small = |lo: i64| read_of(&[(A, 2, (lo..=30).filter(|k| k % 2 == 1).collect())]);
        assert!(prove(&[small(1), read_of(&[])]).is_empty());
        let mut none = read_of(&[]);
        none.whole = true;
        assert_eq!(bound(&prove(&[small(1), none])), [(23, 7)]);
        // An older relay's runs (no run id, no window) prove nothing.
        let legacy =
            |lo: i64, odd: i64| read_of(&[(None, 5, (lo..=30).filter(|k| k % 2 == odd).collect())]);
        assert!(prove(&[legacy(1, 1), legacy(1, 0)]).is_empty());
        assert!(prove(&[legacy(1, 1)]).is_empty());
    }

    #[test]
    fn the_stall_follows_the_publish_timeout() {
        let s = Duration::from_secs;
        for (timeout, want) in [
            (Duration::from_millis(500), Duration::from_millis(500)),
            (s(1), s(1)),
            (s(10), s(2)),
            (s(30), s(6)),
        ] {
            assert_eq!(stall(timeout), want, "{timeout:?}");
        }
    }

    #[test]
    fn atomic_batches_with_message_ids_from_2_12_1() {
        for (v, ok) in [
            ("2.11.10", false),
            ("2.12.0", false),
            ("2.12.1", true),
            ("2.12.0-RC.3", false),
            ("2.14.0-RC.1", true),
            ("2.15.1", true),
            ("3.0.0", true),
            ("", false),
        ] {
            assert_eq!(server_batches(v), ok, "{v}");
        }
    }
}
