//! JetStream's answer to a publish or a batch commit, read the way
//! async-nats reads it: a `503` status is no stream listening
//! (`StreamNotFound`), an `error` object maps its code
//! (`WrongLastMessageId`, `WrongLastSequence`, else `Other` carrying the
//! API error), and an ack says whether it was a duplicate. Pure; the
//! publish link reads answers off the wire with it, the ack queue keeps
//! them ([`super::acks`]).

use async_nats::jetstream;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::StatusCode;
use serde::Deserialize;

/// One publish's outcome: `Ok(duplicate)`.
pub type Answer = Result<bool, PublishError>;

/// A batch commit's outcome.
pub type CommitAnswer = Result<Stored, PublishError>;

/// What a positive answer says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub duplicate: bool,
    /// The id of the batch a commit's answer is for; none on a publish
    /// that was not a batch (and from a server that ignored the batch
    /// headers).
    pub batch: Option<String>,
}

/// Read one answer as async-nats' JetStream publish reads it.
pub fn read(status: Option<StatusCode>, payload: &[u8]) -> Answer {
    read_commit(status, payload).map(|s| s.duplicate)
}

/// [`read`], keeping the batch id a commit's answer carries.
pub fn read_commit(status: Option<StatusCode>, payload: &[u8]) -> CommitAnswer {
    if status == Some(StatusCode::NO_RESPONDERS) {
        return Err(PublishError::new(PublishErrorKind::StreamNotFound));
    }
    #[derive(Deserialize)]
    struct Body {
        error: Option<jetstream::Error>,
        seq: Option<u64>,
        #[serde(default)]
        duplicate: bool,
        batch: Option<String>,
    }
    let body: Body = serde_json::from_slice(payload)
        .map_err(|e| PublishError::with_source(PublishErrorKind::Other, e))?;
    match (body.error, body.seq) {
        (Some(error), _) => {
            let kind = match error.error_code() {
                jetstream::ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID => {
                    PublishErrorKind::WrongLastMessageId
                }
                jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE => {
                    PublishErrorKind::WrongLastSequence
                }
                _ => PublishErrorKind::Other,
            };
            Err(PublishError::with_source(kind, error))
        }
        (None, Some(_)) => Ok(Stored {
            duplicate: body.duplicate,
            batch: body.batch,
        }),
        (None, None) => Err(PublishError::with_source(
            PublishErrorKind::Other,
            format!(
                "not a publish ack: {}",
                String::from_utf8_lossy(&payload[..payload.len().min(200)])
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_read_as_async_nats_reads_them() {
        assert_eq!(read(None, br#"{"stream":"S","seq":7}"#).ok(), Some(false));
        assert_eq!(
            read(None, br#"{"stream":"S","seq":7,"duplicate":true}"#).ok(),
            Some(true)
        );
        let kind = |r: Answer| r.err().map(|e| e.kind());
        assert_eq!(
            kind(read(Some(StatusCode::NO_RESPONDERS), b"")),
            Some(PublishErrorKind::StreamNotFound)
        );
        assert_eq!(
            kind(read(
                None,
                br#"{"error":{"code":400,"err_code":10070,"description":"wrong last msg ID: x"}}"#
            )),
            Some(PublishErrorKind::WrongLastMessageId)
        );
        let refused = read(
            None,
            br#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#,
        )
        .unwrap_err();
        assert_eq!(refused.kind(), PublishErrorKind::Other);
        let api = std::error::Error::source(&refused)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .map(|a| a.error_code());
        assert_eq!(
            api,
            Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
        );
        assert_eq!(kind(read(None, b"{}")), Some(PublishErrorKind::Other));
        assert_eq!(kind(read(None, b"")), Some(PublishErrorKind::Other));
    }
}
