//! The publish window: each message handed to the link and kept until it
//! is answered, bounded in count and bytes; the link dialled, moved off a
//! leaving server and dropped; the fence that stops sending after a pause.

use std::collections::VecDeque;
use std::time::Duration;
use std::time::Instant;

use async_nats::jetstream::Context;

use super::chains::Chains;
use super::streams::{CHAIN_RESERVE, HEADER_RESERVE};
use crate::backoff::Backoff;
use crate::error::{Error, PublishFailure, Result};
use crate::metrics as m;
use crate::relay::acks::Inbox;
use crate::relay::fence::Fence;
use crate::relay::link::{Dialer, Link, LinkError};
use crate::relay::route::{dead_letter, OutMessage};
use crate::relay::watermark::Ticket;
use crate::wire::DlqReason;

/// JetStream's answer to one publish.
pub struct Ack {
    pub ticket: Ticket,
    /// The event's commit time in Postgres micros, for the latency metric.
    pub commit_micros: i64,
    /// `Ok(duplicate)`: stored, or already stored before.
    pub result: Result<bool>,
}

/// How long the oldest message may wait for its ack before the publisher
/// takes its leader for gone: a fifth of `--publish-timeout`, this at least
/// (or the timeout itself, if shorter). A stream leader that dies takes the
/// acks of what it held with it, and with no later publish to fail fast,
/// only the wait tells; a slow but healthy cluster is told by a longer
/// timeout.
pub(super) const STALL: Duration = Duration::from_secs(2);

pub(super) fn stall(publish_timeout: Duration) -> Duration {
    (publish_timeout / 5).max(STALL.min(publish_timeout))
}
/// During an outage, the first wait for a probe's ack; it doubles after
/// each probe that times out, up to `--publish-timeout`.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// The pause between probes grows from the first to the last: publishing
/// resumes within [`MAX_PAUSE`] of a new leader answering.
pub(super) const FIRST_PAUSE: Duration = Duration::from_millis(20);
pub(super) const MAX_PAUSE: Duration = Duration::from_millis(200);
/// How long the stream may stay unanswering before the session ends and
/// the relay reconnects from scratch (a deleted stream is recreated there).
pub(super) const OUTAGE_BUDGET: Duration = Duration::from_secs(60);

/// A message handed to the connection, kept until JetStream answers: it is
/// sent again after an order refusal or a leader outage, or dead-lettered
/// after a refusal of its own. The body is shared (`Bytes`), so keeping it
/// costs its headers.
#[derive(Clone)]
pub(super) struct Sent {
    pub(super) ticket: Ticket,
    pub(super) commit_micros: i64,
    pub(super) msg: OutMessage,
    /// When this copy was handed over: the stall clock.
    pub(super) at: Instant,
}

/// What became of a message handed to the link.
pub(super) enum Sending {
    Sent,
    /// The link broke; the message is given back.
    Broken(Sent, String),
    /// The link's server is leaving and answers what is in flight on it
    /// first, or there is no link and the caller may not dial: the message
    /// is given back, to go on the next link.
    Held(Sent),
}

/// Where a message the server refuses goes instead.
#[derive(Debug, Clone)]
pub struct Refusals {
    pub dlq_subject: String,
    /// The smaller of the server's `max_payload` and the stream's
    /// `max_msg_size`.
    pub max_message: usize,
}

/// The stream stopped answering (no leader, or a leader that died with our
/// acks): one message at a time probes for a new leader, the rest wait.
#[derive(Debug, Clone, Copy)]
pub(super) struct Outage {
    pub(super) since: Instant,
    /// The pause before the next probe; grows.
    pub(super) pause: Backoff,
    /// How long a probe waits for its answer; grows each time one does not
    /// come.
    pub(super) probe_timeout: Backoff,
    pub(super) next_probe: Instant,
}

