//! JetStream's answers to the per-event publishes, read off the session's
//! publish link ([`super::link`]), which subscribes to one inbox for them.
//!
//! async-nats' JetStream publish makes each message a request: a semaphore
//! permit, a fresh inbox name, an entry in the client's reply map, a
//! channel, a boxed future and an ack timer, per event. Measured on this
//! project's box (docs/guide/benchmarks.md, "What a cheaper ack path would
//! buy") that path cost 4.05 µs of client CPU per message against 3.00-3.15
//! for plain publishes whose reply subject is `<inbox>.<n>` under one
//! wildcard subscription, the answers matched by `n`. The publisher already
//! keeps its messages in publish order, so `n` is a counter and the books
//! are a queue ([`AckQueue`], no I/O); [`Inbox`] feeds it from the
//! link.
//!
//! An answer is read in [`super::answer`], which the link uses too.

use std::collections::VecDeque;
use std::time::Instant;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};

use super::answer::Answer;
use super::link::{Heard, Link, Reply};
use super::route::OutMessage;
use crate::wire;

/// What the inbox says next.
#[derive(Debug)]
pub enum Next {
    /// The oldest message's answer (or its probe timing out).
    Ack(Answer),
    /// A later message was refused for want of a stream or out of order:
    /// the ones before it, still unanswered, may be waiting at a leader
    /// that is gone.
    Trouble,
    /// The server refused a publish to this subject for the NATS user's
    /// permissions: the oldest unanswered message to it was that publish
    /// (see [`AckQueue::deny`]).
    Denied(String),
}

#[derive(Debug)]
struct Slot {
    answer: Option<Answer>,
    /// A probe's own ack timeout.
    deadline: Option<Instant>,
}

/// The messages in flight, oldest first, each with its answer once in.
/// Tokens count up for the life of the queue, so an answer to a copy that
/// was forgotten (sent again under a new token) is recognised and dropped.
#[derive(Debug, Default)]
pub struct AckQueue {
    /// Token of the oldest slot.
    first: u64,
    slots: VecDeque<Slot>,
    trouble: bool,
}

impl AckQueue {
    /// The token the next [`push`](Self::push) gets.
    pub fn next_token(&self) -> u64 {
        self.first + self.slots.len() as u64
    }

    pub fn push(&mut self, deadline: Option<Instant>) -> u64 {
        let token = self.next_token();
        self.slots.push_back(Slot {
            answer: None,
            deadline,
        });
        token
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Forget everything in flight: it is being sent again, and late
    /// answers to these copies must not count for the new ones.
    pub fn forget(&mut self) {
        self.first = self.next_token();
        self.slots.clear();
        self.trouble = false;
    }

    /// Record an answer. Answers to forgotten copies, to unknown tokens and
    /// repeated answers are dropped.
    pub fn answer(&mut self, token: u64, answer: Answer) {
        let Some(i) = token.checked_sub(self.first) else {
            return;
        };
        let Some(slot) = usize::try_from(i).ok().and_then(|i| self.slots.get_mut(i)) else {
            return;
        };
        if slot.answer.is_some() {
            return;
        }
        if i > 0
            && answer.as_ref().is_err_and(|e| {
                matches!(
                    e.kind(),
                    PublishErrorKind::StreamNotFound | PublishErrorKind::WrongLastMessageId
                )
            })
        {
            self.trouble = true;
        }
        slot.answer = Some(answer);
    }

    /// The `i`-th unanswered message in flight, counting from the oldest,
    /// for which `is_it` holds: its token.
    pub fn unanswered_where(&self, mut is_it: impl FnMut(usize) -> bool) -> Option<u64> {
        self.slots
            .iter()
            .enumerate()
            .find(|(i, s)| s.answer.is_none() && is_it(*i))
            .map(|(i, _)| self.first + i as u64)
    }

    /// The oldest message's answer if it is in, or a timeout if its probe
    /// deadline passed; else a later message's trouble, once.
    pub fn take(&mut self, now: Instant) -> Option<Next> {
        let front = self.slots.front()?;
        let timed_out = front.answer.is_none() && front.deadline.is_some_and(|d| d <= now);
        if front.answer.is_some() || timed_out {
            let slot = self.slots.pop_front()?;
            self.first += 1;
            let answer = slot
                .answer
                .unwrap_or_else(|| Err(PublishError::new(PublishErrorKind::TimedOut)));
            return Some(Next::Ack(answer));
        }
        std::mem::take(&mut self.trouble).then_some(Next::Trouble)
    }

    /// When the oldest message's probe times out, if it is a probe.
    pub fn deadline(&self) -> Option<Instant> {
        self.slots
            .front()
            .filter(|s| s.answer.is_none())
            .and_then(|s| s.deadline)
    }
}

/// The session's publish link and the queue its answers feed.
pub struct Inbox {
    link: Link,
    /// The link failed: nothing more will be answered on it.
    dead: bool,
    pub queue: AckQueue,
    /// Any instant, for [`AckQueue::take`] when no probe deadline is
    /// pending and the time cannot matter: a clock read per ack saved.
    opened: Instant,
}

impl Inbox {
    pub fn new(link: Link) -> Self {
        Self {
            link,
            dead: false,
            queue: AckQueue::default(),
            opened: Instant::now(),
        }
    }

    /// Queue a message whose answer is the next pushed slot's; `false`:
    /// the link is gone.
    pub fn publish(&mut self, msg: &OutMessage, expected_last_msg_id: Option<&str>) -> bool {
        let chain = expected_last_msg_id.map(|id| (wire::EXPECTED_LAST_MSG_ID, id));
        !self.dead
            && self.link.publish(
                &msg.subject,
                Reply::Ack(self.queue.next_token()),
                &msg.headers,
                chain.as_slice(),
                &msg.body,
            )
    }

