//! Which delivery runs next: messages in, decisions out, no I/O.
//!
//! Rules (SPEC §6):
//! - at most `concurrency` deliveries run at once;
//! - deliveries of one key (aggregate) run one at a time, in arrival order;
//! - a NAKed delivery blocks its key until the same message comes back
//!   (JetStream's redelivery); later messages of that key wait, other keys
//!   keep flowing;
//! - a key whose turn has come but found no free slot waits in a FIFO of
//!   ready keys, served before anything new is pulled.
//!
//! The I/O loop ([`super::run`]) pulls only while [`Scheduler::can_pull`],
//! starts what [`Scheduler::arrive`] and [`Scheduler::finish`] hand back, and
//! keeps [`Scheduler::waiting`] messages alive with progress acks.

use std::collections::{HashMap, VecDeque};

pub struct Scheduler<M> {
    concurrency: usize,
    running: usize,
    keys: HashMap<String, KeyState<M>>,
    /// Keys that may start their next waiting message when a slot frees.
    ready: VecDeque<String>,
}

struct KeyState<M> {
    running: bool,
    /// The id of this key's NAKed message: nothing else of the key starts
    /// before it has come back and finished.
    blocked_on: Option<String>,
    waiting: VecDeque<M>,
}

impl<M> Default for KeyState<M> {
    fn default() -> Self {
        Self {
            running: false,
            blocked_on: None,
            waiting: VecDeque::new(),
        }
    }
}

impl<M> Scheduler<M> {
    pub fn new(concurrency: usize) -> Self {
        Self {
            concurrency: concurrency.max(1),
            running: 0,
            keys: HashMap::new(),
            ready: VecDeque::new(),
        }
    }

    /// Whether a newly pulled message could start: a free slot, and no key
    /// already waiting for one.
    pub fn can_pull(&self) -> bool {
        self.running < self.concurrency && self.ready.is_empty()
    }

    pub fn running(&self) -> usize {
        self.running
    }

    /// A message of `key` arrived (`id`: its message id, which tells a
    /// redelivery of the blocking message). Returns it when it starts now;
    /// otherwise it waits its turn.
    pub fn arrive(&mut self, key: String, id: Option<&str>, msg: M) -> Option<M> {
        let state = self.keys.entry(key.clone()).or_default();
        let is_retry = state.blocked_on.is_some() && state.blocked_on.as_deref() == id;
        if is_retry {
            // It comes before everything that queued behind it.
            state.blocked_on = None;
            state.waiting.push_front(msg);
        } else {
            state.waiting.push_back(msg);
        }
        let startable = !state.running && state.blocked_on.is_none();
        if !startable || self.ready.contains(&key) {
            return None;
        }
        if self.running < self.concurrency {
            self.start(&key)
        } else {
            self.ready.push_back(key);
            None
        }
    }

    /// A delivery of `key` finished; `naked` is its id when it was NAKed.
    /// Returns the deliveries to start now, in order.
    pub fn finish(&mut self, key: &str, naked: Option<String>) -> Vec<(String, M)> {
        self.running = self.running.saturating_sub(1);
        if let Some(state) = self.keys.get_mut(key) {
            state.running = false;
            state.blocked_on = naked;
            if state.blocked_on.is_none() {
                if state.waiting.is_empty() {
                    self.keys.remove(key);
                } else {
                    self.ready.push_back(key.to_owned());
                }
            }
        }
        let mut started = Vec::new();
        while self.running < self.concurrency {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            if let Some(msg) = self.start(&key) {
                started.push((key, msg));
            }
        }
        started
    }

    fn start(&mut self, key: &str) -> Option<M> {
        let state = self.keys.get_mut(key)?;
        let msg = state.waiting.pop_front()?;
        state.running = true;
        self.running += 1;
        Some(msg)
    }

    /// Every message pulled but not started.
    pub fn waiting(&self) -> impl Iterator<Item = &M> {
        self.keys.values().flat_map(|s| s.waiting.iter())
    }

