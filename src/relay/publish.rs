//! Publishing to JetStream in commit order, pipelined.
//!
//! Up to `max_inflight` publishes await their ack at once. Order in the
//! stream is kept by the server, not by hope: every publish carries
//! `Nats-Expected-Last-Msg-Id` = the previous event's id, so if one message is
//! lost (a connection drop with later messages still queued in the client, a
//! rejected publish), every message after it is refused too, instead of being
//! stored ahead of it. Any failed ack ends the session; the relay reconnects,
//! finds its last message in the stream ([`stored_tail`]) and resumes.
//!
//! The first publish of a session has nothing to chain from (the stream's
//! last message may not be ours), so it goes alone, unconditionally, and the
//! pipeline opens once it is stored. Its `Nats-Msg-Id` still dedupes it if
//! an earlier session stored it; but a duplicate does not become the
//! stream's last message, so nothing can chain from it either: while solo
//! publishes come back as duplicates (a backfill republishing what the
//! stream holds), each next one goes solo too.

use std::borrow::Cow;
use std::future::IntoFuture;
use std::pin::Pin;
use std::time::Duration;

use async_nats::header::{HeaderName, HeaderValue, IntoHeaderName};
use async_nats::jetstream::{self, context::PublishErrorKind, stream, Context};
use async_nats::HeaderMap;
use futures::stream::{FuturesOrdered, StreamExt};
use futures::Future;

use super::route::OutMessage;
use super::watermark::Ticket;
use crate::error::{Error, PublishFailure, Result};
use crate::ops::metrics as m;
use crate::wire::{self, Position};

/// How long a scan of the stream's tail may take. Other writers (consumer
/// dead letters, foreign publishers) may sit after the relay's last message;
/// a budget in time, unlike a count of messages, is one they cannot exhaust
/// faster than the relay reads.
const TAIL_SCAN_BUDGET: Duration = Duration::from_secs(10);

pub struct StreamSettings<'a> {
    pub name: &'a str,
    pub subjects: String,
    pub replicas: u8,
    pub max_age: Duration,
    pub max_bytes: i64,
    pub duplicate_window: Duration,
}

/// Create the stream when missing; an existing stream is used as it is.
pub async fn ensure_stream(js: &Context, s: &StreamSettings<'_>) -> Result<()> {
    match js.get_stream(s.name).await {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            js.create_stream(stream::Config {
                name: s.name.to_owned(),
                subjects: vec![s.subjects.clone()],
                storage: stream::StorageType::File,
                num_replicas: usize::from(s.replicas),
                max_age: s.max_age,
                max_bytes: s.max_bytes,
                duplicate_window: s.duplicate_window,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::Setup {
                message: format!(
                    "cannot create stream {} on {}: {e}; create it yourself or pass --stream with an existing one",
                    s.name, s.subjects
                ),
                source: Some(Box::new(e)),
            })?;
            tracing::info!(stream = s.name, subjects = %s.subjects, "created stream");
            Ok(())
        }
        Err(e) => Err(Error::nats(format!("looking up stream {}", s.name))(e)),
    }
}

/// The position of the last message this source stored in the stream, if any.
pub async fn stored_tail(
    js: &Context,
    stream_name: &str,
    source: &str,
) -> Result<Option<Position>> {
    let found = scan_tail(js, stream_name, |h| {
        let get = |name: &str| h.get(name).map(|v| v.as_str());
        if get(wire::SOURCE) == Some(source) && get(wire::DLQ_CONSUMER).is_none() {
            Position::from_headers(get)
        } else {
            None
        }
    })
    .await?;
    if found.is_none() {
        tracing::info!(
            stream = stream_name,
            "no message of this relay in the stream's tail; relying on the duplicate window"
        );
    }
    Ok(found)
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
        if !wire::same_database(&source, system_id, database) || get(wire::DLQ_CONSUMER).is_some() {
            return None;
        }
        Some(TailEvent {
            id: get(wire::MSG_ID)?,
            occurred_at: get(wire::OCCURRED_AT),
            commit_lsn: get(wire::COMMIT_LSN),
            backfill: get(wire::BACKFILL),
        })
    })
    .await
}

