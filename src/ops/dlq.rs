//! `outbox-relay dlq list | replay`: dead letters for the person on call.
//!
//! **List** reads a dead-letter stream (a consumer's `DLQ_*` stream, or an
//! events stream for the relay's own `{context}.dlq.relay` letters) with an
//! ephemeral reader that acks nothing and changes nothing.
//!
//! **Replay** sends a consumer's dead letter back through that consumer so
//! its handler is called once more. For each one, in this order:
//! 1. it is recorded in `dlq_replays` (the DLQ stream, its creation time and
//!    the sequence are the key): a dead letter replayed before is reported
//!    with who and when, and nothing is sent. The record is pending: the
//!    durable's next claim of that message id uses it up and opens the inbox
//!    row for one more handler call (`consumer/inbox.rs`, `reopen`), so
//!    however many copies arrive, one call is made;
//! 2. it is published to its original subject (so into the events stream),
//!    with the original's headers and body, `Outbox-Replay-Of` = the original
//!    id, `Outbox-Replay-For` = the durable (other durables ack it without a
//!    call), who and when, and `Nats-Msg-Id` = `replay:{dlq}:{seq}`. The
//!    relay's position headers are left out: the replay is not one of its
//!    events, and its restart scan must not take it for one.
//!
//! If the publish fails, a record still pending is taken back so the replay
//! can be run again. The relay's own dead letters (rows it could not publish) are
//! listed but not replayed: fix the row, then insert it again as a new row.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use async_nats::HeaderMap;
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::relay::route::subject_matches;
use crate::wire;

/// One dead letter, as `dlq list` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// Its sequence in the dead-letter stream.
    pub seq: u64,
    /// The original message id.
    pub id: String,
    pub subject: String,
    /// The durable that dead-lettered it; none for the relay's own.
    pub consumer: Option<String>,
    pub reason: String,
    /// Its cause as the playbook triages it (`Outbox-Dlq-Class`, or from
    /// the reason for a letter written before that header).
    pub class: &'static str,
    /// A digest of its cause: letters of one cause share it.
    pub fingerprint: String,
    pub attempts: Option<i64>,
    /// When the dead letter was stored (RFC 3339).
    pub time: String,
    /// When it was stored, to compare and age.
    #[serde(skip)]
    pub(crate) stored: time::OffsetDateTime,
    #[serde(skip)]
    headers: HeaderMap,
    #[serde(skip)]
    payload: bytes::Bytes,
}

/// Which dead letters: all of them, or those matching every given test.
#[derive(Debug, Default, Clone)]
pub struct Selection {
    /// NATS wildcards, matched against the original subject.
    pub filter: Option<String>,
    pub ids: Vec<String>,
    pub since: Option<time::OffsetDateTime>,
    /// Read no more than this many letters (the console's bound): a list
    /// this long may have been cut short, and its reader says so.
    pub limit: Option<usize>,
    /// Headers only, no bodies (the console's grouping).
    pub headers_only: bool,
}

impl Selection {
    fn takes(&self, d: &DeadLetter, stored: time::OffsetDateTime) -> bool {
        self.filter
            .as_deref()
            .is_none_or(|f| subject_matches(f, &d.subject))
            && (self.ids.is_empty() || self.ids.contains(&d.id))
            && self.since.is_none_or(|s| stored >= s)
    }
}