    /// Take every waiting message (on shutdown, to hand them back).
    pub fn take_waiting(&mut self) -> Vec<M> {
        self.ready.clear();
        self.keys
            .values_mut()
            .flat_map(|s| s.waiting.drain(..))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Messages are (key, id) pairs.
    type Msg = (String, String);

    fn msg(key: &str, id: &str) -> Msg {
        (key.into(), id.into())
    }

    fn arrive(s: &mut Scheduler<Msg>, key: &str, id: &str) -> Option<Msg> {
        s.arrive(key.into(), Some(id), msg(key, id))
    }

    #[test]
    fn one_at_a_time_per_key_in_order() {
        let mut s = Scheduler::new(4);
        assert_eq!(arrive(&mut s, "a", "1"), Some(msg("a", "1")));
        assert_eq!(arrive(&mut s, "a", "2"), None);
        assert_eq!(arrive(&mut s, "b", "3"), Some(msg("b", "3")));
        assert_eq!(s.waiting().count(), 1);
        assert_eq!(s.finish("a", None), vec![("a".into(), msg("a", "2"))]);
        assert_eq!(s.finish("a", None), vec![]);
        assert_eq!(s.running(), 1);
    }

    #[test]
    fn a_naked_key_waits_for_its_redelivery_others_flow() {
        let mut s = Scheduler::new(4);
        arrive(&mut s, "a", "1");
        assert_eq!(arrive(&mut s, "a", "2"), None);
        assert_eq!(s.finish("a", Some("1".into())), vec![], "blocked on 1");
        assert_eq!(arrive(&mut s, "b", "9"), Some(msg("b", "9")));
        assert_eq!(arrive(&mut s, "a", "3"), None, "still blocked");
        assert_eq!(
            arrive(&mut s, "a", "1"),
            Some(msg("a", "1")),
            "the redelivery goes first"
        );
        assert_eq!(s.finish("a", None), vec![("a".into(), msg("a", "2"))]);
        assert_eq!(s.finish("a", None), vec![("a".into(), msg("a", "3"))]);
    }

    #[test]
    fn full_slots_queue_ready_keys_fifo_and_stop_pulling() {
        let mut s = Scheduler::new(1);
        arrive(&mut s, "a", "1");
        assert!(!s.can_pull());
        assert_eq!(arrive(&mut s, "b", "2"), None);
        assert_eq!(arrive(&mut s, "c", "3"), None);
        assert_eq!(s.finish("a", None), vec![("b".into(), msg("b", "2"))]);
        assert!(!s.can_pull(), "c still waits for a slot");
        assert_eq!(s.finish("b", None), vec![("c".into(), msg("c", "3"))]);
        assert_eq!(s.finish("c", None), vec![]);
        assert!(s.can_pull());
    }

    #[test]
    fn shutdown_takes_what_waits() {
        let mut s = Scheduler::new(1);
        arrive(&mut s, "a", "1");
        arrive(&mut s, "a", "2");
        arrive(&mut s, "b", "3");
        let mut taken = s.take_waiting();
        taken.sort();
        assert_eq!(taken, vec![msg("a", "2"), msg("b", "3")]);
        assert_eq!(s.waiting().count(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A new message of key k.
        Arrive(u8),
        /// Finish the i-th running delivery (mod the count), NAKed or not.
        Finish(usize, bool),
        /// JetStream redelivers the i-th NAKed message (mod the count).
        Redeliver(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4).prop_map(Op::Arrive),
            (any::<usize>(), any::<bool>()).prop_map(|(i, n)| Op::Finish(i, n)),
            any::<usize>().prop_map(Op::Redeliver),
        ]
    }

    proptest! {
        /// Under any interleaving: the slot bound holds, a key never runs
        /// twice at once, each key's messages start in arrival order (a
        /// redelivery repeats the message it replaces), and nothing is lost.
        #[test]
        fn invariants_hold(concurrency in 1usize..4, ops in prop::collection::vec(op(), 1..200)) {
            let mut s: Scheduler<Msg> = Scheduler::new(concurrency);
            let mut running: Vec<Msg> = Vec::new();
            let mut naked: Vec<Msg> = Vec::new();
            let mut arrived: HashMap<String, Vec<String>> = HashMap::new();
            let mut started: HashMap<String, Vec<String>> = HashMap::new();
            let mut next_id = 0u32;
            let begin = |m: Msg, running: &mut Vec<Msg>, started: &mut HashMap<String, Vec<String>>| {
                assert!(running.iter().all(|r| r.0 != m.0), "key {} runs twice", m.0);
                let seen = started.entry(m.0.clone()).or_default();
                if seen.last() != Some(&m.1) {
                    seen.push(m.1.clone());
                }
                running.push(m);
            };
            for op in ops {
                match op {
                    Op::Arrive(k) => {
                        if !s.can_pull() { continue; }
                        next_id += 1;
                        let m = msg(&format!("k{k}"), &next_id.to_string());
                        arrived.entry(m.0.clone()).or_default().push(m.1.clone());
                        let (key, id) = m.clone();
                        if let Some(m) = s.arrive(key, Some(&id), m) {
                            begin(m, &mut running, &mut started);
                        }
                    }
                    Op::Finish(i, nak) => {
                        if running.is_empty() { continue; }
                        let m = running.remove(i % running.len());
                        let id = nak.then(|| m.1.clone());
                        if nak { naked.push(m.clone()); }
                        for (_, m) in s.finish(&m.0, id) {
                            begin(m, &mut running, &mut started);
                        }
                    }
                    Op::Redeliver(i) => {
                        if naked.is_empty() || !s.can_pull() { continue; }
                        let m = naked.remove(i % naked.len());
                        let (key, id) = m.clone();
                        if let Some(m) = s.arrive(key, Some(&id), m) {
                            begin(m, &mut running, &mut started);
                        }
                    }
                }
                prop_assert!(s.running() <= concurrency);
                prop_assert_eq!(s.running(), running.len());
            }
            // Liveness: with every NAKed message redelivered and every
            // delivery finishing, nothing is left waiting.
            for m in naked.drain(..) {
                while !s.can_pull() {
                    let r = running.remove(0);
                    for (_, m) in s.finish(&r.0, None) {
                        begin(m, &mut running, &mut started);
                    }
                }
                let (key, id) = m.clone();
                if let Some(m) = s.arrive(key, Some(&id), m) {
                    begin(m, &mut running, &mut started);
                }
            }
            while !running.is_empty() {
                let r = running.remove(0);
                for (_, m) in s.finish(&r.0, None) {
                    begin(m, &mut running, &mut started);
                }
            }
            prop_assert_eq!(s.waiting().count(), 0, "a message was left waiting");
            for (key, ids) in &started {
                prop_assert_eq!(&arrived[key][..ids.len()], &ids[..], "key {} out of order", key);
            }
            // A NAKed message counts once, as started (and again on its
            // redelivery, which `begin` does not count twice).
            let accounted = started.values().map(Vec::len).sum::<usize>() + s.waiting().count();
            let total: usize = arrived.values().map(Vec::len).sum();
            prop_assert_eq!(accounted, total, "a message was lost");
        }
    }
}
