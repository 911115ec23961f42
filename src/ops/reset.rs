//! `outbox-relay consumer reset`: a durable starts over from a stream
//! sequence or time, and its handler sees those messages once more.
//!
//! Two steps, in this order. First the reset is recorded in `inbox_resets`
//! (consumer, from_seq, reset_at, who): a claim of a message at or after
//! `from_seq` whose inbox row was processed before `reset_at` lets it through
//! to the handler once (`consumer/inbox.rs`, `CLAIM_CONFLICT`); a later
//! redelivery of it finds it processed after the reset and stays a
//! duplicate. Then JetStream is told: the next message it delivers is
//! `from_seq`. nats-server 2.14 and later reset the durable in place
//! (ADR-60); 2.10 to 2.13 cannot, so the durable is made again, its
//! configuration kept, starting at `from_seq` (what the reset does there
//! too: what it had delivered and not yet been acked before `from_seq` is
//! not delivered again). The durable's consumers must be stopped (their
//! lease free): messages in flight in a running one would otherwise go
//! ahead of the redelivered earlier ones of their aggregate. A dry run
//! says what would happen and changes nothing.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use sqlx::PgPool;

use crate::error::{Error, Result};

/// Where to start over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartAt {
    Seq(u64),
    /// RFC 3339; judged against the stream's message times (the server's
    /// clock), not this host's.
    Time(time::OffsetDateTime),
}

/// How a reset is asked for: a dry run, and whether it may pass over
/// unacked messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked {
    pub dry_run: bool,
    pub skip_unacked: bool,
}

#[derive(Debug)]
pub struct Done {
    pub from_seq: u64,
    /// Messages the durable will deliver again, from there to the stream's
    /// end (of those its filter takes).
    pub messages: u64,
    /// Messages after the ack floor, before the start, that it passes
    /// over (`--skip-unacked`).
    pub skipped: u64,
    /// How the server is told: in place (2.14+), or the durable made again.
    pub how: How,
    /// False for a dry run: nothing was changed.
    pub applied: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// ADR-60's consumer reset (nats-server 2.14 and later).
    InPlace,
    /// Deleted and made again at the sequence, its configuration kept
    /// (nats-server 2.10 to 2.13).
    MadeAgain,
}

impl std::fmt::Display for How {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            How::InPlace => "reset in place (ADR-60)",
            How::MadeAgain => "made again at that sequence, its configuration kept (this server predates ADR-60's reset)",
        })
    }
}

/// `--time`'s value. Whether anything is at or after it is the stream's
/// word (its messages carry the server's times): this host's clock may be
/// off, and judging "the future" by it refused a time the stream holds.
pub fn parse_time(t: &str) -> Result<time::OffsetDateTime> {
    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map_err(|e| Error::Config(format!("--time {t:?} is not an RFC 3339 time: {e}")))
}

