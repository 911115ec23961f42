//! What the session and a link's two tasks share: the bytes to write, the
//! answers read (per-event acks, batch commits, permission refusals), the
//! PINGs in flight, and what later INFOs changed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

use super::super::answer::{Answer, CommitAnswer};

/// How a message is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Not at all: a batch's message before its commit (the server answers
    /// only the commit).
    None,
    /// A per-event publish: its ack, under this token.
    Ack(u64),
    /// A batch's commit: the batch's ack, under this token.
    Commit(u64),
}

/// A commit's reply subject is `<inbox>.c<token>`, an ack's `<inbox>.<token>`.
pub(super) const COMMIT: u8 = b'c';

/// What the session and the link's two tasks share: bytes to write, and
/// answers read.
#[derive(Default)]
pub(super) struct Shared {
    pub(super) out: Mutex<OutState>,
    /// The writer's: the buffer filled from empty.
    pub(super) wrote: Notify,
    pub(super) answers: Mutex<Answers>,
    /// The session's: an answer came in, or the link closed.
    pub(super) answered: Notify,
    /// The session's: a commit's answer came in, or the link closed.
    pub(super) committed: Notify,
    /// Bytes ever written to the socket.
    pub(super) written: AtomicU64,
    /// The connection's `max_payload`: a larger message would make the
    /// server close it, so it is refused here instead. The server's, until
    /// the INFO it sends after CONNECT gives the account's or user's (and
    /// any later INFO a new one).
    pub(super) max_payload: AtomicUsize,
    /// Nothing queued before a pause is written after it (see
    /// [`super::fence`]).
    pub(super) fence: std::sync::OnceLock<super::super::fence::Fence>,
    /// Our PINGs not answered yet, oldest first: `true` for a barrier
    /// (see [`Link::barrier`]), `false` for a keepalive. PONGs come in
    /// order, so each answers the oldest.
    pub(super) pings: Mutex<VecDeque<bool>>,
    /// Operations the reader has heard: the keepalive sees silence as no
    /// change between its ticks. A count, not a clock: reading the clock
    /// on every answer costs the hot path (tokio's clock takes a lock).
    pub(super) heard: AtomicU64,
    /// The server said it is leaving (lame duck mode, INFO `ldm`).
    pub(super) lame_duck: std::sync::atomic::AtomicBool,
    /// Where cluster servers the server announces later go (the dialer's).
    pub(super) announced: Arc<Mutex<Vec<String>>>,
}

impl Shared {
    pub(super) fn new(max_payload: usize, announced: Arc<Mutex<Vec<String>>>) -> Self {
        let s = Self {
            announced,
            ..Self::default()
        };
        s.max_payload.store(max_payload, Ordering::Relaxed);
        s
    }

    /// Queue a PING, remembering what it is for; `false` if the link is
    /// gone. The queue's lock is held while the PING is queued, so the
    /// order of the queue is the order on the wire.
    pub(super) fn ping(&self, barrier: bool) -> bool {
        let Ok(mut pings) = self.pings.lock() else {
            return false;
        };
        let queued = self.push(|s| s.buf.extend_from_slice(b"PING\r\n"));
        if queued {
            pings.push_back(barrier);
        }
        queued
    }

    pub(super) fn barrier_pending(&self) -> bool {
        self.pings.lock().is_ok_and(|p| p.contains(&true))
    }
}

/// What an INFO after the first may change for the link.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct InfoUpdate {
    #[serde(default)]
    pub(super) max_payload: Option<usize>,
    /// Lame duck mode: the server will close its connections soon.
    #[serde(default)]
    pub(super) ldm: bool,
    #[serde(default)]
    pub(super) connect_urls: Vec<String>,
}

impl InfoUpdate {
    pub(super) fn read(json: &[u8]) -> Self {
        serde_json::from_slice(json).unwrap_or_default()
    }
}

#[derive(Default)]
pub(super) struct OutState {
    /// Bytes ever queued (what the writer's count catches up to).
    pub(super) queued: u64,
    pub(super) buf: Vec<u8>,
    /// Large bodies, not copied: each goes out at its offset in `buf`.
    pub(super) bodies: Vec<(usize, Bytes)>,
    pub(super) broken: bool,
}

/// A body at least this large is written from the message's own bytes
/// instead of being copied into the buffer: the window may hold 16 MiB of
/// them, and a copy would hold it twice.
pub(super) const COPY_MAX: usize = 16 * 1024;

#[derive(Default)]
pub(super) struct Answers {
    pub(super) queue: VecDeque<(u64, Answer)>,
    pub(super) commits: VecDeque<(u64, CommitAnswer)>,
    /// Subjects the server refused a publish to, in the order it refused
    /// them (see [`Heard::Denied`]).
    pub(super) denied: VecDeque<String>,
    /// Why the link closed, once it has.
    pub(super) closed: Option<String>,
}

impl Shared {
    /// Append with `fill`; `false` if the link is gone.
    pub(super) fn push(&self, fill: impl FnOnce(&mut OutState)) -> bool {
        let Ok(mut s) = self.out.lock() else {
            return false;
        };
        if s.broken {
            return false;
        }
        let was_empty = s.buf.is_empty();
        let (len, bodies) = (s.buf.len(), s.bodies.len());
        fill(&mut s);
        let added = s.buf.len() - len
            + s.bodies[bodies..]
                .iter()
                .map(|(_, b)| b.len())
                .sum::<usize>();
        s.queued += added as u64;
        drop(s);
        if was_empty {
            self.wrote.notify_one();
        }
        true
    }

    pub(super) fn answer(&self, token: u64, answer: Answer) {
        if let Ok(mut a) = self.answers.lock() {
            a.queue.push_back((token, answer));
        }
        self.answered.notify_one();
    }

    pub(super) fn commit_answer(&self, token: u64, answer: CommitAnswer) {
        if let Ok(mut a) = self.answers.lock() {
            a.commits.push_back((token, answer));
        }
        self.committed.notify_one();
    }

    /// The server refused a publish to `subject` (it keeps the connection
    /// and never answers that message): both readers hear it.
    pub(super) fn deny(&self, subject: String) {
        if let Ok(mut a) = self.answers.lock() {
            a.denied.push_back(subject);
        }
        self.answered.notify_one();
        self.committed.notify_one();
    }

    /// Nothing more goes out or comes in.
    pub(super) fn close(&self, why: String) {
        if let Ok(mut s) = self.out.lock() {
            s.broken = true;
            s.buf = Vec::new();
            s.bodies = Vec::new();
        }
        if let Ok(mut a) = self.answers.lock() {
            a.closed.get_or_insert(why);
        }
        self.answered.notify_one();
        self.committed.notify_one();
    }

    pub(super) fn broken(&self) -> bool {
        self.out.lock().map_or(true, |s| s.broken)
    }
}