/// The dead letters in `stream_name` that `sel` takes, oldest first.
pub async fn list(
    js: &jetstream::Context,
    stream_name: &str,
    sel: &Selection,
) -> Result<Vec<DeadLetter>> {
    let stream = js
        .get_stream(stream_name)
        .await
        .map_err(|e| Error::setup(format!("stream {stream_name}: {e} (is --stream right?)")))?;
    // An events stream holds the relay's dead letters among its events,
    // under `{context}.dlq.relay`: read those alone. A consumer's
    // dead-letter stream (any name, any prefix) holds letters only, on
    // their original subjects: read it all. Told by content, not by name:
    // whether the stream can hold a relay's letters at all, and whether its
    // last message is a consumer's letter.
    let info = stream.cached_info();
    let relay_letters = info.config.subjects.iter().any(|s| {
        s.strip_suffix(".>")
            .is_some_and(|prefix| !prefix.is_empty() && !prefix.contains(['.', '*', '>']))
    });
    let consumer_letters = relay_letters
        && info.state.messages > 0
        && match stream.get_raw_message(info.state.last_sequence).await {
            Ok(m) => m.headers.get(wire::DLQ_CONSUMER).is_some(),
            // Unknown: read it all (slower, never blind).
            Err(_) => true,
        };
    let filter_subject = if relay_letters && !consumer_letters {
        "*.dlq.relay".to_owned()
    } else {
        String::new()
    };
    // A reader from `start` (a stream sequence; none: the first letter).
    let read_from = |start: Option<u64>| {
        let stream = &stream;
        let filter_subject = filter_subject.clone();
        async move {
            stream
                .create_consumer(consumer::pull::Config {
                    deliver_policy: match start {
                        None => consumer::DeliverPolicy::All,
                        Some(start_sequence) => {
                            consumer::DeliverPolicy::ByStartSequence { start_sequence }
                        }
                    },
                    ack_policy: consumer::AckPolicy::None,
                    filter_subject,
                    headers_only: sel.headers_only,
                    inactive_threshold: Duration::from_secs(10),
                    ..Default::default()
                })
                .await
                .map_err(Error::nats("reading the dead-letter stream"))
        }
    };
    let mut reader = read_from(None).await?;
    let mut out = Vec::new();
    // What this reader delivered to us, and the next letter not seen.
    let (mut received, mut next) = (0u64, None::<u64>);
    // When a fetch last brought a letter, and the pause before the next
    // try after one that brought none.
    let mut progress = std::time::Instant::now();
    let mut pause = STALL_PAUSE_MIN;
    loop {
        let mut batch = reader
            .fetch()
            .max_messages(500)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .map_err(Error::nats("reading the dead-letter stream"))?;
        let mut got = 0;
        let mut pending = 0;
        let mut gap = false;
        while let Some(m) = batch.next().await {
            let m = m.map_err(|e| Error::setup(format!("reading the dead-letter stream: {e}")))?;
            got += 1;
            received += 1;
            let Ok(info) = m.info() else { continue };
            // A delivery that never reached us (a fetch our side gave up
            // on while the server was slow, then answered): no ack policy
            // means no redelivery, so read again from the first unseen.
            if info.consumer_sequence != received {
                gap = true;
                break;
            }
            pending = info.pending;
            next = Some(info.stream_sequence + 1);
            let (seq, stored) = (info.stream_sequence, info.published);
            let h = m.headers.clone().unwrap_or_default();
            let get = |k: &str| h.get(k).map(|v| v.as_str().to_owned());
            let Some(reason) = get(wire::DLQ_REASON) else {
                continue;
            };
            let consumer = get(wire::DLQ_CONSUMER);
            let (class, fingerprint) = crate::triage::of_letter(
                h.get(wire::DLQ_CLASS).map(|v| v.as_str()),
                h.get(wire::DLQ_FINGERPRINT).map(|v| v.as_str()),
                &reason,
                h.get(wire::DLQ_DETAIL).map(|v| v.as_str()),
                consumer.is_some(),
            );
            let d = DeadLetter {
                seq,
                id: get(wire::DLQ_ORIGINAL_ID)
                    .or_else(|| get(wire::MSG_ID))
                    .unwrap_or_default(),
                subject: get(wire::DLQ_ORIGINAL_SUBJECT).unwrap_or_else(|| m.subject.to_string()),
                consumer,
                reason,
                class: class.as_str(),
                fingerprint,
                attempts: get(wire::DLQ_ATTEMPTS).and_then(|a| a.parse().ok()),
                time: stored
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default(),
                stored,
                headers: h,
                payload: m.payload.clone(),
            };
            if sel.takes(&d, stored) {
                out.push(d);
                if sel.limit.is_some_and(|l| out.len() >= l) {
                    return Ok(out);
                }
            }
        }
        if got > 0 && !gap {
            progress = std::time::Instant::now();
            pause = STALL_PAUSE_MIN;
            if pending == 0 {
                return Ok(out);
            }
            continue;
        }
        // Nothing came, or a delivery was lost: done only if the server
        // says it delivered everything and we received all of it. A slow
        // server is waited for, never taken for an empty stream.
        let done = reader
            .info()
            .await
            .map_err(Error::nats("reading the dead-letter stream's reader"))?;
        if !gap && done.num_pending == 0 && done.delivered.consumer_sequence == received {
            return Ok(out);
        }
        // The letter that showed the gap was not taken: a batch with one
        // before it made progress.
        if got > usize::from(gap) {
            progress = std::time::Instant::now();
            pause = STALL_PAUSE_MIN;
        } else {
            if progress.elapsed() >= LIST_STALL {
                return Err(Error::setup(format!(
                    "reading {stream_name}: the server delivered no letter for {} with letters left; no listing is given rather than a short one (retry; is the stream's leader being elected?)",
                    humantime::format_duration(LIST_STALL)
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(STALL_PAUSE_MAX);
        }
        reader = read_from(next).await?;
        received = 0;
    }
}

/// How long a listing waits for a server that delivers nothing while
/// letters are left, before it gives up (a short listing is never given),
/// and the pauses between its tries.
const LIST_STALL: Duration = Duration::from_secs(30);
const STALL_PAUSE_MIN: Duration = Duration::from_millis(100);
const STALL_PAUSE_MAX: Duration = Duration::from_secs(1);

/// What became of one dead letter in a replay.
#[derive(Debug, Serialize)]
pub struct Replayed {
    pub seq: u64,
    pub id: String,
    pub consumer: Option<String>,
    /// `replayed`, `already_replayed` (with who and when), or `not_replayable`.
    pub result: String,
    pub detail: String,
}

pub async fn replay(
    pool: &PgPool,
    js: &jetstream::Context,
    dlq_stream: &str,
    letters: Vec<DeadLetter>,
    who: &str,
) -> Result<Vec<Replayed>> {
    let info = js
        .get_stream(dlq_stream)
        .await
        .map_err(|e| Error::setup(format!("stream {dlq_stream}: {e}")))?;
    let dlq = Dlq {
        name: dlq_stream,
        created: info
            .cached_info()
            .created
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
    };
    let mut out = Vec::new();
    for d in letters {
        let Some(durable) = d.consumer.clone() else {
            out.push(Replayed {
                seq: d.seq,
                id: d.id,
                consumer: None,
                result: "not_replayable".into(),
                detail:
                    "the relay's own dead letter: fix the row, then insert it again as a new row"
                        .into(),
            });
            continue;
        };
        let (seq, id) = (d.seq, d.id.clone());
        let entry = |result: &str, detail: String| Replayed {
            seq,
            id: id.clone(),
            consumer: Some(durable.clone()),
            result: result.into(),
            detail,
        };
        let Some((uuid, _)) = wire::message_id(&d.id) else {
            out.push(entry(
                "not_replayable",
                format!("its id {:?} is not a message id", d.id),
            ));
            continue;
        };
        let (uuid, subject) = (uuid, d.subject.clone());
        if d.headers.get(wire::DLQ_PAYLOAD_OMITTED).map(|v| v.as_str()) == Some(wire::EXPIRED) {
            out.push(entry(
                "not_replayable",
                "it left its stream before its retry and no body was kept; publish it again from the outbox table (`audit --repair`)".into(),
            ));
            continue;
        }
        // Review D5: the record that lets the copy through to the handler
        // must be in the durable's own database; recorded anywhere else,
        // the copy is acked as a duplicate and nothing is called, while
        // this said "replayed". The durable's inbox rows tell: every
        // message it dead-lettered left one.
        if !inbox_has(pool, &durable, uuid, &subject).await? {
            out.push(entry(
                "not_replayable",
                format!("this database has no inbox row of durable {durable}: a replay is recorded in the durable's own database (is DATABASE_URL the consumer's?)"),
            ));
            continue;
        }
        let original_stream = d.headers.get(wire::DLQ_ORIGINAL_STREAM).map(|v| v.as_str());
        match reaches(js, original_stream, &d.subject, &durable).await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                out.push(entry("not_replayable", why));
                continue;
            }
            Err(e) => {
                out.push(entry(
                    "not_replayable",
                    format!("cannot check that anything would deliver it now: {e}"),
                ));
                continue;
            }
        }
        let earlier = match record(pool, &dlq, &d, &durable, uuid, who).await? {
            Earlier::None => None,
            Earlier::Used { by, at } => {
                out.push(entry("already_replayed", format!("by {by} at {at}")));
                continue;
            }
            // Recorded, and no copy has reached the durable yet: an earlier
            // run stopped before it sent one, or the durable has not come to
            // it. Sent again: one call is made however many copies arrive.
            Earlier::Pending { by, at } => Some(format!(
                " (sent again: the replay by {by} at {at} has not reached the consumer)"
            )),
        };
        let duplicate = match publish(js, dlq_stream, &d, &durable, who).await {
            Ok(Sent::Stored { duplicate }) => duplicate,
            // No answer: the copy may be stored, and then its record is
            // what lets it through to the handler (taken back, the copy
            // would arrive as a duplicate and call nothing, and the next
            // run would say "replayed" of a replay that never ran).
            Ok(Sent::Unanswered(e)) => return Err(e),
            Err(e) => {
                // Only a record this run made is taken back: an earlier
                // run's copy may be in the stream, and its record is what
                // lets it through.
                if earlier.is_none() {
                    forget(pool, &dlq, seq).await?;
                }
                return Err(e);
            }
        };
        tracing::info!(dlq = dlq_stream, seq, id = %id, durable, by = who, "replayed a dead letter");
        let mut detail = format!("to {} for {durable}", d.subject);
        detail.push_str(&earlier.unwrap_or_default());
        if duplicate {
            detail.push_str(" (the stream had this replay already: an earlier attempt was stored)");
        }
        out.push(entry("replayed", detail));
    }
    Ok(out)
}

/// Whether this database is `durable`'s: it holds the letter's own inbox
/// row (every message a durable dead-letters leaves one), or, that row
/// pruned since, another of the durable on the letter's subject. A
/// durable name alone could be another service's in its own database.
async fn inbox_has(pool: &PgPool, durable: &str, id: uuid::Uuid, subject: &str) -> Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = $1 AND message_id = $2) \
             OR EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = $1 AND subject = $3)",
    )
    .bind(durable)
    .bind(id)
    .bind(subject)
        .fetch_one(pool)
        .await
        .map_err(|e| match crate::postgres::db_code(&e).as_deref() {
            Some("42P01") => Error::setup(
                "table inbox_messages does not exist here: DATABASE_URL must be the consumer's database (run `outbox-relay migrate` there)",
            ),
            _ => Error::pg("looking up the durable's inbox")(e),
        })
}