pub async fn run(
    pool: &PgPool,
    js: &jetstream::Context,
    stream_name: &str,
    durable: &str,
    from: &StartAt,
    who: &str,
    asked: Asked,
) -> Result<Done> {
    let Asked {
        dry_run,
        skip_unacked,
    } = asked;
    let mut stream = js
        .get_stream(stream_name)
        .await
        .map_err(|e| Error::setup(format!("stream {stream_name}: {e} (is --stream right?)")))?;
    let state = crate::nats::stream_state(&mut stream).await?;
    let mut target: consumer::Consumer<consumer::pull::Config> =
        stream.get_consumer(durable).await.map_err(|e| {
            Error::setup(format!(
                "durable {durable} on stream {stream_name}: {e} (is --durable right?)"
            ))
        })?;
    let seq = match from {
        StartAt::Seq(n) => {
            if *n == 0 || *n > state.last_sequence + 1 {
                return Err(Error::Config(format!(
                    "--seq {n} is outside stream {stream_name} (sequences {}..={})",
                    state.first_sequence.max(1),
                    state.last_sequence
                )));
            }
            (*n).max(state.first_sequence)
        }
        // The server's clock says what is "after the newest message": a
        // start time past it finds nothing (the server may answer a far
        // one with the first sequence).
        StartAt::Time(at) if *at > state.last_timestamp => {
            return Err(Error::Config(format!(
                "stream {stream_name} holds no message at or after {at} (its newest is from {}): nothing to start over from",
                state.last_timestamp
            )))
        }
        StartAt::Time(at) => first_at_or_after(&stream, *at).await?.ok_or_else(|| {
            Error::Config(format!(
                "stream {stream_name} holds no message at or after {at} (its newest is from {}): nothing to start over from",
                state.last_timestamp
            ))
        })?,
    };
    let info = target
        .info()
        .await
        .map_err(Error::nats("reading the durable"))?
        .clone();
    let config = info.config.clone();
    let messages = to_deliver(&stream, &config, seq).await?;
    // A start past the ack floor passes over what the durable has not had
    // acked (delivered and failing, or never delivered): its handler
    // would never see those. Said, and refused unless meant.
    // A durable made to start at a sequence (an earlier reset on a server
    // before ADR-60) was never meant what lies before it; some servers
    // say an ack floor of 0 until it acks one.
    let start = match config.deliver_policy {
        consumer::DeliverPolicy::ByStartSequence { start_sequence } => start_sequence,
        _ => 0,
    };
    let floor = info.ack_floor.stream_sequence.max(start.saturating_sub(1));
    let skipped = if seq > floor + 1 {
        to_deliver(&stream, &config, floor + 1)
            .await?
            .saturating_sub(messages)
    } else {
        0
    };
    if skipped > 0 && !skip_unacked {
        return Err(Error::Config(format!(
            "starting {durable} over at sequence {seq} passes over {skipped} messages after its ack floor ({floor}) that it has not had acked: its handler would never see them. Start at sequence {} or before, or say --skip-unacked",
            floor + 1
        )));
    }
    let how = if crate::nats::resets_consumers(&js.client()) {
        How::InPlace
    } else {
        How::MadeAgain
    };
    if dry_run {
        return Ok(Done {
            from_seq: seq,
            messages,
            skipped,
            how,
            applied: false,
        });
    }
    // Order within an aggregate holds only if nothing of the durable is in
    // flight while it starts over: refuse while an instance holds its lease,
    // and hold the lease ourselves meanwhile.
    let Some(lease) =
        crate::consumer::lease::Lease::try_acquire(pool, &mut None, stream_name, durable, None)
            .await?
    else {
        return Err(Error::setup(format!(
            "durable {durable} is being consumed (an `outbox-relay consume` instance holds its lease): stop its consumers, reset, then start them again"
        )));
    };
    let reset_id: i64 = sqlx::query_scalar(
        "INSERT INTO inbox_resets (consumer, stream, from_seq, to_seq, reset_by) \
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(durable)
    .bind(stream_name)
    .bind(i64::try_from(seq).unwrap_or(i64::MAX))
    .bind(i64::try_from(state.last_sequence).unwrap_or(i64::MAX))
    .bind(who)
    .fetch_one(pool)
    .await
    .map_err(|e| match crate::postgres::db_code(&e).as_deref() {
        Some("42P01") => Error::setup(
            "table inbox_resets does not exist: run `outbox-relay migrate` against this database",
        ),
        _ => Error::pg("recording the reset")(e),
    })?;
    let told = match how {
        How::InPlace => target
            .reset(Some(seq))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
        How::MadeAgain => match make_again(&stream, durable, config, seq).await {
            Ok(()) => Ok(()),
            Err(Undone::Deleting(e)) => Err(e),
            // Half done: the record stays (a reset was asked, and the
            // durable is gone), and the error says how to finish it.
            Err(Undone::Making(e)) => {
                drop(lease);
                return Err(Error::setup(e));
            }
        },
    };
    if let Err(e) = told {
        // Nothing was reset: the record must not open any row.
        sqlx::query("DELETE FROM inbox_resets WHERE id = $1")
            .bind(reset_id)
            .execute(pool)
            .await
            .map_err(Error::pg("taking back the reset's record"))?;
        drop(lease);
        return Err(Error::setup(format!(
            "JetStream refused the reset of {durable}: {e}"
        )));
    }
    drop(lease);
    Ok(Done {
        from_seq: seq,
        messages,
        skipped,
        how,
        applied: true,
    })
}

/// Messages from `seq` on that the durable's filter takes: the server
/// counts them for a reader of that filter starting there.
async fn to_deliver(stream: &stream::Stream, config: &consumer::Config, seq: u64) -> Result<u64> {
    let reader = stream
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: seq,
            },
            ack_policy: consumer::AckPolicy::None,
            filter_subject: config.filter_subject.clone(),
            filter_subjects: config.filter_subjects.clone(),
            inactive_threshold: Duration::from_secs(10),
            ..Default::default()
        })
        .await
        .map_err(Error::nats("counting the messages to deliver again"))?;
    Ok(reader.cached_info().num_pending)
}

