//! The last message this source stored in a stream, read back at a
//! restart so the replay resumes after it, within a budget in time.

use std::time::Duration;
use std::time::Instant;

use async_nats::jetstream::{self, stream, Context};
use async_nats::HeaderMap;
use futures::stream::StreamExt;

use super::streams::stream_not_found;
use crate::error::{Error, Result};
use crate::wire::{self, Position};

/// How long a scan of the stream's tail may take. Other writers (consumer
/// dead letters, foreign publishers) may sit after the relay's last message;
/// a budget in time, unlike a count of messages, is one they cannot exhaust
/// faster than the relay reads.
pub(super) const TAIL_SCAN_BUDGET: Duration = Duration::from_secs(10);

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
pub(crate) fn lineage_position(h: &HeaderMap, lineage: &wire::Lineage) -> Option<Position> {
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
pub(super) async fn read_headers(
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
