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
    /// A later message was refused for want of a stream, or out of order
    /// behind an unanswered message of its own stream: the ones before it
    /// may be waiting at a leader that is gone.
    Trouble,
    /// A later message (this token) was refused out of order although
    /// every earlier message of its stream was stored: another writer
    /// appended to that stream. It and the later messages of its lane go
    /// again; the other lanes' are not touched.
    Reorder(u64),
    /// The server refused a publish to this subject for the NATS user's
    /// permissions: the oldest unanswered message to it was that publish
    /// (see [`AckQueue::deny`]).
    Denied(String),
}

#[derive(Debug)]
struct Slot {
    token: u64,
    /// The stream the message went to (see [`Lane`]).
    lane: Lane,
    answer: Option<Answer>,
    /// A probe's own ack timeout.
    deadline: Option<Instant>,
}

/// Which stream's order chain a message is in, as the publisher numbers
/// them: the server keeps order per stream, so a refusal out of order
/// says something about its own stream alone.
pub type Lane = u32;

/// The messages in flight, oldest first, each with its answer once in.
/// Tokens count up for the life of the queue, so an answer to a copy that
/// was forgotten (sent again under a new token) is recognised and dropped.
/// Slots are in token order, not always contiguous: a lane's messages
/// may be taken out from the middle ([`AckQueue::take_lane`]).
#[derive(Debug, Default)]
pub struct AckQueue {
    /// The token the next push gets.
    next: u64,
    slots: VecDeque<Slot>,
    trouble: bool,
    /// Tokens refused out of order with their lane's earlier messages
    /// stored, oldest first; stale ones (taken out since) are skipped.
    reorders: std::collections::BTreeSet<u64>,
}

impl AckQueue {
    /// The token the next [`push`](Self::push) gets.
    pub fn next_token(&self) -> u64 {
        self.next
    }

    pub fn push(&mut self, deadline: Option<Instant>, lane: Lane) -> u64 {
        let token = self.next;
        self.next += 1;
        self.slots.push_back(Slot {
            token,
            lane,
            answer: None,
            deadline,
        });
        token
    }

    /// Where `token`'s slot is: its offset from the oldest when nothing
    /// was taken out before it (the answer path's common case), else
    /// found by search.
    pub fn index(&self, token: u64) -> Option<usize> {
        let front = self.slots.front()?.token;
        let guess = usize::try_from(token.checked_sub(front)?).ok()?;
        match self.slots.get(guess) {
            Some(s) if s.token == token => Some(guess),
            _ => self.slots.binary_search_by_key(&token, |s| s.token).ok(),
        }
    }

    /// The lane of the slot at `i`.
    pub fn lane_at(&self, i: usize) -> Option<Lane> {
        self.slots.get(i).map(|s| s.lane)
    }

    /// Take out the slots of `lane` from index `from` on, their late
    /// answers dropped from now: which indices they had, ascending.
    pub fn take_lane(&mut self, from: usize, lane: Lane) -> Vec<usize> {
        let mut taken = Vec::new();
        let mut i = 0;
        self.slots.retain(|s| {
            let out = i >= from && s.lane == lane;
            if out {
                taken.push(i);
            }
            i += 1;
            !out
        });
        taken
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
        self.slots.clear();
        self.trouble = false;
        self.reorders.clear();
    }

    /// Record an answer. Answers to forgotten copies, to unknown tokens and
    /// repeated answers are dropped.
    pub fn answer(&mut self, token: u64, answer: Answer) {
        let Some(i) = self.index(token) else {
            return;
        };
        if self.slots[i].answer.is_some() {
            return;
        }
        if i > 0 {
            match answer.as_ref().map_err(|e| e.kind()) {
                Err(PublishErrorKind::StreamNotFound) => self.trouble = true,
                Err(PublishErrorKind::WrongLastMessageId) => self.out_of_order(i),
                _ => {}
            }
        }
        self.slots[i].answer = Some(answer);
    }

    /// The message at `i` (not the oldest) was refused out of order. The
    /// server answers one stream's messages in the order they came, so its
    /// lane's previous message tells why: stored, and another writer
    /// appended in between; refused, and this one goes again with it;
    /// unanswered, and it may be lost at a leader that is gone.
    fn out_of_order(&mut self, i: usize) {
        let lane = self.slots[i].lane;
        let before = self.slots.range(..i).rev().find(|s| s.lane == lane);
        match before.map(|s| s.answer.as_ref()) {
            None | Some(Some(Ok(_))) => {
                self.reorders.insert(self.slots[i].token);
            }
            // Whatever is done about that refusal sends this one again.
            Some(Some(Err(_))) => {}
            Some(None) => self.trouble = true,
        }
    }

    /// The `i`-th unanswered message in flight, counting from the oldest,
    /// for which `is_it` holds: its token.
    pub fn unanswered_where(&self, mut is_it: impl FnMut(usize) -> bool) -> Option<u64> {
        self.slots
            .iter()
            .enumerate()
            .find(|(i, s)| s.answer.is_none() && is_it(*i))
            .map(|(_, s)| s.token)
    }