/// Why a durable was not made again.
enum Undone {
    /// Not deleted: nothing changed.
    Deleting(String),
    /// Deleted, and not made again.
    Making(String),
}

/// A server before ADR-60: delete the durable and make it again, with its
/// configuration, delivering from `seq`; the making is tried a few times.
async fn make_again(
    stream: &stream::Stream,
    durable: &str,
    mut config: consumer::Config,
    seq: u64,
) -> std::result::Result<(), Undone> {
    config.deliver_policy = consumer::DeliverPolicy::ByStartSequence {
        start_sequence: seq,
    };
    stream
        .delete_consumer(durable)
        .await
        .map_err(|e| Undone::Deleting(format!("deleting the durable to make it again: {e}")))?;
    let mut last = String::new();
    for attempt in 0..MAKE_TRIES {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        match stream.create_consumer(config.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    let shown = serde_json::to_string(&config).unwrap_or_default();
    Err(Undone::Making(format!(
        "durable {durable} was deleted to start over at sequence {seq} and could not be made again ({last}). The reset stays recorded. Make it with this configuration (its deliver policy starts at {seq}) before its consumers start, which would otherwise make it from the stream's first message (the inbox drops what it processed; messages whose inbox rows were pruned would reach the handler again): {shown}"
    )))
}

/// Tries at making a deleted durable again.
const MAKE_TRIES: u32 = 5;

/// The stream sequence of the first message stored at or after `at`.
async fn first_at_or_after(
    stream: &stream::Stream,
    at: time::OffsetDateTime,
) -> Result<Option<u64>> {
    // An ephemeral reader that starts there: the server finds the sequence.
    let reader = stream
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::ByStartTime { start_time: at },
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(10),
            ..Default::default()
        })
        .await
        .map_err(Error::nats("finding the first message at that time"))?;
    let mut batch = reader
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(1))
        .messages()
        .await
        .map_err(Error::nats("finding the first message at that time"))?;
    match batch.next().await {
        // Only a message stamped at or after `at` (the server's times).
        Some(Ok(m)) => Ok(m
            .info()
            .ok()
            .filter(|i| i.published >= at)
            .map(|i| i.stream_sequence)),
        Some(Err(e)) => Err(Error::setup(format!(
            "finding the first message at that time: {e}"
        ))),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_time;

    /// Review F12: `--time` was refused as "in the future" by this host's
    /// clock; on a host whose clock is slow that is a time the stream
    /// holds. The stream judges it (see `run`).
    #[test]
    fn a_time_ahead_of_this_hosts_clock_is_the_streams_to_judge() {
        let ahead = time::OffsetDateTime::now_utc() + time::Duration::hours(1);
        let text = ahead
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
        assert_eq!(parse_time(&text).unwrap(), ahead);
        assert!(parse_time("yesterday").is_err());
    }
}
