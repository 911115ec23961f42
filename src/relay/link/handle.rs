//! A link as the publisher holds it: publish, barrier, the answers and
//! refusals in order, and whether it still works.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::super::answer::{Answer, CommitAnswer};
use super::error::LinkError;
use super::queues::{Answers, Reply, Shared, COPY_MAX};
use super::reader::{read_in, Reader};
use super::writer::{encode_head, header_block_len, write_out, Writer};

/// A publish the server refused for the NATS user's permissions: it will
/// refuse it again, so it is dead-lettered (SPEC §9).
#[derive(Debug, thiserror::Error)]
#[error("permissions violation: this NATS user may not publish to {0}")]
pub struct Denied(pub String);

/// What the link heard for one of its readers.
#[derive(Debug)]
pub enum Heard<T> {
    /// The answer to the message sent under this token.
    Answer(u64, T),
    /// The server refused a publish to this subject for the user's
    /// permissions; the message will never be answered. Refusals come in the
    /// order the messages were sent.
    Denied(String),
}

/// One connection's publishes and their answers.
pub struct Link {
    pub(super) shared: Arc<Shared>,
    /// Stops the reader and the writer.
    pub(super) _tasks: DropGuard,
    /// `<inbox>.`: a reply subject is this and a token.
    pub(super) prefix: String,
    /// The writer's count at the last [`Self::still_sending`].
    pub(super) sent_mark: u64,
    pub(super) server: String,
}

impl Link {
    /// A link over a connection whose handshake is done: its writer and
    /// reader tasks start, and stop when it is dropped. `rbuf` holds what
    /// the handshake read past its last operation.
    pub(super) fn start(
        shared: Shared,
        (reader, rbuf): (Reader, BytesMut),
        writer: Writer,
        prefix: String,
        server: String,
    ) -> Link {
        let shared = Arc::new(shared);
        let stop = CancellationToken::new();
        tokio::spawn(write_out(shared.clone(), writer, stop.clone()));
        tokio::spawn(read_in(
            shared.clone(),
            reader,
            rbuf,
            prefix.clone(),
            stop.clone(),
        ));
        Link {
            shared,
            _tasks: stop.drop_guard(),
            prefix,
            sent_mark: 0,
            server,
        }
    }

    /// Queue one message, its headers followed by `extra`, answered as
    /// `reply` says. `false`: the connection is gone, nothing was queued.
    pub fn publish(
        &mut self,
        subject: &str,
        reply: Reply,
        headers: &[(Cow<'static, str>, String)],
        extra: &[(&str, &str)],
        body: &Bytes,
    ) -> bool {
        let size = header_block_len(headers, extra) + body.len();
        if size > self.max_payload() {
            if self.shared.broken() {
                return false;
            }
            let refused = || PublishError::new(PublishErrorKind::MaxPayloadExceeded);
            match reply {
                Reply::Ack(token) => self.shared.answer(token, Err(refused())),
                Reply::Commit(token) => self.shared.commit_answer(token, Err(refused())),
                // Unanswered: the batch's commit goes without it, and the
                // server refuses the batch as incomplete.
                Reply::None => {}
            }
            return true;
        }
        let prefix = &self.prefix;
        self.shared.push(|s| {
            encode_head(
                &mut s.buf,
                subject,
                prefix,
                reply,
                headers,
                extra,
                body.len(),
            );
            if body.len() < COPY_MAX {
                s.buf.extend_from_slice(body);
            } else {
                let at = s.buf.len();
                s.bodies.push((at, body.clone()));
            }
            s.buf.extend_from_slice(b"\r\n");
        })
    }

    pub fn broken(&self) -> bool {
        self.shared.broken()
    }

    /// Everything sent so far is forgotten (sent again, or abandoned with
    /// its batch): refusals of it that are still to come must not be taken
    /// for those of the copies sent next. The server answers a PING after
    /// every message sent before it, so refusals that arrive before its
    /// PONG are of forgotten copies.
    pub fn barrier(&self) {
        // Those heard already are of forgotten copies too.
        if let Ok(mut a) = self.shared.answers.lock() {
            a.denied.clear();
        }
        self.shared.ping(true);
    }

    /// The server is leaving (lame duck mode): nothing new should go on
    /// this link once what is in flight on it is answered.
    pub fn lame_duck(&self) -> bool {
        self.shared.lame_duck.load(Ordering::Relaxed)
    }

    /// The server it is connected to (`host:port`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// From now on the writer writes nothing once `fence` broke.
    pub fn set_fence(&self, fence: super::super::fence::Fence) {
        let _ = self.shared.fence.set(fence);
    }

    /// Whether the writer is still behind what was queued and wrote
    /// something since the last call: an answer that is late because its
    /// message has not left yet (a large batch on a slow network) is not
    /// silence. A writer that made no progress for a whole call interval
    /// (a server that stopped reading) is.
    pub fn still_sending(&mut self) -> bool {
        let written = self.shared.written.load(Ordering::Relaxed);
        let queued = self.shared.out.lock().map_or(0, |s| s.queued);
        let moving = written < queued && written > self.sent_mark;
        self.sent_mark = written;
        moving
    }

    /// The `max_payload` of the connection: the server's, or the
    /// account's or user's where smaller.
    pub fn max_payload(&self) -> usize {
        self.shared.max_payload.load(Ordering::Relaxed)
    }

    /// The next answer (a reply token and what it says), or a refusal.
    /// Cancel-safe: answers wait in the shared queue.
    pub async fn next_answer(&mut self) -> Result<Heard<Answer>, LinkError> {
        self.next_from(|a| a.queue.pop_front(), &self.shared.answered)
            .await
    }

    /// The next answer to a batch's commit ([`Reply::Commit`]), or a
    /// refusal. Cancel-safe, as [`Self::next_answer`].
    pub async fn next_commit(&mut self) -> Result<Heard<CommitAnswer>, LinkError> {
        self.next_from(|a| a.commits.pop_front(), &self.shared.committed)
            .await
    }

    /// A refusal first (both readers hear them, in order), else what
    /// `take` finds in its queue, waiting on `wake` until there is
    /// something, or the link's end once nothing is left.
    async fn next_from<T>(
        &self,
        take: impl Fn(&mut Answers) -> Option<(u64, T)>,
        wake: &Notify,
    ) -> Result<Heard<T>, LinkError> {
        loop {
            {
                let mut a = self.shared.answers.lock().map_err(|_| LinkError::Closed)?;
                if let Some(subject) = a.denied.pop_front() {
                    return Ok(Heard::Denied(subject));
                }
                if let Some((token, answer)) = take(&mut a) {
                    return Ok(Heard::Answer(token, answer));
                }
                if let Some(why) = &a.closed {
                    return Err(LinkError::Ended(why.clone()));
                }
            }
            // A notification sent since the check is kept as a permit.
            wake.notified().await;
        }
    }
}