    /// The oldest message's answer if it is in, or a timeout if its probe
    /// deadline passed; else a later message's trouble, once.
    pub fn take(&mut self, now: Instant) -> Option<Next> {
        let front = self.slots.front()?;
        let timed_out = front.answer.is_none() && front.deadline.is_some_and(|d| d <= now);
        if front.answer.is_some() || timed_out {
            let slot = self.slots.pop_front()?;
            self.reorders.remove(&slot.token);
            let answer = slot
                .answer
                .unwrap_or_else(|| Err(PublishError::new(PublishErrorKind::TimedOut)));
            return Some(Next::Ack(answer));
        }
        if std::mem::take(&mut self.trouble) {
            return Some(Next::Trouble);
        }
        while let Some(token) = self.reorders.pop_first() {
            if self.index(token).is_some() {
                return Some(Next::Reorder(token));
            }
        }
        None
    }

    /// The oldest message's token.
    pub fn front_token(&self) -> Option<u64> {
        self.slots.front().map(|s| s.token)
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
                if let Some(t) = self.queue.front_token() {
                    self.queue
                        .answer(t, Err(PublishError::new(PublishErrorKind::BrokenPipe)));
                }
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
        let a = q.push(None, 0);
        let b = q.push(None, 0);
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
        let old = q.push(None, 0);
        q.forget();
        let new = q.push(None, 0);
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
        q.push(None, 0);
        let b = q.push(None, 0);
        q.answer(b, Err(PublishError::new(PublishErrorKind::StreamNotFound)));
        assert!(matches!(q.take(Instant::now()), Some(Next::Trouble)));
        assert!(q.take(Instant::now()).is_none());
    }

    #[test]
    fn the_oldest_refused_is_its_answer_not_trouble() {
        let mut q = AckQueue::default();
        let a = q.push(None, 0);
        q.answer(a, Err(PublishError::new(PublishErrorKind::StreamNotFound)));
        assert!(matches!(
            q.take(Instant::now()),
            Some(Next::Ack(Err(e))) if e.kind() == PublishErrorKind::StreamNotFound
        ));
    }

    fn wrong_last() -> Answer {
        Err(PublishError::new(PublishErrorKind::WrongLastMessageId))
    }

    #[test]
    fn a_refusal_out_of_order_after_its_stream_was_stored_is_that_streams_alone() {
        let mut q = AckQueue::default();
        let a0 = q.push(None, 0);
        let b1 = q.push(None, 1);
        let a1 = q.push(None, 0);
        let b2 = q.push(None, 1);
        let a2 = q.push(None, 0);
        // a0 waits (a slow store of lane 0); lane 1's first message was
        // stored, then another writer came, so b2 is refused.
        q.answer(b1, Ok(false));
        q.answer(b2, wrong_last());
        assert!(matches!(q.take(Instant::now()), Some(Next::Reorder(t)) if t == b2));
        assert!(q.take(Instant::now()).is_none(), "said once");
        let from = q.index(b2).unwrap();
        assert_eq!(q.lane_at(from), Some(1));
        assert_eq!(q.take_lane(from, 1), vec![3]);
        // Lane 0 is untouched: its answers still count, in order.
        q.answer(b2, Ok(false));
        q.answer(a0, Ok(false));
        q.answer(a1, Ok(true));
        q.answer(a2, Ok(false));
        let mut out = Vec::new();
        while let Some(Next::Ack(a)) = q.take(Instant::now()) {
            out.push(a.ok());
        }
        assert_eq!(out, [Some(false), Some(false), Some(true), Some(false)]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_refusal_out_of_order_behind_an_unanswered_message_of_its_stream_is_trouble() {
        let mut q = AckQueue::default();
        q.push(None, 0);
        q.push(None, 1);
        let a1 = q.push(None, 0);
        q.answer(a1, wrong_last());
        assert!(matches!(q.take(Instant::now()), Some(Next::Trouble)));
        assert!(q.take(Instant::now()).is_none());
    }

    #[test]
    fn the_rest_of_a_refused_chain_follows_its_head() {
        let mut q = AckQueue::default();
        q.push(None, 2);
        let b1 = q.push(None, 1);
        let b2 = q.push(None, 1);
        let b3 = q.push(None, 1);
        q.answer(b1, wrong_last());
        q.answer(b2, wrong_last());
        q.answer(b3, wrong_last());
        assert!(matches!(q.take(Instant::now()), Some(Next::Reorder(t)) if t == b1));
        assert!(q.take(Instant::now()).is_none(), "one resend for the chain");
        assert_eq!(q.take_lane(1, 1), vec![1, 2, 3]);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn tokens_are_found_after_a_lane_was_taken_out_of_the_middle() {
        let mut q = AckQueue::default();
        let t: Vec<u64> = (0..6).map(|i| q.push(None, i % 2)).collect();
        assert_eq!(q.take_lane(1, 1), vec![1, 3, 5]);
        for (i, tok) in t.iter().enumerate() {
            let want = (i % 2 == 0).then_some(i / 2);
            assert_eq!(q.index(*tok), want, "token {tok}");
        }
        assert_eq!(q.index(99), None);
    }

    #[test]
    fn a_probe_times_out_at_its_deadline() {
        let mut q = AckQueue::default();
        let now = Instant::now();
        q.push(Some(now + Duration::from_millis(5)), 0);
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
            for _ in 0..stale { q.push(None, 0); }
            q.forget();
            let tokens: Vec<u64> = (0..n).map(|_| q.push(None, 0)).collect();
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
