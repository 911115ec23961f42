//! What a failed publish means: no leader (wait for one), a message the
//! server will never take (a dead letter), a full stream, a subject the
//! relay may not publish to, or a failure that ends the session.

use async_nats::jetstream;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};

use crate::error::{Error, PublishFailure};
use crate::metrics as m;
use crate::relay::link::Denied;

/// No leader took the message: nobody listens on the stream's subjects
/// (between a leader's death and the election), or no answer came.
pub(super) fn leaderless(e: &PublishError) -> bool {
    matches!(
        e.kind(),
        PublishErrorKind::StreamNotFound
            | PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
    )
}

/// 10158: a copy of the message (same id) is being stored right now; its
/// outcome is not known yet.
pub(super) fn in_process(e: &PublishError) -> bool {
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    api.is_some_and(|a| a.error_code().0 == 10158)
}

/// Whether the server refused this message for what it is (so it will
/// refuse it again), not for the stream's or the connection's state.
pub(super) fn refuses_the_message(e: &PublishError) -> bool {
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
pub(super) fn stream_full(e: &PublishError) -> bool {
    let api = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    api.is_some_and(|a| {
        a.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED
            && a.to_string().contains("maximum")
    })
}

/// Refused for the NATS user's permissions ([`Denied`]).
pub(crate) fn denied(e: &PublishError) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.downcast_ref::<Denied>().is_some())
}

pub(super) fn refused(id: String, e: PublishError) -> Error {
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