pub struct Publisher {
    pub(super) js: Context,
    /// Opens the publish link: at the session's start ([`Self::connect`]),
    /// and again when it broke or went silent.
    pub(super) dialer: Option<Dialer>,
    /// A dial under way. It runs as a task of its own, so a caller that is
    /// dropped (the session's select) does not cut it short: the next call
    /// waits for the same dial, which ends in a link or an error.
    pub(super) dialing: tokio::task::JoinSet<(Dialer, std::result::Result<Link, LinkError>)>,
    /// The link and the answers to what is in flight on it.
    pub(super) acks: Option<Inbox>,
    /// The messages behind `acks`, in the same order.
    pub(super) sent: VecDeque<Sent>,
    /// Messages queued to go out again, in order, before anything new (see
    /// [`Publisher::next_ack`]).
    pub(super) parked: VecDeque<Sent>,
    /// The `wire_size` of everything in `sent` and `parked`: the window is
    /// bounded in bytes as well.
    pub(super) bytes: usize,
    /// Per stream, the id of the message the next publish must follow.
    pub(super) chain: Chains,
    /// The `max_payload` of the session's first link, which routing used:
    /// a later link with a smaller one gets messages checked against it.
    pub(super) routed_for: usize,
    /// The newest message sent alone, until its answer is taken: nothing
    /// new goes meanwhile (if it was stored before, nothing may chain
    /// from it).
    pub(super) solo: Option<Ticket>,
    pub(super) max_inflight: usize,
    pub(super) max_bytes: usize,
    pub(super) refusals: Refusals,
    pub(super) stall: Duration,
    pub(super) max_probe_timeout: Duration,
    pub(super) outage: Option<Outage>,
    /// A stand-in for a `Sent::at` not yet handed over, so a new message
    /// costs no clock read before the one taken when it is.
    pub(super) epoch: Instant,
    /// Nothing is sent once the process was paused long enough to lose
    /// its slot.
    pub(super) fence: Option<Fence>,
}

impl Publisher {
    /// `publish_timeout` is the context's ack timeout (async-nats bounds each
    /// ack by it); a stall is declared well before it.
    pub fn new(
        js: Context,
        dialer: Dialer,
        max_inflight: usize,
        max_bytes: usize,
        publish_timeout: Duration,
        refusals: Refusals,
    ) -> Self {
        Self {
            js,
            dialer: Some(dialer),
            dialing: tokio::task::JoinSet::new(),
            acks: None,
            sent: VecDeque::new(),
            parked: VecDeque::new(),
            bytes: 0,
            chain: Chains::default(),
            routed_for: usize::MAX,
            solo: None,
            max_inflight,
            max_bytes,
            refusals,
            stall: stall(publish_timeout),
            max_probe_timeout: publish_timeout.max(PROBE_TIMEOUT),
            outage: None,
            epoch: Instant::now(),
            fence: None,
        }
    }

    /// From now on, nothing is sent once `fence` broke.
    pub fn set_fence(&mut self, fence: Fence) {
        if let Some(link) = self.link() {
            link.set_fence(fence.clone());
        }
        self.fence = Some(fence);
    }

    /// An error if the process was paused past the fence's limit as of
    /// `now`: nothing may be sent.
    pub(crate) fn fenced(&self, now: Instant) -> Result<()> {
        match &self.fence {
            Some(f) if !f.holds(tokio::time::Instant::from_std(now)) => {
                Err(Error::Paused { paused: f.paused() })
            }
            _ => Ok(()),
        }
    }

    /// What the batch path shares: the context, the window (count and
    /// bytes) and the stall clock.
    /// Messages handed over from now on go alone first: the last message
    /// chained to may no longer be the stream's last (batches went since).
    pub(crate) fn unchain(&mut self) {
        if self.sent.is_empty() && self.parked.is_empty() {
            self.chain.clear();
            self.solo = None;
        }
    }

    pub(crate) fn settings(&self) -> (Context, usize, usize, Duration) {
        (
            self.js.clone(),
            self.max_inflight,
            self.max_bytes,
            self.stall,
        )
    }

    /// The largest message that fits the stream and the connection, with
    /// room for what the publisher adds.
    pub fn max_message(&self) -> usize {
        self.refusals.max_message
    }

    /// Whether another message may be handed over. One message is always
    /// let through when nothing is in flight, whatever its size.
    pub fn has_room(&self) -> bool {
        self.solo.is_none()
            && self.parked.is_empty()
            && self.unanswered() < self.max_inflight
            && (self.bytes < self.max_bytes || self.unanswered() == 0)
    }

    /// Copies handed to the connection whose answer has not been taken.
    pub(super) fn unanswered(&self) -> usize {
        self.acks.as_ref().map_or(0, |a| a.queue.len())
    }

    /// Messages handed over and not yet acked, including any waiting to be
    /// sent again.
    pub fn in_flight(&self) -> usize {
        self.sent.len() + self.parked.len()
    }

    pub fn in_flight_bytes(&self) -> usize {
        self.bytes
    }

