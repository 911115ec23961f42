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
        // A replicated stream's leader notes an id before it proposes the
        // message, with no sequence yet, and keeps the note if the message
        // is then refused (out of order, say) until the duplicate window
        // ends. nats-server 2.10 answers a copy sent meanwhile as a
        // duplicate of sequence 0; later releases answer 10158, "in
        // process". Either way nothing says it is stored: taken for a
        // duplicate, it was acked and lost.
        (None, Some(0)) if body.duplicate => Err(PublishError::with_source(
            PublishErrorKind::Other,
            in_process(),
        )),
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

/// The API error newer servers give where 2.10 says "duplicate of
/// sequence 0" (see [`read_commit`]).
fn in_process() -> jetstream::Error {
    serde_json::from_str(
        r#"{"code":400,"err_code":10158,"description":"duplicate message id is in process"}"#,
    )
    .expect("a fixed API error parses")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duplicate_of_sequence_zero_is_in_process_not_stored() {
        let answer = read(None, br#"{"stream":"S","seq":0,"duplicate":true}"#);
        let e = answer.expect_err("not stored");
        let api = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<jetstream::Error>());
        assert_eq!(api.map(|a| a.error_code().0), Some(10158));
        assert_eq!(
            read(None, br#"{"stream":"S","seq":5,"duplicate":true}"#).ok(),
            Some(true)
        );
    }

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