    /// The link itself, for the batch path (which uses it only while
    /// nothing per-event is in flight).
    pub fn link(&mut self) -> &mut Link {
        &mut self.link
    }

    /// The link failed: what is in flight on it will not be answered.
    pub fn broken(&self) -> bool {
        self.dead || self.link.broken()
    }

    /// The link's server is leaving: what is in flight on it is still
    /// answered, nothing new should go.
    pub fn leaving(&self) -> bool {
        self.link.lame_duck()
    }

    /// The next [`Next`]; `None` when nothing is in flight. Cancel-safe:
    /// an answer read is recorded before anything else is awaited.
    pub async fn next(&mut self) -> Option<Next> {
        loop {
            let deadline = self.queue.deadline();
            let now = deadline.map_or(self.opened, |_| Instant::now());
            if let Some(next) = self.queue.take(now) {
                return Some(next);
            }
            if self.queue.is_empty() {
                return None;
            }
            if self.dead {
                // Nothing will answer: the oldest fails, and the publisher
                // sends everything again on a new link.
                let t = self.queue.first;
                self.queue
                    .answer(t, Err(PublishError::new(PublishErrorKind::BrokenPipe)));
                continue;
            }
            tokio::select! {
                biased;
                a = self.link.next_answer() => match a {
                    Ok(Heard::Answer(token, answer)) => self.queue.answer(token, answer),
                    Ok(Heard::Denied(subject)) => return Some(Next::Denied(subject)),
                    Err(e) => {
                        tracing::warn!(error = %e, "the publish connection failed");
                        self.dead = true;
                    }
                },
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now).into()),
                    if deadline.is_some() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn ok(n: &Next) -> Option<bool> {
        match n {
            Next::Ack(Ok(d)) => Some(*d),
            _ => None,
        }
    }

    #[test]
    fn answers_come_out_in_publish_order() {
        let mut q = AckQueue::default();
        let a = q.push(None);
        let b = q.push(None);
        q.answer(b, Ok(true));
        assert!(q.take(Instant::now()).is_none(), "b waits for a");
        q.answer(a, Ok(false));
        assert_eq!(q.take(Instant::now()).as_ref().and_then(ok), Some(false));
        assert_eq!(q.take(Instant::now()).as_ref().and_then(ok), Some(true));
        assert!(q.is_empty());
    }

    #[test]
    fn forgotten_copies_and_unknown_tokens_do_not_count() {
        let mut q = AckQueue::default();
        let old = q.push(None);
        q.forget();
        let new = q.push(None);
        assert_ne!(old, new);
        q.answer(old, Ok(false));
        q.answer(new + 7, Ok(false));
        assert!(q.take(Instant::now()).is_none());
        q.answer(new, Ok(true));
        q.answer(new, Ok(false));
        assert_eq!(q.take(Instant::now()).as_ref().and_then(ok), Some(true));
    }

    #[test]
    fn a_later_refusal_for_want_of_a_stream_is_trouble_once() {
        let mut q = AckQueue::default();
        q.push(None);
        let b = q.push(None);
        q.answer(b, Err(PublishError::new(PublishErrorKind::StreamNotFound)));
        assert!(matches!(q.take(Instant::now()), Some(Next::Trouble)));
        assert!(q.take(Instant::now()).is_none());
    }

    #[test]
    fn the_oldest_refused_is_its_answer_not_trouble() {
        let mut q = AckQueue::default();
        let a = q.push(None);
        q.answer(a, Err(PublishError::new(PublishErrorKind::StreamNotFound)));
        assert!(matches!(
            q.take(Instant::now()),
            Some(Next::Ack(Err(e))) if e.kind() == PublishErrorKind::StreamNotFound
        ));
    }

    #[test]
    fn a_probe_times_out_at_its_deadline() {
        let mut q = AckQueue::default();
        let now = Instant::now();
        q.push(Some(now + Duration::from_millis(5)));
        assert_eq!(q.deadline(), Some(now + Duration::from_millis(5)));
        assert!(q.take(now).is_none());
        assert!(matches!(
            q.take(now + Duration::from_millis(5)),
            Some(Next::Ack(Err(e))) if e.kind() == PublishErrorKind::TimedOut
        ));
    }

    proptest! {
        /// However answers arrive (any order, repeats, stale copies), each
        /// message's own answer comes out, in publish order.
        #[test]
        fn each_answer_comes_out_in_order(n in 1usize..40, order in proptest::collection::vec(0usize..40, 0..120), stale in 0u64..5) {
            let mut q = AckQueue::default();
            for _ in 0..stale { q.push(None); }
            q.forget();
            let tokens: Vec<u64> = (0..n).map(|_| q.push(None)).collect();
            let mut out = Vec::new();
            let mut feed: Vec<usize> = order.into_iter().filter(|&i| i < n).collect();
            feed.extend(0..n);
            for i in feed {
                // Token parity tells the duplicate flag: each answer is its own.
                q.answer(tokens[i], Ok(tokens[i].is_multiple_of(2)));
                if stale > 0 {
                    q.answer(i as u64 % stale, Ok(false));
                }
                while let Some(Next::Ack(a)) = q.take(Instant::now()) {
                    out.push(a.ok());
                }
            }
            let want: Vec<Option<bool>> = tokens.iter().map(|t| Some(t.is_multiple_of(2))).collect();
            prop_assert_eq!(out, want);
        }
    }
}
