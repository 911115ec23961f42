//! The answers to what the publisher sent, in publish order
//! ([`Publisher::next_ack`]): an ack ends a message's wait; an order refusal
//! sends its lane again from the refused message; a message the server will
//! never take becomes a dead letter; a stream that stops answering is ridden
//! out by one probe at a time, within a budget.

use std::collections::VecDeque;
use std::time::Instant;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};

use super::publisher::{
    Ack, Outage, Publisher, Sending, Sent, FIRST_PAUSE, MAX_PAUSE, OUTAGE_BUDGET, PROBE_TIMEOUT,
};
use super::refusal::{denied, in_process, leaderless, refused, refuses_the_message, stream_full};
use crate::backoff::Backoff;
use crate::error::{Error, PublishFailure, Result};
use crate::metrics as m;
use crate::relay::acks::Next;
use crate::relay::link::Denied;
use crate::relay::route::dead_letter;
use crate::wire::DlqReason;

impl Publisher {
    /// The next ack, in publish order. Three kinds of refusal are settled
    /// here, inside the session, because a new session cannot help them:
    ///
    /// - out of order (`Nats-Expected-Last-Msg-Id` did not match): every
    ///   earlier message of its stream is stored (one stream's acks come in
    ///   order), this one and the later ones of its stream were refused,
    ///   since each expects its predecessor. Another writer appended to the
    ///   stream. That stream's are sent again from this one, alone first
    ///   (see [`Publisher::resend_lane`]): a foreign message costs a round
    ///   trip, not a session, and the other streams nothing.
    /// - the server refuses this message itself (too large for the stream,
    ///   a header block over 64 KiB): it is dead-lettered in its place, and
    ///   the messages after it are sent again behind the dead letter.
    /// - no leader answers (an election after a node died): see
    ///   [`Publisher::ride_out`].
    ///
    /// Cancel-safe: the session's select drops this future whenever new WAL
    /// arrives first. Every change of the books is made without an await in
    /// between, and a message leaves `parked` only once it is handed over,
    /// so a dropped call loses nothing (it may send one message twice, which
    /// dedupes by id).
    pub async fn next_ack(&mut self) -> Option<Ack> {
        loop {
            // Outside an outage, what waits to go again goes at once, beside
            // the other streams' messages still in flight (see
            // `resend_lane`); in one, a probe goes only when nothing is.
            if !self.parked.is_empty() && (self.unanswered() == 0 || self.outage.is_none()) {
                if let Some(o) = self.outage {
                    if o.since.elapsed() > OUTAGE_BUDGET {
                        let e = self.gave_up();
                        return Some(self.failed(e));
                    }
                    tokio::time::sleep_until(o.next_probe.into()).await;
                }
                if let Err(e) = self.flush().await {
                    return Some(self.failed(e));
                }
            }
            if self.unanswered() == 0 {
                if self.parked.is_empty() {
                    return None;
                }
                // Nothing went out (no link, or a broken one): the outage
                // clock, set by then, paces the next try.
                continue;
            }
            let stall_at = self.sent.front().map(|s| s.at + self.stall);
            let Some(acks) = self.acks.as_mut() else {
                continue;
            };
            let result = tokio::select! {
                biased;
                next = acks.next() => match next? {
                    Next::Ack(r) => r,
                    Next::Trouble => {
                        self.ride_out(None, "the stream refused a later message", false);
                        continue;
                    }
                    Next::Reorder(token) => {
                        if let Some(from) = acks.queue.index(token) {
                            self.resend_lane(None, from);
                        }
                        continue;
                    }
                    Next::Denied(subject) => {
                        // Refusals come in send order, and a subject the
                        // user may not publish to is refused every time:
                        // the oldest unanswered message to it is this one.
                        let sent = &self.sent;
                        let token = acks
                            .queue
                            .unanswered_where(|i| sent.get(i).is_some_and(|s| s.msg.subject == subject));
                        if let Some(token) = token {
                            let e = PublishError::with_source(PublishErrorKind::Other, Denied(subject));
                            acks.queue.answer(token, Err(e));
                        }
                        continue;
                    }
                },
                _ = tokio::time::sleep_until(stall_at.unwrap_or_else(Instant::now).into()),
                    if stall_at.is_some() => {
                    if acks.link().still_sending() {
                        // Late because it has not left yet: the clock
                        // starts again.
                        if let Some(oldest) = self.sent.front_mut() {
                            oldest.at = Instant::now();
                        }
                        continue;
                    }
                    self.ride_out(None, "no ack in time", false);
                    // Silence may be a dead connection the socket has not
                    // noticed: the probes go on a new one.
                    self.acks = None;
                    continue;
                }
            };
            let Some(sent) = self.sent.pop_front() else {
                continue;
            };
            match result {
                Ok(duplicate) => {
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    if let Some(o) = self.outage.take() {
                        tracing::info!(
                            after = ?o.since.elapsed(),
                            waiting = self.parked.len(),
                            "the stream answers again; sending what waited"
                        );
                    }
                    if self.solo == Some(sent.ticket) {
                        self.solo = None;
                        // A duplicate is not the stream's last message, so
                        // nothing may chain from it: the next of its stream
                        // goes alone too. Chained, the repeats after it
                        // would pass (the server tells a duplicate before it
                        // checks the order), but the first new event would
                        // be refused, and a replicated stream's leader keeps
                        // a refused id as "in process" for the duplicate
                        // window: sent again, it is not stored until then.
                        if duplicate && !self.sent.iter().any(|s| s.msg.stream == sent.msg.stream) {
                            let lane = self.chain.lane(&sent.msg.stream);
                            self.chain.forget(lane);
                        }
                    }
                    // What waited behind it goes out on the next call.
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Ok(duplicate),
                    });
                }
                Err(e) if matches!(e.kind(), PublishErrorKind::WrongLastMessageId) => {
                    self.resend_lane(Some(sent), 0);
                }
                Err(e) if sent.msg.dlq_reason.is_some() && denied(&e) => {
                    // The dead letter itself may not go: nothing can be
                    // done for the row until the permission is granted.
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Err(Error::setup(format!(
                            "the relay's NATS user may not publish to its dead-letter subject {} (event {} was refused: {}): grant it publish permission on {} and on the stream's subjects",
                            sent.msg.subject,
                            sent.msg.msg_id,
                            sent.msg.dlq_reason.map_or("", |r| r.as_str()),
                            sent.msg.subject
                        ))),
                    });
                }
                Err(e)
                    if sent.msg.dlq_reason.is_none()
                        && (refuses_the_message(&e)
                            || (sent.msg.stream.is_some() && stream_full(&e))) =>
                {
                    let detail = e.to_string();
                    // A routed stream at its limits refuses every row for
                    // it, but must not stop the others (SPEC §13: §9 holds
                    // per stream).
                    let reason = if stream_full(&e) {
                        DlqReason::StreamFull
                    } else {
                        DlqReason::Refused
                    };
                    tracing::warn!(id = %sent.msg.msg_id, stream = ?sent.msg.stream, reason = %detail, "the server refused the event; dead-lettering it");
                    metrics::counter!(m::EVENTS_DEAD_LETTERED, "reason" => reason.as_str())
                        .increment(1);
                    let Sent {
                        ticket,
                        commit_micros,
                        msg,
                        at,
                    } = sent;
                    let before = msg.wire_size();
                    let msg = dead_letter(
                        msg,
                        &self.refusals.dlq_subject,
                        reason,
                        Some(&detail),
                        self.refusals.max_message,
                    );
                    self.bytes = self.bytes.saturating_sub(before) + msg.wire_size();
                    self.requeue(Some(Sent {
                        ticket,
                        commit_micros,
                        msg,
                        at,
                    }));
                }
                Err(e) if in_process(&e) => {
                    // An earlier copy of this message waits for its quorum:
                    // stored or dropped, the probes that follow will tell.
                    self.ride_out(Some(sent), &e.to_string(), false);
                }
                Err(e) if leaderless(&e) => {
                    let timed_out = matches!(e.kind(), PublishErrorKind::TimedOut);
                    self.ride_out(Some(sent), &e.to_string(), timed_out);
                    if timed_out {
                        // As for a stall: a new connection for the next probe.
                        self.acks = None;
                    }
                }
                Err(e) => {
                    self.bytes = self.bytes.saturating_sub(sent.msg.wire_size());
                    return Some(Ack {
                        ticket: sent.ticket,
                        commit_micros: sent.commit_micros,
                        result: Err(refused(sent.msg.msg_id, e)),
                    });
                }
            }
        }
    }

    /// The stream did not answer: no leader (an election after a node
    /// died), or a leader that died holding our acks. Stored or not,
    /// everything unacked is sent again from the oldest: its predecessor is
    /// stored (acks come in order), so it may go alone, and each later one
    /// chains to it, so order holds and ids dedupe what was stored. Until
    /// the stream answers, only that oldest message goes, at growing
    /// pauses: a probe. The session ends only past [`OUTAGE_BUDGET`].
    /// `timed_out`: a probe went unanswered, so the next waits longer.
    pub(super) fn ride_out(&mut self, first: Option<Sent>, why: &str, timed_out: bool) {
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        self.requeue(first);
        let now = Instant::now();
        let o = match self.outage {
            None => {
                tracing::warn!(
                    reason = why,
                    unacked = self.parked.len(),
                    "the stream stopped answering; resending from the oldest unacked event until it does"
                );
                Outage {
                    since: now,
                    pause: Backoff::jittered(FIRST_PAUSE, MAX_PAUSE),
                    probe_timeout: Backoff::new(PROBE_TIMEOUT, self.max_probe_timeout),
                    next_probe: now,
                }
            }
            Some(mut o) => {
                tracing::debug!(reason = why, "probe failed");
                if timed_out {
                    o.probe_timeout.next_pause();
                }
                o.next_probe = now + o.pause.next_pause();
                o
            }
        };
        self.outage = Some(o);
    }

    pub(super) fn gave_up(&self) -> Error {
        let id = self
            .parked
            .front()
            .map(|s| s.msg.msg_id.clone())
            .unwrap_or_default();
        Error::Publish {
            id,
            failure: PublishFailure::NoStream,
            source: format!("the stream did not answer for {OUTAGE_BUDGET:?}").into(),
        }
    }

    /// Another writer appended to a stream between two of ours, so the
    /// order chain refused the second: every earlier message of that stream
    /// is stored, and this one and the later ones of its stream in flight
    /// (each chained to the one before) were refused or will be. They go
    /// again, the first alone, before anything of theirs not yet sent. The
    /// other streams' messages stay in flight: a foreign writer costs its
    /// stream's window, not everyone's. `first`: the refused message, just
    /// taken off the books (it was the oldest); else it is the one at
    /// index `from`.
    pub(super) fn resend_lane(&mut self, first: Option<Sent>, from: usize) {
        let lane = match &first {
            Some(sent) => self.chain.lane(&sent.msg.stream),
            None => match self.acks.as_ref().and_then(|a| a.queue.lane_at(from)) {
                Some(lane) => lane,
                None => return,
            },
        };
        metrics::counter!(m::PUBLISH_RESENDS).increment(1);
        let taken = match self.acks.as_mut() {
            Some(acks) => acks.queue.take_lane(from, lane),
            None => Vec::new(),
        };
        let mut again: VecDeque<Sent> = first.into_iter().collect();
        if !taken.is_empty() {
            let mut next = taken.iter().copied().peekable();
            let mut kept = VecDeque::with_capacity(self.sent.len() - taken.len());
            for (i, s) in self.sent.drain(..).enumerate() {
                if next.next_if_eq(&i).is_some() {
                    again.push_back(s);
                } else {
                    kept.push_back(s);
                }
            }
            self.sent = kept;
        }
        if let Some(head) = again.front() {
            tracing::debug!(id = %head.msg.msg_id, stream = ?head.msg.stream, again = again.len(), "another writer appended to the stream; sending its events again from here");
        }
        again.extend(self.parked.drain(..));
        self.parked = again;
        self.chain.forget(lane);
    }

    /// Put everything unacked back in the queue, `first` (just taken off
    /// the books) at its head, and forget the old copies' answers. What
    /// was in flight was refused or is unknown. On the same link the server
    /// handles old copies before new ones. Copies left on a link that was
    /// dropped may still be handled after the new ones: a chained copy
    /// then fails its order check or dedupes, and a solo one dedupes by id
    /// within the duplicate window; the dropped link resets its socket
    /// (zero linger), so its unsent bytes never arrive late.
    pub(super) fn requeue(&mut self, first: Option<Sent>) {
        let mut queue: VecDeque<Sent> = first.into_iter().collect();
        queue.extend(self.sent.drain(..));
        queue.extend(self.parked.drain(..));
        self.parked = queue;
        if let Some(acks) = self.acks.as_mut() {
            acks.queue.forget();
            acks.link().barrier();
        }
        self.chain.clear();
        self.solo = None;
    }

    /// Hand queued messages to the connection, in order, each stream's
    /// first unchained where its chain was forgotten; during an outage only
    /// the first, as a probe.
    pub(super) async fn flush(&mut self) -> Result<()> {
        let probe = self.outage.is_some();
        while let Some(front) = self.parked.front() {
            let next = front.clone();
            match self.send(next, probe, true).await? {
                Sending::Sent => {}
                Sending::Broken(back, why) => {
                    // It stays at the head, as `send` left it (a dead
                    // letter in its place is counted so already); the
                    // outage paces the next try.
                    if let Some(head) = self.parked.front_mut() {
                        *head = back;
                    }
                    self.ride_out(None, &why, false);
                    return Ok(());
                }
                // It stays at the head until the old link's answers are in.
                Sending::Held(_) => return Ok(()),
            }
            self.parked.pop_front();
            if probe {
                break;
            }
        }
        Ok(())
    }

    /// A resend that could not be handed to a link ends the session.
    pub(super) fn failed(&mut self, e: Error) -> Ack {
        let ticket = self
            .sent
            .front()
            .or(self.parked.front())
            .map_or(0, |s| s.ticket);
        Ack {
            ticket,
            commit_micros: 0,
            result: Err(e),
        }
    }
}