/// A replay of the same dead letter recorded before, by whom and when.
enum Earlier {
    None,
    /// Its copy reached the durable and opened the inbox row.
    Used {
        by: String,
        at: String,
    },
    /// Not used yet.
    Pending {
        by: String,
        at: String,
    },
}

/// Whether a replay to `subject` would reach `durable`: the stream that
/// takes the subject has the durable, and its filter takes the subject.
/// `Ok(Err(why))` when it would not (the dead letter stays as it is).
async fn reaches(
    js: &jetstream::Context,
    original_stream: Option<&str>,
    subject: &str,
    durable: &str,
) -> Result<std::result::Result<(), String>> {
    use async_nats::jetstream::context::{ConsumerInfoErrorKind, GetStreamByNameErrorKind};
    // The durable's own stream, as the dead letter names it (it may source
    // or mirror the one that takes the subject); else the one that does.
    let by_subject = match original_stream {
        Some(s) => Ok(s.to_owned()),
        None => js.stream_by_subject(subject).await,
    };
    let stream = match by_subject {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
            return Ok(Err(format!("no stream takes {subject} now")))
        }
        Err(e) => {
            return Err(Error::setup(format!(
                "finding the stream of {subject}: {e}"
            )))
        }
    };
    let info = js
        .get_stream_no_info(&stream)
        .await
        .map_err(|e| Error::setup(format!("stream {stream}: {e}")))?
        .consumer_info(durable)
        .await;
    let config = match info {
        Ok(info) => info.config,
        Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::NotFound) => {
            return Ok(Err(format!(
                "stream {stream} has no durable {durable} ({e}): nothing would deliver the replay; start its consumer first"
            )))
        }
        Err(e) => return Err(Error::setup(format!("durable {durable} on {stream}: {e}"))),
    };
    let filters: Vec<&str> = std::iter::once(config.filter_subject.as_str())
        .filter(|f| !f.is_empty())
        .chain(config.filter_subjects.iter().map(String::as_str))
        .collect();
    if !filters.is_empty() && !filters.iter().any(|f| subject_matches(f, subject)) {
        return Ok(Err(format!(
            "durable {durable} on {stream} takes {} only, not {subject}: nothing would deliver the replay",
            filters.join(", ")
        )));
    }
    Ok(Ok(()))
}