    /// Hand one message to the connection. Returns once it is queued; its ack
    /// comes out of [`next_ack`](Self::next_ack), in publish order.
    pub async fn publish(
        &mut self,
        ticket: Ticket,
        commit_micros: i64,
        msg: OutMessage,
    ) -> Result<()> {
        let size = msg.wire_size();
        let sent = Sent {
            ticket,
            commit_micros,
            msg,
            // Set when handed over (`send`); only a sent message's is read.
            at: self.epoch,
        };
        // Counted first: `send` may put a smaller dead letter in its place.
        self.bytes += size;
        if self.parked.is_empty() {
            // Never a dial here: the session cannot stop while this
            // runs. Without a link the message waits, and `next_ack`
            // dials.
            match self.send(sent, false, false).await? {
                Sending::Sent => {}
                Sending::Broken(sent, why) => {
                    self.parked.push_back(sent);
                    self.ride_out(None, &why, false);
                }
                Sending::Held(sent) => self.parked.push_back(sent),
            }
        } else {
            // Never ahead of what waits to go again: the caller's select
            // checked `has_room` before `next_ack` parked them (in the same
            // poll), and a message sent now would go unchained, before its
            // predecessors.
            self.parked.push_back(sent);
        }
        Ok(())
    }

    /// Open the publish link (the session's first dial, made while the
    /// session opens and can still be stopped).
    pub async fn connect(&mut self) -> Result<()> {
        if self.acks.is_none() {
            let link = self.dial().await.map_err(|e| {
                let servers = self
                    .dialer
                    .as_ref()
                    .map_or_else(String::new, Dialer::servers);
                Error::NatsConnect {
                    servers: format!("{servers} (publish connection)"),
                    source: Box::new(e),
                }
            })?;
            self.open(link);
        }
        Ok(())
    }

    /// Cancel-safe: a dropped call leaves the dial running.
    pub(super) async fn dial(&mut self) -> std::result::Result<Link, LinkError> {
        if self.dialing.is_empty() {
            let Some(mut dialer) = self.dialer.take() else {
                return Err(LinkError::Config("no dialer".into()));
            };
            self.dialing.spawn(async move {
                let link = dialer.dial().await;
                (dialer, link)
            });
        }
        match self.dialing.join_next().await {
            Some(Ok((dialer, link))) => {
                self.dialer = Some(dialer);
                link
            }
            Some(Err(e)) => Err(LinkError::Config(format!("the dial failed: {e}"))),
            None => Err(LinkError::Config("no dial under way".into())),
        }
    }

    /// The link, for the batch path's messages, dialed if there is none
    /// or it broke. Batches go only while nothing per-event is in flight.
    pub(crate) async fn batch_link(&mut self) -> Result<&mut Link> {
        let leaving = |a: &Inbox| a.broken() || a.leaving();
        if self.acks.as_ref().is_some_and(leaving) && self.unanswered() == 0 {
            self.move_off();
        }
        self.ensure_link("").await?;
        self.link().ok_or_else(|| Error::Publish {
            id: String::new(),
            failure: PublishFailure::Send,
            source: "no publish connection".into(),
        })
    }

    /// The link as it is, if any (the batch path awaits its commits on it).
    pub(crate) fn link(&mut self) -> Option<&mut Link> {
        self.acks.as_mut().map(Inbox::link)
    }

    /// The link went silent: the next message goes on a new one. Only
    /// while nothing per-event is in flight on it.
    pub(crate) fn drop_link(&mut self) {
        if self.unanswered() == 0 {
            self.acks = None;
        }
    }

    /// Leave the link whose server is leaving (or that broke), with
    /// nothing in flight on it: the next message dials another server.
    pub(super) fn move_off(&mut self) {
        if let Some(mut acks) = self.acks.take() {
            if acks.leaving() && !acks.broken() {
                tracing::info!(
                    from = acks.link().server(),
                    "every answer is in from the server that is leaving; the publish connection moves"
                );
            }
        }
    }

    /// Dial a link if there is none. No server taking one ends the
    /// session (`id`: the event waiting for it, if any).
    pub(super) async fn ensure_link(&mut self, id: &str) -> Result<()> {
        if self.acks.is_none() {
            let link = self.dial().await.map_err(|e| {
                metrics::counter!(m::PUBLISH_ERRORS).increment(1);
                Error::Publish {
                    id: id.to_owned(),
                    failure: PublishFailure::Send,
                    source: Box::new(e),
                }
            })?;
            self.open(link);
        }
        Ok(())
    }

