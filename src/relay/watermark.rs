//! The one owner of slot progress.
//!
//! Turns "these events were acked by JetStream" into the LSN the slot may be
//! confirmed to. Rules, each one a way an earlier relay lost data:
//!
//! - Only commit end LSNs are confirmed, and only once every event of that
//!   transaction and of every earlier transaction is acked. (Confirming an
//!   `XLogData`'s `wal_end` loses the rest of a transaction on a crash.)
//! - Between transactions with nothing in flight, a keepalive's `wal_end`
//!   may be confirmed: an idle outbox in a busy database then retains no WAL.
//!   Never mid-transaction: the keepalive may point past a commit we have not
//!   finished reading.
//! - The confirmed LSN only moves forward.
//!
//! Events are numbered in the order they were handed to the publisher;
//! acks may arrive in any order.
//!
//! It also knows the commit time of the oldest transaction not wholly
//! acked: `outbox_relay_lag_seconds` is now minus that time, so a relay that
//! reads but cannot publish shows lag that grows.

use std::collections::{BTreeSet, VecDeque};

use pgwire_replication::Lsn;

/// Sequence number of an event, in the order events were registered.
pub type Ticket = u64;

#[derive(Debug)]
pub struct Watermark {
    /// Commits whose events are not all acked yet: (events registered up to
    /// and including this commit, its end LSN, its commit time). In commit
    /// order.
    pending_commits: VecDeque<(u64, Lsn, i64)>,
    registered: u64,
    /// Every ticket below this is acked.
    acked_prefix: u64,
    /// Acked tickets above the prefix (out-of-order acks).
    acked_ahead: BTreeSet<Ticket>,
    in_transaction: bool,
    /// The open transaction's commit time (pgoutput's Begin carries it).
    open_commit_micros: i64,
    confirmed: Lsn,
}

impl Watermark {
    /// Start from the slot's confirmed position.
    pub fn new(confirmed: Lsn) -> Self {
        Self {
            pending_commits: VecDeque::new(),
            registered: 0,
            acked_prefix: 0,
            acked_ahead: BTreeSet::new(),
            in_transaction: false,
            open_commit_micros: 0,
            confirmed,
        }
    }

    /// A transaction that committed at `commit_micros` (any clock; the
    /// caller's) begins.
    pub fn begin(&mut self, commit_micros: i64) {
        self.in_transaction = true;
        self.open_commit_micros = commit_micros;
    }

    /// Register an event of the current transaction; ack it later with the ticket.
    pub fn register(&mut self) -> Ticket {
        let t = self.registered;
        self.registered += 1;
        t
    }

    /// The transaction ended at `end_lsn`. Returns the new confirmed LSN if it moved.
    pub fn commit(&mut self, end_lsn: Lsn) -> Option<Lsn> {
        self.in_transaction = false;
        self.pending_commits
            .push_back((self.registered, end_lsn, self.open_commit_micros));
        self.release()
    }

    /// JetStream acked this event. Returns the new confirmed LSN if it moved.
    ///
    /// # Panics
    /// If the ticket was never registered or is acked twice: both are bugs in
    /// the caller that would otherwise confirm unpublished events.
    pub fn ack(&mut self, ticket: Ticket) -> Option<Lsn> {
        assert!(
            ticket < self.registered,
            "ack of unregistered ticket {ticket}"
        );
        assert!(
            ticket >= self.acked_prefix && !self.acked_ahead.contains(&ticket),
            "ticket {ticket} acked twice"
        );
        if ticket == self.acked_prefix {
            self.acked_prefix += 1;
            while self.acked_ahead.remove(&self.acked_prefix) {
                self.acked_prefix += 1;
            }
        } else {
            self.acked_ahead.insert(ticket);
        }
        self.release()
    }

    /// A server keepalive reported `wal_end`. Returns the new confirmed LSN if it moved.
    pub fn keepalive(&mut self, wal_end: Lsn) -> Option<Lsn> {
        if self.in_transaction || !self.pending_commits.is_empty() || self.in_flight() > 0 {
            return None;
        }
        self.advance(wal_end)
    }

    /// Events registered and not acked yet.
    pub fn in_flight(&self) -> u64 {
        self.registered - self.acked_prefix - self.acked_ahead.len() as u64
    }

    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The commit time of the oldest transaction with an event not acked
    /// yet, if any.
    pub fn oldest_unacked(&self) -> Option<i64> {
        if self.in_flight() == 0 {
            return None;
        }
        // `release` pops every commit whose events are all acked, so the
        // front one has an unacked event; with none pending, the unacked
        // events are the open transaction's.
        Some(
            self.pending_commits
                .front()
                .map_or(self.open_commit_micros, |&(_, _, t)| t),
        )
    }

    fn release(&mut self) -> Option<Lsn> {
        let mut newest = None;
        while let Some(&(through, lsn, _)) = self.pending_commits.front() {
            if through > self.acked_prefix {
                break;
            }
            self.pending_commits.pop_front();
            newest = Some(lsn);
        }
        newest.and_then(|lsn| self.advance(lsn))
    }