/// Record the replay and open the inbox row again, in one transaction; or
/// the replay recorded before (then nothing changes).
async fn record(
    pool: &PgPool,
    dlq: &Dlq<'_>,
    d: &DeadLetter,
    durable: &str,
    id: uuid::Uuid,
    who: &str,
) -> Result<Earlier> {
    let fresh: Option<i64> = sqlx::query_scalar(
        "INSERT INTO dlq_replays (dlq_stream, dlq_created, dlq_seq, consumer, message_id, replayed_by) \
         VALUES ($1, $2::timestamptz, $3, $4, $5, $6) \
         ON CONFLICT (dlq_stream, dlq_created, dlq_seq) DO NOTHING RETURNING dlq_seq",
    )
    .bind(dlq.name)
    .bind(&dlq.created)
    .bind(i64::try_from(d.seq).unwrap_or(i64::MAX))
    .bind(durable)
    .bind(id)
    .bind(who)
    .fetch_optional(pool)
    .await
    .map_err(|e| match crate::postgres::db_code(&e).as_deref() {
        Some("42P01") => Error::setup(
            "table dlq_replays does not exist: run `outbox-relay migrate` against the consumer's database",
        ),
        _ => Error::pg("recording a replay")(e),
    })?;
    if fresh.is_some() {
        return Ok(Earlier::None);
    }
    let (by, at, used): (String, String, bool) = sqlx::query_as(
        "SELECT replayed_by, replayed_at::text, used_at IS NOT NULL FROM dlq_replays \
         WHERE dlq_stream = $1 AND dlq_created = $2::timestamptz AND dlq_seq = $3",
    )
    .bind(dlq.name)
    .bind(&dlq.created)
    .bind(i64::try_from(d.seq).unwrap_or(i64::MAX))
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading an earlier replay"))?;
    Ok(match used {
        true => Earlier::Used { by, at },
        false => Earlier::Pending { by, at },
    })
}