    pub(super) fn open(&mut self, link: Link) {
        // The session routes under the first link's limit.
        if self.routed_for == usize::MAX {
            self.routed_for = link.max_payload();
        }
        tracing::debug!(server = link.server(), "publish connection open");
        if let Some(fence) = &self.fence {
            link.set_fence(fence.clone());
        }
        // A dead letter must fit the server the link landed on too.
        let fits = link.max_payload().saturating_sub(HEADER_RESERVE);
        self.refusals.max_message = self.refusals.max_message.min(fits);
        self.acks = Some(Inbox::new(link));
    }

    /// Hand one message to the link; with `may_dial`, dial one first if
    /// there is none or it broke. Cancel-safe: nothing changes until the
    /// link took the message. A `probe` waits for its ack a shorter time,
    /// growing per outage. A message the link could not take comes back,
    /// with why; no server taking a new link ends the session (the relay
    /// reconnects from scratch, as it does when NATS is down at start).
    pub(super) async fn send(
        &mut self,
        mut sent: Sent,
        probe: bool,
        may_dial: bool,
    ) -> Result<Sending> {
        let broken = |sent, why: &str| Ok(Sending::Broken(sent, why.into()));
        if self.acks.as_ref().is_some_and(Inbox::broken) {
            if self.unanswered() > 0 {
                // What is in flight on it must go again first.
                return broken(sent, "the publish connection broke");
            }
            self.acks = None;
        }
        if self.acks.as_ref().is_some_and(Inbox::leaving) {
            if self.unanswered() > 0 {
                return Ok(Sending::Held(sent));
            }
            self.move_off();
        }
        if self.acks.is_none() {
            if !may_dial {
                // Nothing is in flight: not an outage, only a link to dial
                // (the next `next_ack` does).
                return Ok(Sending::Held(sent));
            }
            self.ensure_link(&sent.msg.msg_id).await?;
        }
        let Some(acks) = self.acks.as_mut() else {
            return broken(sent, "no publish connection");
        };
        let now = Instant::now();
        if let Some(f) = &self.fence {
            if !f.holds(tokio::time::Instant::from_std(now)) {
                return Err(Error::Paused { paused: f.paused() });
            }
        }
        // Routed under a larger limit than this link's (a server with a
        // smaller `max_payload` took over, or a later INFO lowered it): the
        // link would refuse it unsent, and a message chained to it would
        // then wait on an id the stream never got. Its dead letter goes
        // in its place.
        let limit = acks.link().max_payload();
        if limit < self.routed_for
            && sent.msg.dlq_reason.is_none()
            && sent.msg.wire_size() + CHAIN_RESERVE > limit
        {
            let before = sent.msg.wire_size();
            tracing::warn!(id = %sent.msg.msg_id, size = before, max_payload = limit, "the event is over the connection's max_payload; dead-lettering it");
            metrics::counter!(m::EVENTS_DEAD_LETTERED, "reason" => DlqReason::TooLarge.as_str())
                .increment(1);
            let detail = format!("{before} bytes, over the connection's max_payload of {limit}");
            sent.msg = dead_letter(
                sent.msg,
                &self.refusals.dlq_subject,
                DlqReason::TooLarge,
                Some(&detail),
                self.refusals.max_message,
            );
            self.bytes = self.bytes.saturating_sub(before) + sent.msg.wire_size();
        }
        let lane = self.chain.lane(&sent.msg.stream);
        let prev = self.chain.last(lane);
        if !acks.publish(&sent.msg, prev) {
            return broken(sent, "the publish connection broke");
        }
        let probe_deadline = self
            .outage
            .filter(|_| probe)
            .map(|o| now + o.probe_timeout.peek());
        acks.queue.push(probe_deadline, lane);
        if prev.is_none() {
            self.solo = Some(sent.ticket);
        }
        self.chain.set(lane, &sent.msg.msg_id);
        sent.at = now;
        self.sent.push_back(sent);
        Ok(Sending::Sent)
    }
}

#[cfg(test)]
mod tests {
    use super::stall;
    use std::time::Duration;

    #[test]
    fn the_stall_follows_the_publish_timeout() {
        let s = Duration::from_secs;
        for (timeout, want) in [
            (Duration::from_millis(500), Duration::from_millis(500)),
            (s(1), s(1)),
            (s(10), s(2)),
            (s(30), s(6)),
        ] {
            assert_eq!(stall(timeout), want, "{timeout:?}");
        }
    }
}