    fn advance(&mut self, lsn: Lsn) -> Option<Lsn> {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            Some(lsn)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn commit_confirmed_only_after_its_events() {
        let mut w = Watermark::new(Lsn(10));
        w.begin(0);
        let a = w.register();
        let b = w.register();
        assert_eq!(w.commit(Lsn(100)), None);
        assert_eq!(w.ack(b), None);
        assert_eq!(w.confirmed(), Lsn(10));
        assert_eq!(w.ack(a), Some(Lsn(100)));
    }

    #[test]
    fn later_commit_waits_for_earlier() {
        let mut w = Watermark::new(Lsn(0));
        w.begin(0);
        let a = w.register();
        w.commit(Lsn(100));
        w.begin(0);
        let b = w.register();
        w.commit(Lsn(200));
        assert_eq!(w.ack(b), None);
        assert_eq!(w.ack(a), Some(Lsn(200)));
    }

    #[test]
    fn the_oldest_unacked_commit_time_includes_the_open_transaction() {
        let mut w = Watermark::new(Lsn(0));
        assert_eq!(w.oldest_unacked(), None);
        w.begin(1_000);
        let a = w.register();
        assert_eq!(w.oldest_unacked(), Some(1_000), "open, unacked");
        w.commit(Lsn(100));
        w.begin(2_000);
        let b = w.register();
        assert_eq!(w.oldest_unacked(), Some(1_000));
        w.ack(a);
        assert_eq!(w.oldest_unacked(), Some(2_000), "the open one is next");
        w.commit(Lsn(200));
        w.ack(b);
        assert_eq!(w.oldest_unacked(), None);
    }

    #[test]
    fn empty_transaction_confirms_at_once_when_idle() {
        let mut w = Watermark::new(Lsn(0));
        w.begin(0);
        assert_eq!(w.commit(Lsn(50)), Some(Lsn(50)));
    }

    #[test]
    fn keepalive_only_between_transactions_with_nothing_in_flight() {
        let mut w = Watermark::new(Lsn(0));
        assert_eq!(w.keepalive(Lsn(5)), Some(Lsn(5)));
        w.begin(0);
        assert_eq!(w.keepalive(Lsn(500)), None, "mid-transaction");
        let a = w.register();
        w.commit(Lsn(100));
        assert_eq!(w.keepalive(Lsn(600)), None, "event in flight");
        assert_eq!(w.ack(a), Some(Lsn(100)));
        assert_eq!(w.keepalive(Lsn(700)), Some(Lsn(700)));
        assert_eq!(w.keepalive(Lsn(650)), None, "never backwards");
        assert_eq!(w.confirmed(), Lsn(700));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Txn(u8),
        Ack(prop::sample::Index),
        Keepalive(u16),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                (0u8..5).prop_map(Op::Txn),
                any::<prop::sample::Index>().prop_map(Op::Ack),
                any::<u16>().prop_map(Op::Keepalive),
            ],
            0..80,
        )
    }

    proptest! {
        /// Against a model: the confirmed LSN never passes the commit of a
        /// transaction with an unacked event, never goes backwards, and once
        /// everything is acked it reaches the last commit.
        #[test]
        fn never_confirms_past_an_unacked_event(ops in ops()) {
            let mut w = Watermark::new(Lsn(0));
            let mut lsn = 0u64;
            // (ticket, commit end lsn of its transaction)
            let mut events: Vec<(Ticket, u64)> = Vec::new();
            let mut unacked: Vec<Ticket> = Vec::new();
            let mut acked: BTreeSet<Ticket> = BTreeSet::new();
            let mut last = Lsn(0);
            let mut last_commit = 0u64;
            for op in ops {
                match op {
                    Op::Txn(n) => {
                        // Commit times rise with commits: use the end LSN.
                        lsn += 100;
                        w.begin(lsn as i64);
                        let tickets: Vec<_> = (0..n).map(|_| w.register()).collect();
                        for t in tickets {
                            events.push((t, lsn));
                            unacked.push(t);
                        }
                        w.commit(Lsn(lsn));
                        last_commit = lsn;
                    }
                    Op::Ack(i) => {
                        if !unacked.is_empty() {
                            let t = unacked.swap_remove(i.index(unacked.len()));
                            w.ack(t);
                            acked.insert(t);
                        }
                    }
                    Op::Keepalive(d) => {
                        // The server's position; later commits end past it.
                        lsn += u64::from(d);
                        w.keepalive(Lsn(lsn));
                    }
                }
                let c = w.confirmed();
                prop_assert!(c >= last, "went backwards");
                last = c;
                for &(t, commit) in &events {
                    if !acked.contains(&t) {
                        prop_assert!(c.0 < commit, "confirmed {} past unacked event of commit {}", c.0, commit);
                    }
                }
                let oldest = events
                    .iter()
                    .filter(|(t, _)| !acked.contains(t))
                    .map(|&(_, commit)| commit as i64)
                    .min();
                prop_assert_eq!(w.oldest_unacked(), oldest, "the oldest unacked commit time");
            }
            for t in unacked.drain(..) {
                w.ack(t);
            }
            prop_assert!(w.confirmed().0 >= last_commit);
            prop_assert_eq!(w.in_flight(), 0);
        }
    }
}