async fn forget(pool: &PgPool, dlq: &Dlq<'_>, seq: u64) -> Result<()> {
    sqlx::query(
        "DELETE FROM dlq_replays WHERE dlq_stream = $1 AND dlq_created = $2::timestamptz \
         AND dlq_seq = $3 AND used_at IS NULL",
    )
    .bind(dlq.name)
    .bind(&dlq.created)
    .bind(i64::try_from(seq).unwrap_or(i64::MAX))
    .execute(pool)
    .await
    .map_err(Error::pg("taking back a failed replay's record"))?;
    Ok(())
}

/// A dead-letter stream, as the replay records know it: a stream deleted
/// and made again starts its sequences over.
struct Dlq<'a> {
    name: &'a str,
    /// Its creation time, RFC 3339.
    created: String,
}

async fn publish(
    js: &jetstream::Context,
    dlq_stream: &str,
    d: &DeadLetter,
    durable: &str,
    who: &str,
) -> Result<Sent> {
    let mut headers = HeaderMap::new();
    for (k, vs) in d.headers.iter() {
        let name = k.to_string();
        let lower = name.to_ascii_lowercase();
        let dropped = lower.starts_with(wire::NATS_HEADER_PREFIX)
            || lower.starts_with("outbox-dlq-")
            || lower.starts_with("outbox-replay")
            || [wire::SOURCE, wire::COMMIT_LSN, wire::TXN_INDEX]
                .iter()
                .any(|h| h.eq_ignore_ascii_case(&name));
        if dropped {
            continue;
        }
        for v in vs {
            headers.append(name.as_str(), v.as_str());
        }
    }
    let now = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    headers.insert(
        wire::MSG_ID,
        wire::replay_msg_id(dlq_stream, d.seq).as_str(),
    );
    headers.insert(wire::REPLAY_OF, d.id.as_str());
    headers.insert(wire::REPLAY_FOR, durable);
    let payload = body(js, d).await?;
    // Who and when are for the reader; a message near the limit goes
    // without them rather than not at all.
    let max = js.client().server_info().max_payload;
    let mut informed = headers.clone();
    informed.insert(wire::REPLAYED_BY, who);
    informed.insert(wire::REPLAYED_AT, now.as_str());
    if crate::nats::header_size(&informed) + payload.len() <= max {
        headers = informed;
    }
    let size = crate::nats::header_size(&headers) + payload.len();
    if size > max {
        return Err(Error::setup(format!(
            "the replay of {} would be {size} bytes with its replay headers, over the server's max payload of {max}: it cannot be replayed as it is (the dead letter stays)",
            d.id
        )));
    }
    let ack = js
        .send_publish(
            d.subject.clone(),
            jetstream::message::PublishMessage::build()
                .payload(payload)
                .headers(headers),
        )
        .await
        .map_err(|e| {
            Error::setup(format!(
                "publishing the replay of {} to {}: {e}",
                d.id, d.subject
            ))
        })?;
    match ack.await {
        Ok(ack) => Ok(Sent::Stored {
            duplicate: ack.duplicate,
        }),
        Err(e) if e.kind() == jetstream::context::PublishErrorKind::TimedOut => {
            Ok(Sent::Unanswered(Error::setup(format!(
                "no answer to the replay of {} to {}: it may be stored; run the same replay again (a copy that arrived is used once, one that did not is sent again)",
                d.id, d.subject
            ))))
        }
        Err(e) => Err(Error::setup(format!(
            "the replay of {} to {} was not stored: {e} (does a stream capture {}?)",
            d.id, d.subject, d.subject
        ))),
    }
}