/// Walk the stream back from its last message until `found` says yes, the
/// first message is passed, or [`TAIL_SCAN_BUDGET`] is spent. A missing
/// stream is an empty one.
async fn scan_tail<T>(
    js: &Context,
    stream_name: &str,
    found: impl Fn(&HeaderMap) -> Option<T>,
) -> Result<Option<T>> {
    let mut stream = match js.get_stream(stream_name).await {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(Error::nats("reading stream info")(e)),
    };
    let state = stream
        .info()
        .await
        .map_err(Error::nats("reading stream info"))?
        .state
        .clone();
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
                    return Ok(Some(t));
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

/// The NATS header block of one event. Owned names and values move into
/// the map and our static names are not copied: this runs once per event.
/// Values were checked for CR/LF when routed (async-nats panics on them).
pub fn header_map(
    headers: Vec<(Cow<'static, str>, String)>,
    expected_last_msg_id: Option<String>,
) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        let name = match k {
            Cow::Borrowed(name) => HeaderName::from_static(name),
            Cow::Owned(name) => name.into_header_name(),
        };
        map.insert(name, HeaderValue::from(v));
    }
    if let Some(prev) = expected_last_msg_id {
        map.insert(
            HeaderName::from_static(wire::EXPECTED_LAST_MSG_ID),
            HeaderValue::from(prev),
        );
    }
    map
}

/// JetStream's answer to one publish.
pub struct Ack {
    pub ticket: Ticket,
    /// The event's commit time in Postgres micros, for the latency metric.
    pub commit_micros: i64,
    /// `Ok(duplicate)`: stored, or already stored before.
    pub result: Result<bool>,
}

type AckFuture = Pin<Box<dyn Future<Output = Ack> + Send>>;

pub struct Publisher {
    js: Context,
    inflight: FuturesOrdered<AckFuture>,
    /// Id of the message the next publish must follow; `None` until the
    /// session's first publish is acked.
    chain: Option<String>,
    solo_pending: bool,
    max_inflight: usize,
}

impl Publisher {
    /// Each ack is awaited for at most the context's timeout (`--publish-timeout`):
    /// async-nats bounds the ack future by it.
    pub fn new(js: Context, max_inflight: usize) -> Self {
        Self {
            js,
            inflight: FuturesOrdered::new(),
            chain: None,
            solo_pending: false,
            max_inflight,
        }
    }

    pub fn has_room(&self) -> bool {
        !self.solo_pending && self.inflight.len() < self.max_inflight
    }

    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Hand one message to the connection. Returns once it is queued; its ack
    /// comes out of [`next_ack`](Self::next_ack), in publish order.
    pub async fn publish(
        &mut self,
        ticket: Ticket,
        commit_micros: i64,
        msg: OutMessage,
    ) -> Result<()> {
        let prev = self.chain.take();
        if prev.is_none() {
            self.solo_pending = true;
        }
        let headers = header_map(msg.headers, prev);
        let publish = jetstream::message::PublishMessage::build()
            .payload(msg.body)
            .headers(headers);
        let ack = self
            .js
            .send_publish(msg.subject, publish)
            .await
            .map_err(|e| {
                metrics::counter!(m::PUBLISH_ERRORS).increment(1);
                Error::Publish {
                    id: msg.msg_id.clone(),
                    failure: PublishFailure::Send,
                    source: Box::new(e),
                }
            })?;
        self.chain = Some(msg.msg_id.clone());
        let id = msg.msg_id;
        self.inflight.push_back(Box::pin(async move {
            let result = match ack.into_future().await {
                Ok(ack) => Ok(ack.duplicate),
                Err(e) => Err(refused(id, e)),
            };
            Ack {
                ticket,
                commit_micros,
                result,
            }
        }));
        Ok(())
    }

    /// The next ack, in publish order.
    pub async fn next_ack(&mut self) -> Option<Ack> {
        let next = self.inflight.next().await;
        if let Some(Ack {
            result: Ok(duplicate),
            ..
        }) = &next
        {
            if self.solo_pending && *duplicate {
                self.chain = None;
            }
            self.solo_pending = false;
        }
        next
    }
}

fn refused(id: String, e: jetstream::context::PublishError) -> Error {
    metrics::counter!(m::PUBLISH_ERRORS).increment(1);
    let failure = match e.kind() {
        PublishErrorKind::WrongLastMessageId => PublishFailure::OutOfOrder,
        PublishErrorKind::StreamNotFound => PublishFailure::NoStream,
        PublishErrorKind::TimedOut => PublishFailure::TimedOut,
        _ => PublishFailure::Other,
    };
    Error::Publish {
        id,
        failure,
        source: Box::new(e),
    }
}
