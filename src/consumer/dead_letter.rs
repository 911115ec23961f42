//! Consumer dead letters: `{prefix}.{original subject}`, original body and
//! headers plus the `Outbox-Dlq-*` headers. `Nats-Msg-Id` is
//! `{consumer}:{original id}` ([`wire::consumer_dlq_msg_id`]; a message
//! dead-lettered again after a reset or replay gets `:{n}` more, so the DLQ
//! keeps that dead letter too), and two consumers' copies, which share the
//! DLQ stream, never deduplicate each other (SPEC §6 said the original id;
//! that dropped the second consumer's dead letter). The original id is in
//! `Outbox-Dlq-Original-Id`.

use async_nats::jetstream::{self, context::GetStreamByNameErrorKind, stream, Context};
use async_nats::HeaderMap;

use crate::error::{Error, PublishFailure, Result};
use crate::wire;

#[derive(Clone)]
pub struct DeadLetters {
    js: Context,
    prefix: String,
    consumer: String,
    /// The stream that captures `{prefix}.>`.
    stream: String,
    /// The stream the consumer reads: where an original stays.
    source: String,
    /// The largest message the dead-letter stream takes (the server's max
    /// payload, or the stream's own limit when lower).
    max_message: usize,
}

impl DeadLetters {
    /// Make sure a stream captures `{prefix}.>`, creating one when none does.
    /// `source`: the stream the consumer reads.
    pub async fn new(
        js: Context,
        prefix: &str,
        consumer: &str,
        source: &str,
        replicas: u8,
    ) -> Result<Self> {
        let probe = format!("{prefix}.probe");
        let stream = match js.stream_by_subject(&probe).await {
            // Stored there, a dead letter would come back as an event of its
            // own stream (and its id, the original's, be deduplicated).
            Ok(name) if name == source => {
                return Err(Error::setup(format!(
                    "stream {source}, which this consumer reads, captures the dead-letter subjects {prefix}.>: dead letters would come back to the handler as events; choose a --dlq-prefix outside its subjects, or narrow them"
                )))
            }
            Ok(name) => {
                tracing::info!(stream = %name, prefix, "dead letters go to an existing stream");
                name
            }
            Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
                let name = wire::dlq_stream_name(prefix);
                js.create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![format!("{prefix}.>")],
                    storage: stream::StorageType::File,
                    num_replicas: usize::from(replicas),
                    ..Default::default()
                })
                .await
                .map_err(|e| Error::Setup {
                    message: format!(
                        "cannot create dead-letter stream {name} on {prefix}.>: {e}; choose another --dlq-prefix"
                    ),
                    source: Some(Box::new(e)),
                })?;
                tracing::info!(stream = %name, prefix, "created dead-letter stream");
                name
            }
            Err(e) => return Err(Error::nats("looking up the dead-letter stream")(e)),
        };
        let server_max = js.client().server_info().max_payload;
        let stream_max = match js.get_stream(&stream).await {
            Ok(s) => usize::try_from(s.cached_info().config.max_message_size)
                .ok()
                .filter(|&m| m > 0),
            Err(e) => return Err(Error::nats("reading the dead-letter stream's limits")(e)),
        };
        Ok(Self {
            js,
            prefix: prefix.to_owned(),
            consumer: consumer.to_owned(),
            stream,
            source: source.to_owned(),
            max_message: stream_max.map_or(server_max, |m| m.min(server_max)),
        })
    }

    /// Where the dead-letter stream lives, as it is now (for the
    /// durability judgement).
    pub async fn placement(&self) -> Result<crate::durability::Placement> {
        let mut stream = self
            .js
            .get_stream(&self.stream)
            .await
            .map_err(Error::nats("reading the dead-letter stream"))?;
        let info = stream
            .info()
            .await
            .map_err(Error::nats("reading the dead-letter stream"))?;
        Ok(crate::durability::Placement::of(info))
    }

    /// The dead-letter stream, and the filter its dead letters are on.
    pub fn stream(&self) -> (&str, String) {
        (&self.stream, format!("{}.>", self.prefix))
    }

    /// Publish and wait for JetStream's ack: only then may the original be acked.
    /// `original_id` is the message's `Nats-Msg-Id`, or a stand-in when it
    /// has none.
    pub async fn publish(
        &self,
        msg: &Message<'_>,
        original_id: &str,
        reason: &str,
        attempts: i64,
        generation: i32,
    ) -> Result<()> {
        let mut headers = HeaderMap::new();
        if let Some(h) = msg.headers {
            for (k, vs) in h.iter() {
                let name = k.to_string();
                // Our own Nats-Msg-Id below; publish expectations of the
                // original (the relay's ordering chain) must not apply here.
                if name
                    .to_ascii_lowercase()
                    .starts_with(wire::NATS_HEADER_PREFIX)
                {
                    continue;
                }
                for v in vs {
                    headers.append(name.as_str(), v.as_str());
                }
            }
        }
        let msg_id = wire::consumer_dlq_msg_id(&self.consumer, original_id, generation);
        headers.insert(wire::MSG_ID, msg_id.as_str());
        headers.insert(wire::DLQ_ORIGINAL_ID, original_id);
        headers.insert(wire::DLQ_REASON, one_line(reason).as_str());
        let class = crate::triage::Class::of_consumer(reason);
        for (k, v) in crate::triage::headers(class, reason, None) {
            headers.insert(k, v.as_str());
        }
        headers.insert(wire::DLQ_ATTEMPTS, attempts.to_string().as_str());
        headers.insert(wire::DLQ_ORIGINAL_SUBJECT, msg.subject);
        headers.insert(wire::DLQ_CONSUMER, self.consumer.as_str());
        headers.insert(wire::DLQ_ORIGINAL_STREAM, self.source.as_str());
        headers.insert(wire::DLQ_ORIGINAL_SEQ, msg.seq.to_string().as_str());
        // With the headers added, a message near the limit no longer fits:
        // refused on every try, it would hold its aggregate for ever. The
        // dead letter keeps everything but the body, and where it is.
        let mut payload = msg.payload.clone();
        if crate::nats::header_size(&headers) + payload.len() > self.max_message {
            tracing::warn!(
                id = original_id,
                bytes = payload.len(),
                "the dead letter would exceed the dead-letter stream's message limit: stored without its body, which stays in stream {} at sequence {}",
                self.source,
                msg.seq
            );
            headers.insert(
                wire::DLQ_PAYLOAD_OMITTED,
                payload.len().to_string().as_str(),
            );
            payload = bytes::Bytes::new();
        }
        let subject = wire::consumer_dlq_subject(&self.prefix, msg.subject);
        let ack = self
            .js
            .send_publish(
                subject,
                jetstream::message::PublishMessage::build()
                    .payload(payload)
                    .headers(headers),
            )
            .await
            .map_err(|e| dlq_error(&msg_id, PublishFailure::Send, e))?;
        ack.await
            .map_err(|e| dlq_error(&msg_id, PublishFailure::Other, e))?;
        Ok(())
    }
}

/// A message as the dead-letter queue needs it, pulled or read back.
pub struct Message<'a> {
    pub subject: &'a str,
    pub headers: Option<&'a HeaderMap>,
    pub payload: &'a bytes::Bytes,
    /// Its sequence in the consumer's stream.
    pub seq: u64,
}

fn dlq_error(
    msg_id: &str,
    failure: PublishFailure,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Publish {
        id: format!("{msg_id} (dead letter)"),
        failure,
        source: Box::new(e),
    }
}

fn one_line(s: &str) -> String {
    let s = s.replace(['\r', '\n'], " ");
    s.chars().take(500).collect()
}