/// What became of a replay's publish.
enum Sent {
    Stored {
        duplicate: bool,
    },
    /// No answer in time: it may be stored.
    Unanswered(Error),
}

/// The dead letter's body; for one stored without it (too large for the
/// dead-letter stream), the original's, read back from its stream.
async fn body(js: &jetstream::Context, d: &DeadLetter) -> Result<bytes::Bytes> {
    let get = |k: &str| d.headers.get(k).map(|v| v.as_str().to_owned());
    let Some(omitted) = get(wire::DLQ_PAYLOAD_OMITTED) else {
        return Ok(d.payload.clone());
    };
    let (Some(stream), Some(seq)) = (
        get(wire::DLQ_ORIGINAL_STREAM),
        get(wire::DLQ_ORIGINAL_SEQ).and_then(|s| s.parse::<u64>().ok()),
    ) else {
        return Err(Error::setup(format!(
            "dead letter {} was stored without its body ({omitted} bytes) and does not say where the original is",
            d.id
        )));
    };
    let original = async {
        js.get_stream(&stream)
            .await
            .map_err(|e| e.to_string())?
            .get_raw_message(seq)
            .await
            .map_err(|e| e.to_string())
    };
    match original.await {
        Ok(m) if m.headers.get(wire::MSG_ID).map(|v| v.as_str()) == Some(d.id.as_str()) => {
            Ok(m.payload)
        }
        Ok(_) => Err(Error::setup(format!(
            "dead letter {} was stored without its body ({omitted} bytes), and stream {stream} holds another message at sequence {seq}",
            d.id
        ))),
        Err(e) => Err(Error::setup(format!(
            "dead letter {} was stored without its body ({omitted} bytes), and its original is not in stream {stream} at sequence {seq} any more: {e}",
            d.id
        ))),
    }
}

/// `dlq list`'s line for one dead letter.
pub fn line(d: &DeadLetter) -> String {
    format!(
        "{}  {}  {}  {}  consumer={}  attempts={}  class={}  reason={}",
        d.seq,
        d.time,
        d.id,
        d.subject,
        d.consumer.as_deref().unwrap_or("relay"),
        d.attempts.map_or_else(|| "-".into(), |a| a.to_string()),
        d.class,
        d.reason
    )
}

