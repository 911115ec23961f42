//! The streams the relay writes to: made or checked at start
//! ([`ensure_stream`]), the streams rows name looked up, and one missing
//! watched until it appears.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream, Context};
use tokio_util::sync::CancellationToken;

use crate::durability::Placement;
use crate::error::{Error, Result};
use crate::relay::config::PublishMode;
use crate::relay::route::subject_matches;
use crate::wire;

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
pub(super) const CHAIN_RESERVE: usize =
    wire::EXPECTED_LAST_MSG_ID.len() + 4 + crate::relay::outbox_row::MAX_ID_BYTES;
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
    let mut streams = crate::relay::route::Streams {
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
pub type Routed = (crate::relay::route::Streams, Option<usize>, Vec<Placement>);

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

#[cfg(test)]
mod tests {
    use super::server_batches;

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