/// What became of one dead letter in a delete.
#[derive(Debug, Serialize)]
pub struct Deleted {
    pub seq: u64,
    pub id: String,
    /// `deleted`, or `gone` (someone else removed it meanwhile).
    pub result: &'static str,
}

/// Remove `letters` from `dlq_stream`, by sequence, each recorded in
/// `outbox_deleted_letters` (the audit does not take a deleted relay dead
/// letter's row for a hole).
pub async fn delete(
    js: &jetstream::Context,
    pool: &sqlx::PgPool,
    dlq_stream: &str,
    letters: Vec<DeadLetter>,
) -> Result<Vec<Deleted>> {
    let stream = js
        .get_stream_no_info(dlq_stream)
        .await
        .map_err(|e| Error::setup(format!("stream {dlq_stream}: {e}")))?;
    let mut out = Vec::with_capacity(letters.len());
    for d in letters {
        // Recorded first: a run killed between the two leaves a record of
        // a letter still in the stream (the audit sees the letter, and a
        // record alone dismisses nothing), never a letter gone unrecorded
        // (a hole, and a repair beside its fixed copy).
        if d.consumer.is_none() {
            record_deleted(pool, dlq_stream, &d).await;
        }
        let result = match stream.delete_message(d.seq).await {
            Ok(_) => "deleted",
            Err(e) if e.to_string().contains("no message found") => "gone",
            Err(e) => {
                // Still in the stream: its record would dismiss its row
                // once it is gone another way (an age limit, a purge).
                if d.consumer.is_none() {
                    let _ = sqlx::query(
                        "DELETE FROM outbox_deleted_letters WHERE stream = $1 AND seq = $2 AND id = $3",
                    )
                    .bind(dlq_stream)
                    .bind(d.seq as i64)
                    .bind(&d.id)
                    .execute(pool)
                    .await;
                }
                return Err(Error::setup(format!(
                    "deleting dead letter {} (seq {}) from {dlq_stream}: {e}",
                    d.id, d.seq
                )));
            }
        };
        tracing::info!(dlq = dlq_stream, seq = d.seq, id = %d.id, result, "deleted a dead letter");
        out.push(Deleted {
            seq: d.seq,
            id: d.id,
            result,
        });
    }
    Ok(out)
}

/// Record a relay dead letter about to be deleted where the audit of its
/// outbox reads it: in the database its `Outbox-Source` names. A
/// consumer's letter is not recorded: the event it came from is still in
/// the events stream. A record that cannot be made is a warning, the
/// letter is deleted all the same, and the audit then reports the row
/// missing, as before.
async fn record_deleted(pool: &sqlx::PgPool, stream: &str, d: &DeadLetter) {
    let source = d
        .headers
        .get(wire::SOURCE)
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    let database = source.split('/').nth(2).unwrap_or_default().to_owned();
    let recorded = sqlx::query_scalar::<_, bool>(
        "WITH here AS (SELECT current_database() = $5 AS same) \
         INSERT INTO outbox_deleted_letters (stream, seq, id, source) \
         SELECT $1, $2, $3, $4 FROM here WHERE same \
         ON CONFLICT DO NOTHING RETURNING true",
    )
    .bind(stream)
    .bind(d.seq as i64)
    .bind(&d.id)
    .bind(&source)
    .bind(&database)
    .fetch_optional(pool)
    .await;
    match recorded {
        Ok(Some(_)) => {}
        Ok(None) => {
            let here: Option<String> = sqlx::query_scalar("SELECT current_database()::text")
                .fetch_one(pool)
                .await
                .ok();
            if here.as_deref() != Some(database.as_str()) {
                tracing::warn!(dlq = stream, seq = d.seq, id = %d.id, outbox = %database, "this relay dead letter's outbox is in database {database:?}, not this one: its deletion is not recorded there, and an audit of that outbox reports the row missing (delete relay dead letters with the outbox's --database-url)");
            }
        }
        Err(e) => {
            tracing::warn!(dlq = stream, seq = d.seq, id = %d.id, error = %e, "a deleted relay dead letter is not recorded in outbox_deleted_letters (run `outbox-relay migrate`; the role needs INSERT on it): an audit reports its row missing");
        }
    }
}
