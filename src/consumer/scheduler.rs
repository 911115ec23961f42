//! Which job runs next: messages in, jobs out, no I/O.
//!
//! Every aggregate (key) is a lane that runs one job at a time, in order:
//!
//! - a pulled message is **delivered** (the handler runs) when nothing of its
//!   key is parked;
//! - a delivery that fails is **parked**: its inbox row keeps it (stream
//!   sequence, due time) and JetStream gets its ack, so a failing aggregate
//!   holds no ack-pending slot and never stalls the others;
//! - while a key has parked messages, each newly pulled message of that key is
//!   **parked behind** them (a job of its own: the inbox row, then the ack);
//! - when the oldest parked message of a key is due, it is **retried** (read
//!   again from the stream). When it finishes, the next parked one (the
//!   inbox says which) runs at once; when none is left, the key is clear.
//!
//! - when the messages waiting in memory reach the high-water mark (a busy
//!   key, e.g. a slow handler, collecting its later messages while JetStream
//!   holds back at `max_ack_pending`), the waiting messages of keys that are
//!   running are **spilled**: parked behind in the inbox and acked, each a
//!   short job of its own beside the key's running one. When the running job
//!   ends and every spill is written, the key goes on from its oldest
//!   spilled message as from a parked one, so order holds and the ack-pending
//!   slots go to the other keys.
//!
//! Because a key's jobs run one at a time (spills aside, which only write
//! rows behind), parking behind and retrying never race: a retry that finds
//! no next parked row really is the last.
//!
//! - after a **reset to the ack floor** (a takeover, a lost delivery),
//!   JetStream delivers every message past the floor again, in stream order,
//!   acked ones included. A parked message past the floor is retried only
//!   once the pull has come back to it: an older message of its key that was
//!   never acked (a crash while it ran and later ones spilled) comes back
//!   first, is parked ahead of it, and runs first.
//!
//! At most `concurrency` jobs run at once; a key with a job to start but no
//! free slot waits in a FIFO served before anything new is pulled. Retries
//! of parked messages wait in a FIFO of their own and take at most half the
//! slots (one at least), the two queues taking turns: many failing
//! aggregates, all due, cannot hold the healthy ones behind them.
//!
//! - parked keys are held in memory up to a bound in count and bytes
//!   ([`Scheduler::set_parked_cap`]). Past it, a key that parks is
//!   forgotten (**cold**): the inbox alone keeps it. While any key may be
//!   cold, a pulled message of a key not in memory is **checked** first (the
//!   inbox says whether its key is parked, and it is parked behind if so),
//!   and cold keys are loaded back, soonest due first, as room frees
//!   ([`Scheduler::load_parked`], [`Scheduler::refilled`]). Memory stays
//!   bounded however many aggregates fail; the healthy ones pay one inbox
//!   read per message meanwhile, and never wait behind the failing ones.
//!
//! The I/O loop ([`super::run`]) pulls only while [`Scheduler::can_pull`],
//! runs the jobs that [`arrive`](Scheduler::arrive),
//! [`finish`](Scheduler::finish) and [`wake`](Scheduler::wake) hand back, and
//! keeps [`waiting`](Scheduler::waiting) messages alive with progress acks.

use std::collections::{BTreeSet, HashMap, VecDeque};

/// What to do next for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Job<M> {
    /// Call the handler for a pulled message.
    Deliver(M),
    /// Park a pulled message behind its key's parked ones.
    ParkBehind(M),
    /// Run the key's oldest parked message again.
    Retry { seq: u64 },
    /// A pulled message of a key that may be parked in the inbox only (see
    /// cold keys above): park it behind if the inbox holds parked messages
    /// of its key (ending with [`Finished::Parked`] and the key's head),
    /// else deliver it.
    Check(M),
    /// Park a waiting message behind, beside the key's running job, to free
    /// its ack-pending slot; ends with [`Finished::Spilled`].
    Spill(M),
}

/// How a job ended, as far as ordering cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished<T> {
    /// Nothing changes for the key: processed, a duplicate, dead-lettered,
    /// or parked behind the key's parked messages.
    Done,
    /// The message failed and waits in the inbox until `due`.
    Parked { seq: u64, due: T },
    /// A retry is over (processed or dead-lettered); `next` is the key's
    /// next parked message, due at once, if the inbox holds one.
    Retried { next: Option<u64> },
    /// A spill is written (its stream sequence), or was not needed (`None`:
    /// a duplicate, or another durable's replay).
    Spilled { seq: Option<u64> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Head<T> {
    seq: u64,
    due: T,
}

struct Lane<M, T> {
    running: bool,
    /// The running job is a retry (counted in `retries_running`).
    running_retry: bool,
    /// Further jobs of the key adopted at a takeover, running beside the
    /// first: the key is busy until every one has ended.
    also_running: usize,
    queued: bool,
    waiting: VecDeque<M>,
    /// The oldest parked message of the key.
    parked: Option<Head<T>>,
    /// Spill jobs of the key not finished yet.
    spilling: usize,
    /// The oldest message spilled while the key ran (or, while spills are
    /// in flight, whether any was): the key goes on from it.
    spilled: Option<u64>,
    /// Messages of the key go to the inbox behind its spilled ones until
    /// the key runs from there.
    spill_mode: bool,
    /// The key may have parked messages that only the inbox knows (it was
    /// new while keys were cold): its next delivery is a check.
    unsure: bool,
}

impl<M, T> Default for Lane<M, T> {
    fn default() -> Self {
        Self {
            running: false,
            running_retry: false,
            also_running: 0,
            queued: false,
            waiting: VecDeque::new(),
            parked: None,
            spilling: 0,
            spilled: None,
            spill_mode: false,
            unsure: false,
        }
    }
}

impl<M, T: Ord + Copy> Lane<M, T> {
    /// `job` starts on this lane, which is busy until it ends; whether it
    /// is a retry.
    fn begin(&mut self, job: &Job<M>) -> bool {
        self.running = true;
        let retry = matches!(job, Job::Retry { .. });
        if retry {
            self.running_retry = true;
        }
        retry
    }

    /// `retry_upto`: the highest parked sequence that may be retried now
    /// (see [`Rewind`]).
    fn next_job(&mut self, now: T, retry_upto: u64) -> Option<Job<M>> {
        if self.running || self.spill_mode {
            return None;
        }
        match self.parked {
            // Park what arrived before retrying: parking frees ack-pending
            // slots, and the retry must see every row parked behind it.
            Some(_) if !self.waiting.is_empty() => self.waiting.pop_front().map(Job::ParkBehind),
            Some(head) if head.due <= now && head.seq <= retry_upto => {
                Some(Job::Retry { seq: head.seq })
            }
            Some(_) => None,
            // The check tells whether the key is parked: after it, memory
            // knows (a key that parks again while memory is full is
            // dropped whole, and comes back unsure).
            None if self.unsure => {
                self.unsure = false;
                self.waiting.pop_front().map(Job::Check)
            }
            None => self.waiting.pop_front().map(Job::Deliver),
        }
    }

    fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// Nothing but a parked head keeps the key in memory: it may go cold.
    fn only_parked(&self) -> bool {
        !self.running
            && self.waiting.is_empty()
            && !self.spill_mode
            && self.spilling == 0
            && self.also_running == 0
    }

    /// The job [`next_job`](Self::next_job) would start now is a retry.
    fn next_is_retry(&self, now: T, retry_upto: u64) -> bool {
        !self.running
            && !self.spill_mode
            && self.waiting.is_empty()
            && self
                .parked
                .is_some_and(|h| h.due <= now && h.seq <= retry_upto)
    }

    fn has_job(&self, now: T, retry_upto: u64) -> bool {
        !self.running
            && !self.spill_mode
            && match self.parked {
                Some(head) => {
                    !self.waiting.is_empty() || (head.due <= now && head.seq <= retry_upto)
                }
                None => !self.waiting.is_empty(),
            }
    }

    /// The head the key would retry now but for a [`Rewind`].
    fn held_back(&self, retry_upto: u64) -> Option<u64> {
        match self.parked {
            Some(head)
                if head.seq > retry_upto
                    && !self.running
                    && !self.spill_mode
                    && self.waiting.is_empty() =>
            {
                Some(head.seq)
            }
            _ => None,
        }
    }

    fn idle(&self) -> bool {
        !self.running
            && self.waiting.is_empty()
            && self.parked.is_none()
            && !self.spill_mode
            && self.spilling == 0
    }

    /// Once the key's running job and every spill are done, it goes on
    /// from its oldest spilled message as from a parked one.
    fn settle_spill(&mut self, now: T) {
        if !self.spill_mode || self.running || self.spilling > 0 {
            return;
        }
        self.spill_mode = false;
        if let Some(seq) = self.spilled.take() {
            // A parked head of the key is older than anything spilled after
            // it: the inbox leads from there.
            if self.parked.is_none_or(|h| seq < h.seq) {
                self.parked = Some(Head { seq, due: now });
            }
        }
    }
}

/// Since the last reset to the ack floor: how far the pull has come back,
/// and the keys whose parked head waits for it.
struct Rewind {
    /// The highest stream sequence pulled since the reset (the floor until
    /// one is).
    passed: u64,
    held: BTreeSet<(u64, String)>,
}

pub struct Scheduler<M, T> {
    concurrency: usize,
    /// Messages waiting in memory that start spilling busy keys.
    high_water: usize,
    running: usize,
    /// Running retries (at most [`Scheduler::retry_cap`]).
    retries_running: usize,
    lanes: HashMap<String, Lane<M, T>>,
    /// Keys with a job to start and no free slot, in the order they asked.
    ready: VecDeque<String>,
    /// The same for keys whose job is a retry.
    ready_retries: VecDeque<String>,
    /// The job started last was a retry: when both queues wait and both may
    /// start, the other goes first.
    last_was_retry: bool,
    /// When parked keys come due (entries go stale when a head changes;
    /// [`Scheduler::wake`] checks).
    timers: BTreeSet<(T, String)>,
    rewind: Option<Rewind>,
    parked: Parked,
}

/// A parked key's memory, about: its lane and map entry, its timer, and
/// its key twice (the map's and the timer's).
fn parked_cost(key: &str) -> usize {
    256 + 2 * key.len()
}

/// Parked keys held in memory, their bound, and the keys only the inbox
/// knows.
struct Parked {
    keys: usize,
    bytes: usize,
    max_keys: usize,
    max_bytes: usize,
    /// Some parked key is not in memory.
    cold: bool,
    /// Counts keys sent cold: a reload that started before the last one
    /// cannot say that none is left.
    cold_count: u64,
}

impl Parked {
    fn full(&self) -> bool {
        self.keys >= self.max_keys || self.bytes >= self.max_bytes
    }

    fn over(&self) -> bool {
        self.keys > self.max_keys || self.bytes > self.max_bytes
    }

    /// A parked key leaves memory: the inbox alone keeps it until a reload.
    fn send_cold(&mut self, key: &str) {
        self.track(key, true, false);
        self.cold = true;
        self.cold_count += 1;
    }

    /// The key gained or lost its parked head.
    fn track(&mut self, key: &str, was: bool, is: bool) {
        match (was, is) {
            (false, true) => {
                self.keys += 1;
                self.bytes += parked_cost(key);
            }
            (true, false) => {
                self.keys = self.keys.saturating_sub(1);
                self.bytes = self.bytes.saturating_sub(parked_cost(key));
            }
            _ => {}
        }
    }
}

impl<M, T: Ord + Copy> Scheduler<M, T> {
    pub fn new(concurrency: usize, high_water: usize) -> Self {
        Self {
            concurrency: concurrency.max(1),
            high_water: high_water.max(1),
            running: 0,
            retries_running: 0,
            lanes: HashMap::new(),
            ready: VecDeque::new(),
            ready_retries: VecDeque::new(),
            last_was_retry: false,
            timers: BTreeSet::new(),
            rewind: None,
            parked: Parked {
                keys: 0,
                bytes: 0,
                max_keys: usize::MAX,
                max_bytes: usize::MAX,
                cold: false,
                cold_count: 0,
            },
        }
    }

    /// Hold at most this many parked keys, and about this many bytes for
    /// them, in memory; the rest wait in the inbox (cold).
    pub fn set_parked_cap(&mut self, keys: usize, bytes: usize) {
        self.parked.max_keys = keys.max(1);
        self.parked.max_bytes = bytes.max(1);
    }

    /// Some parked key is known to the inbox only: `Some(n)`, to hand to
    /// [`refilled`](Self::refilled) after reading the inbox's parked heads.
    pub fn cold(&self) -> Option<u64> {
        self.parked.cold.then_some(self.parked.cold_count)
    }

    /// The inbox holds parked keys that memory does not.
    pub fn inbox_holds_more(&mut self) {
        if !self.parked.cold {
            // Any key memory holds unparked may be one of them: each checks
            // before it delivers.
            for lane in self.lanes.values_mut().filter(|l| !l.is_parked()) {
                lane.unsure = true;
            }
        }
        self.parked.cold = true;
    }

    /// Memory is full and keys wait in the inbox: the `n` held keys due
    /// last (nothing but a parked head in memory) make room, so the inbox's
    /// sooner ones can be read back. Without it, keys that keep failing
    /// would hold memory while the others wait for ever.
    pub fn make_room(&mut self, n: usize) {
        let mut latest: Vec<(T, String)> = self
            .lanes
            .iter()
            .filter(|(_, l)| l.is_parked() && l.only_parked() && !l.queued)
            .filter_map(|(k, l)| l.parked.map(|h| (h.due, k.clone())))
            .collect();
        latest.sort_by_key(|l| std::cmp::Reverse(l.0));
        for (_, key) in latest.into_iter().take(n) {
            self.lanes.remove(&key);
            self.parked.send_cold(&key);
        }
    }

    /// Parked keys that memory has room for.
    pub fn parked_room(&self) -> usize {
        if self.parked.bytes >= self.parked.max_bytes {
            return 0;
        }
        self.parked.max_keys.saturating_sub(self.parked.keys)
    }

    /// The inbox's parked heads were read (`cold` as it was before the
    /// read) and loaded as room allowed; `complete`: every head the inbox
    /// holds was read and loaded. No key went cold since: none is left.
    pub fn refilled(&mut self, cold: u64, complete: bool) {
        if complete && cold == self.parked.cold_count {
            self.parked.cold = false;
        }
    }

    /// Retries running at once at most: half the slots, one at least.
    fn retry_cap(&self) -> usize {
        (self.concurrency / 2).max(1)
    }

    #[cfg(test)]
    pub fn retries_running(&self) -> usize {
        self.retries_running
    }

    fn retry_upto(&self) -> u64 {
        self.rewind.as_ref().map_or(u64::MAX, |r| r.passed)
    }

    /// JetStream was reset to its ack floor: every message from `from` on
    /// comes again, in stream order. Parked heads at or past it wait until
    /// the pull passes them ([`passed`](Self::passed)); those held before
    /// (a reset asked for, `from` 0, then done) that lie below it go on.
    /// Returns the jobs to start now.
    pub fn rewound(&mut self, from: u64, now: T) -> Vec<(String, Job<M>)> {
        let held = self.rewind.take().map(|r| r.held).unwrap_or_default();
        self.rewind = Some(Rewind { passed: 0, held });
        self.passed(from.saturating_sub(1), now)
    }

    /// A message at stream sequence `seq` was pulled: every older one that
    /// JetStream delivers again has come. Returns the jobs to start now.
    pub fn passed(&mut self, seq: u64, now: T) -> Vec<(String, Job<M>)> {
        let mut started = Vec::new();
        let Some(r) = &mut self.rewind else {
            return started;
        };
        if seq <= r.passed {
            return started;
        }
        r.passed = seq;
        let mut keys = Vec::new();
        while r.held.first().is_some_and(|(s, _)| *s <= seq) {
            if let Some((_, key)) = r.held.pop_first() {
                keys.push(key);
            }
        }
        for key in keys {
            self.offer(key, now, &mut started);
        }
        started
    }

    /// Nothing more is coming back (JetStream has no message left to
    /// deliver): parked heads go on. Returns the jobs to start now.
    pub fn release(&mut self, now: T) -> Vec<(String, Job<M>)> {
        let mut started = Vec::new();
        if let Some(r) = self.rewind.take() {
            for (_, key) in r.held {
                self.offer(key, now, &mut started);
            }
        }
        self.fill(now, &mut started);
        started
    }

    /// Whether a parked head waits for the pull to come back to it.
    pub fn holds_back(&self) -> bool {
        self.rewind.as_ref().is_some_and(|r| !r.held.is_empty())
    }

    /// The number of jobs that may run at once changed (processes of the
    /// crew joined or left). Returns the jobs to start now.
    pub fn set_concurrency(&mut self, concurrency: usize, now: T) -> Vec<(String, Job<M>)> {
        self.concurrency = concurrency.max(1);
        let mut started = Vec::new();
        self.fill(now, &mut started);
        started
    }

    /// The spill mark moved (the durable's window was sized for more or
    /// fewer processes).
    pub fn set_high_water(&mut self, high_water: usize) {
        self.high_water = high_water.max(1);
    }

    /// A job of `key` that another process runs already (found when taking
    /// over): the key is busy until it [`finish`](Self::finish)es.
    pub fn adopt(&mut self, key: String) {
        let cold = self.parked.cold;
        let lane = self.lanes.entry(key).or_insert_with(|| Lane {
            unsure: cold,
            ..Lane::default()
        });
        if lane.running {
            lane.also_running += 1;
        }
        lane.running = true;
        self.running += 1;
    }

    /// Whether a newly pulled message could start: a free slot, and no key
    /// already waiting for one.
    pub fn can_pull(&self) -> bool {
        self.running < self.concurrency && self.ready.is_empty()
    }

    #[cfg(test)]
    pub fn running(&self) -> usize {
        self.running
    }

    /// No pulled message runs or waits: a delivery JetStream counts unacked
    /// now is one this consumer never received.
    pub fn holds_no_delivery(&self) -> bool {
        self.running == 0 && self.waiting().next().is_none()
    }

    /// Keys with parked messages held in memory.
    pub fn parked_keys(&self) -> usize {
        self.parked.keys
    }

    /// A key read back from the inbox while keys are cold. What memory
    /// knows of a key is fresher than a read that began before it changed
    /// (a head retried since, a key cleared since): only a key memory does
    /// not hold, or holds unsure of, takes the head read. Returns whether
    /// the key is held.
    pub fn reload_parked(&mut self, key: String, seq: u64, due: T) -> bool {
        if self.lanes.get(&key).is_some_and(|l| !l.unsure) {
            return true;
        }
        self.load_parked(key, seq, due)
    }

    /// A key found parked in the inbox (at start, or reloaded while keys
    /// are cold). A key held already keeps the older head; one memory has
    /// no room for stays cold. Returns whether it is held.
    pub fn load_parked(&mut self, key: String, seq: u64, due: T) -> bool {
        let known = self.lanes.get(&key).is_some_and(Lane::is_parked);
        if !known && self.parked.full() {
            self.inbox_holds_more();
            return false;
        }
        let lane = self.lanes.entry(key.clone()).or_default();
        lane.unsure = false;
        if lane.parked.is_none_or(|h| seq < h.seq) {
            let was = lane.parked.is_some();
            lane.parked = Some(Head { seq, due });
            self.parked.track(&key, was, true);
            self.timers.insert((due, key));
        }
        true
    }

    /// A message of `key` was pulled. Returns the jobs to start now.
    pub fn arrive(&mut self, key: String, msg: M, now: T) -> Vec<(String, Job<M>)> {
        let cold = self.parked.cold;
        let lane = self.lanes.entry(key.clone()).or_insert_with(|| Lane {
            unsure: cold,
            ..Lane::default()
        });
        if lane.spill_mode {
            // Behind its key's spilled messages.
            lane.spilling += 1;
            return vec![(key, Job::Spill(msg))];
        }
        lane.waiting.push_back(msg);
        let mut started = Vec::new();
        self.spill(&mut started);
        self.offer(key, now, &mut started);
        started
    }

    /// At the high-water mark, spill what waits behind running keys.
    fn spill(&mut self, started: &mut Vec<(String, Job<M>)>) {
        if self.lanes.values().map(|l| l.waiting.len()).sum::<usize>() < self.high_water {
            return;
        }
        for (key, lane) in &mut self.lanes {
            if !lane.running || lane.waiting.is_empty() {
                continue;
            }
            lane.spill_mode = true;
            for msg in lane.waiting.drain(..) {
                lane.spilling += 1;
                started.push((key.clone(), Job::Spill(msg)));
            }
        }
    }

    /// A job of `key` finished. Returns the jobs to start now.
    pub fn finish(&mut self, key: &str, how: Finished<T>, now: T) -> Vec<(String, Job<M>)> {
        let mut started = Vec::new();
        if let Finished::Spilled { seq } = how {
            if let Some(lane) = self.lanes.get_mut(key) {
                let was = lane.is_parked();
                lane.spilling = lane.spilling.saturating_sub(1);
                if let Some(seq) = seq {
                    lane.spilled = Some(lane.spilled.map_or(seq, |s| s.min(seq)));
                }
                lane.settle_spill(now);
                self.parked.track(key, was, lane.is_parked());
                if lane.is_parked() && lane.only_parked() && self.parked.over() {
                    // Let in past the bound while it was busy: out now.
                    self.lanes.remove(key);
                    self.parked.send_cold(key);
                } else if lane.idle() {
                    self.lanes.remove(key);
                } else {
                    self.offer(key.to_owned(), now, &mut started);
                }
            }
            return started;
        }
        self.running = self.running.saturating_sub(1);
        if let Some(lane) = self.lanes.get_mut(key) {
            let was = lane.is_parked();
            if lane.running_retry {
                lane.running_retry = false;
                self.retries_running = self.retries_running.saturating_sub(1);
            }
            let more = lane.also_running > 0;
            lane.also_running = lane.also_running.saturating_sub(1);
            lane.running = more;
            let mut timer = None;
            match how {
                Finished::Done | Finished::Spilled { .. } => {}
                Finished::Parked { seq, due } => {
                    // The oldest parked message leads; a later one never
                    // replaces it. The head itself pulled again (after a
                    // reset) keeps its backoff.
                    let due = match lane.parked {
                        Some(h) if h.seq == seq => due.max(h.due),
                        _ => due,
                    };
                    if lane.parked.is_none_or(|h| seq <= h.seq) {
                        lane.parked = Some(Head { seq, due });
                        timer = Some(due);
                    }
                }
                Finished::Retried { next } => {
                    lane.parked = next.map(|seq| Head { seq, due: now });
                }
            }
            lane.settle_spill(now);
            let is = lane.is_parked();
            let evict = is
                && lane.only_parked()
                && match was {
                    // No room for a new one.
                    false => self.parked.full(),
                    // Let in past the bound while it was busy: out now.
                    true => self.parked.over(),
                };
            if evict {
                self.lanes.remove(key);
                self.parked.track(key, was, true);
                self.parked.send_cold(key);
            } else {
                self.parked.track(key, was, lane.is_parked());
                if let Some(due) = timer {
                    self.timers.insert((due, key.to_owned()));
                }
                if lane.idle() {
                    self.lanes.remove(key);
                } else if !more {
                    self.offer(key.to_owned(), now, &mut started);
                }
            }
        }
        self.fill(now, &mut started);
        started
    }

    /// Parked keys whose time came. Returns the jobs to start now.
    pub fn wake(&mut self, now: T) -> Vec<(String, Job<M>)> {
        let mut started = Vec::new();
        while let Some((due, _)) = self.timers.first() {
            if *due > now {
                break;
            }
            if let Some((_, key)) = self.timers.pop_first() {
                self.offer(key, now, &mut started);
            }
        }
        started
    }

    /// The next time [`wake`](Self::wake) has something to do.
    pub fn next_wake(&self) -> Option<T> {
        self.timers.first().map(|(due, _)| *due)
    }

    /// Every pulled message not started yet.
    pub fn waiting(&self) -> impl Iterator<Item = &M> {
        self.lanes.values().flat_map(|l| l.waiting.iter())
    }

    /// Take every waiting message (on shutdown or a reset, to let
    /// JetStream deliver them again).
    pub fn take_waiting(&mut self) -> Vec<M> {
        self.ready.clear();
        self.ready_retries.clear();
        let mut taken = Vec::new();
        for (key, lane) in &mut self.lanes {
            taken.extend(lane.waiting.drain(..));
            // A parked key queued for a slot keeps its turn: back on a timer.
            if lane.queued && !lane.running {
                if let Some(head) = lane.parked {
                    self.timers.insert((head.due, key.clone()));
                }
            }
            lane.queued = false;
        }
        self.lanes.retain(|_, l| !l.idle());
        taken
    }

    /// A job started on its lane: one slot more is busy (a retry's too).
    fn count_start(&mut self, retry: bool) {
        self.running += 1;
        self.last_was_retry = retry;
        if retry {
            self.retries_running += 1;
        }
    }

    /// Start the key's next job if a slot is free, else queue the key.
    fn offer(&mut self, key: String, now: T, started: &mut Vec<(String, Job<M>)>) {
        let retry_upto = self.retry_upto();
        let retry_room = self.retries_running < self.retry_cap();
        let Some(lane) = self.lanes.get_mut(&key) else {
            return;
        };
        if let (Some(seq), Some(r)) = (lane.held_back(retry_upto), &mut self.rewind) {
            r.held.insert((seq, key));
            return;
        }
        if lane.queued || !lane.has_job(now, retry_upto) {
            return;
        }
        let retry = lane.next_is_retry(now, retry_upto);
        let free = self.running < self.concurrency;
        let now_ok = match retry {
            true => free && retry_room && self.ready_retries.is_empty(),
            false => free && self.ready.is_empty(),
        };
        if now_ok {
            if let Some(job) = lane.next_job(now, retry_upto) {
                let retry = lane.begin(&job);
                self.count_start(retry);
                started.push((key, job));
            }
        } else {
            lane.queued = true;
            match retry {
                true => self.ready_retries.push_back(key),
                false => self.ready.push_back(key),
            }
        }
    }

    /// The queue to serve next: retries while under their cap, taking
    /// turns with the others when both wait.
    fn next_ready(&mut self) -> Option<(String, bool)> {
        let retry_ok = self.retries_running < self.retry_cap() && !self.ready_retries.is_empty();
        let other_ok = !self.ready.is_empty();
        let retry = match (retry_ok, other_ok) {
            (true, true) => !self.last_was_retry,
            (true, false) => true,
            (false, true) => false,
            (false, false) => return None,
        };
        let queue = if retry {
            &mut self.ready_retries
        } else {
            &mut self.ready
        };
        queue.pop_front().map(|k| (k, retry))
    }

    fn fill(&mut self, now: T, started: &mut Vec<(String, Job<M>)>) {
        let retry_upto = self.retry_upto();
        while self.running < self.concurrency {
            let Some((key, from_retries)) = self.next_ready() else {
                break;
            };
            let retry_room = self.retries_running < self.retry_cap();
            let Some(lane) = self.lanes.get_mut(&key) else {
                continue;
            };
            lane.queued = false;
            // Its job turned into a retry while it waited with the others,
            // and the retries' share is taken: it waits with the retries.
            if !from_retries && !retry_room && lane.next_is_retry(now, retry_upto) {
                lane.queued = true;
                self.ready_retries.push_back(key);
                continue;
            }
            if let Some(job) = lane.next_job(now, retry_upto) {
                let retry = lane.begin(&job);
                self.count_start(retry);
                started.push((key, job));
            } else if let (Some(seq), Some(r)) = (lane.held_back(retry_upto), &mut self.rewind) {
                // Queued before a reset that now holds it back.
                r.held.insert((seq, key));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Messages are (key, stream sequence); time is a plain counter.
    type Msg = (String, u64);
    type S = Scheduler<Msg, u64>;

    fn m(key: &str, seq: u64) -> Msg {
        (key.into(), seq)
    }

    fn arrive(s: &mut S, key: &str, seq: u64) -> Vec<(String, Job<Msg>)> {
        s.arrive(key.into(), m(key, seq), 0)
    }

    fn deliver(key: &str, seq: u64) -> (String, Job<Msg>) {
        (key.into(), Job::Deliver(m(key, seq)))
    }

    #[test]
    fn an_adopted_job_keeps_its_key_busy_until_it_finishes_and_more_slots_start_queued_keys() {
        let mut s = S::new(1, 100);
        s.adopt("a".into());
        assert_eq!(arrive(&mut s, "a", 1), vec![], "behind the adopted job");
        assert_eq!(arrive(&mut s, "b", 2), vec![], "no free slot");
        assert_eq!(s.set_concurrency(2, 0), vec![deliver("b", 2)]);
        assert_eq!(s.finish("a", Finished::Done, 0), vec![deliver("a", 1)]);
    }

    /// Review of the crew, finding 6: two jobs of one key adopted at a
    /// takeover (a previous dispatcher's, from two processes). The first to
    /// end freed the key, and its next message ran beside the second.
    #[test]
    fn a_key_adopted_twice_stays_busy_until_both_jobs_end() {
        let mut s = S::new(4, 100);
        s.adopt("a".into());
        s.adopt("a".into());
        assert_eq!(arrive(&mut s, "a", 3), vec![], "behind the adopted jobs");
        assert_eq!(
            s.finish("a", Finished::Parked { seq: 1, due: 5 }, 0),
            vec![],
            "one adopted job of the key still runs"
        );
        assert_eq!(s.running(), 1);
        assert_eq!(
            s.finish("a", Finished::Done, 0),
            vec![("a".into(), Job::ParkBehind(m("a", 3)))],
            "the key goes on behind its parked head"
        );
    }

    #[test]
    fn a_busy_key_spills_what_waits_at_the_high_water_mark_and_goes_on_in_order() {
        // High water 2: a slow key `a` collects its later messages.
        let mut s = S::new(4, 2);
        assert_eq!(arrive(&mut s, "a", 1), vec![deliver("a", 1)]);
        assert_eq!(arrive(&mut s, "a", 2), vec![]);
        assert_eq!(
            arrive(&mut s, "a", 3),
            vec![
                ("a".into(), Job::Spill(m("a", 2))),
                ("a".into(), Job::Spill(m("a", 3)))
            ]
        );
        assert_eq!(s.waiting().count(), 0, "their ack-pending slots are free");
        // Later messages of `a` go behind them; other keys flow.
        assert_eq!(
            arrive(&mut s, "a", 4),
            vec![("a".into(), Job::Spill(m("a", 4)))]
        );
        assert_eq!(arrive(&mut s, "b", 5), vec![deliver("b", 5)]);
        assert_eq!(s.finish("a", Finished::Spilled { seq: Some(3) }, 0), vec![]);
        assert_eq!(s.finish("a", Finished::Spilled { seq: Some(2) }, 0), vec![]);
        // The slow job ends; one spill is still being written: wait.
        assert_eq!(s.finish("a", Finished::Done, 0), vec![]);
        assert_eq!(
            s.finish("a", Finished::Spilled { seq: Some(4) }, 1),
            vec![("a".into(), Job::Retry { seq: 2 })],
            "the key goes on from its oldest spilled message"
        );
    }

    #[test]
    fn after_a_reset_a_parked_head_waits_for_an_older_unacked_message_of_its_key() {
        // A crash while a/1 ran: a/2 was spilled (parked, acked), a/1 never
        // acked. The next instance resets to the ack floor (0) and loads a/2.
        let mut s = S::new(4, 1000);
        // b/1 failed earlier (parked, acked: the floor is 1).
        s.load_parked("a".into(), 3, 0);
        s.load_parked("b".into(), 1, 0);
        s.rewound(2, 0);
        assert_eq!(
            s.wake(0),
            vec![("b".into(), Job::Retry { seq: 1 })],
            "b's head is below the floor; a's waits for the pull"
        );
        assert!(s.holds_back());
        // a/2 comes back: parked ahead of a/3, it becomes the head and runs.
        assert_eq!(s.passed(2, 0), vec![]);
        assert_eq!(
            arrive(&mut s, "a", 2),
            vec![("a".into(), Job::ParkBehind(m("a", 2)))]
        );
        assert_eq!(
            s.finish("a", Finished::Parked { seq: 2, due: 0 }, 0),
            vec![("a".into(), Job::Retry { seq: 2 })]
        );
        // The inbox says a/3 is next; the pull has not passed it yet.
        assert_eq!(
            s.finish("a", Finished::Retried { next: Some(3) }, 0),
            vec![]
        );
        assert_eq!(s.passed(3, 0), vec![("a".into(), Job::Retry { seq: 3 })]);
    }

    #[test]
    fn a_held_head_goes_on_once_nothing_more_comes_back() {
        let mut s = S::new(4, 1000);
        s.load_parked("a".into(), 7, 0);
        s.rewound(3, 0);
        assert_eq!(s.wake(0), vec![]);
        assert_eq!(s.passed(5, 0), vec![], "still short of 7");
        assert_eq!(s.release(0), vec![("a".into(), Job::Retry { seq: 7 })]);
        assert!(!s.holds_back());
    }

    #[test]
    fn one_at_a_time_per_key_in_order() {
        let mut s = S::new(4, 1000);
        assert_eq!(arrive(&mut s, "a", 1), vec![deliver("a", 1)]);
        assert_eq!(arrive(&mut s, "a", 2), vec![]);
        assert_eq!(arrive(&mut s, "b", 3), vec![deliver("b", 3)]);
        assert_eq!(s.waiting().count(), 1);
        assert_eq!(s.finish("a", Finished::Done, 0), vec![deliver("a", 2)]);
        assert_eq!(s.finish("a", Finished::Done, 0), vec![]);
        assert_eq!(s.running(), 1);
        assert!(!s.holds_no_delivery());
        assert_eq!(s.finish("b", Finished::Done, 0), vec![]);
        assert!(s.holds_no_delivery());
    }

    #[test]
    fn a_failed_key_parks_what_follows_and_retries_in_order_while_others_flow() {
        let mut s = S::new(4, 1000);
        arrive(&mut s, "a", 1);
        arrive(&mut s, "a", 2);
        // 1 fails: parked until t=10. 2 waited in memory: it is parked behind.
        assert_eq!(
            s.finish("a", Finished::Parked { seq: 1, due: 10 }, 0),
            vec![("a".into(), Job::ParkBehind(m("a", 2)))]
        );
        assert_eq!(s.finish("a", Finished::Done, 0), vec![]);
        assert_eq!(arrive(&mut s, "b", 3), vec![deliver("b", 3)], "others flow");
        assert_eq!(
            s.arrive("a".into(), m("a", 4), 1),
            vec![("a".into(), Job::ParkBehind(m("a", 4)))]
        );
        assert_eq!(s.finish("a", Finished::Done, 1), vec![]);
        assert_eq!(s.next_wake(), Some(10));
        assert_eq!(s.wake(9), vec![]);
        assert_eq!(s.wake(10), vec![("a".into(), Job::Retry { seq: 1 })]);
        // 1 succeeds; the inbox says 2 is next, then 4, then nothing.
        assert_eq!(
            s.finish("a", Finished::Retried { next: Some(2) }, 11),
            vec![("a".into(), Job::Retry { seq: 2 })]
        );
        assert_eq!(
            s.finish("a", Finished::Retried { next: Some(4) }, 11),
            vec![("a".into(), Job::Retry { seq: 4 })]
        );
        assert_eq!(s.finish("a", Finished::Retried { next: None }, 11), vec![]);
        assert_eq!(
            s.arrive("a".into(), m("a", 5), 12),
            vec![deliver("a", 5)],
            "clear again"
        );
    }

    #[test]
    fn full_slots_queue_ready_keys_fifo_and_stop_pulling() {
        let mut s = S::new(1, 1000);
        arrive(&mut s, "a", 1);
        assert!(!s.can_pull());
        assert_eq!(arrive(&mut s, "b", 2), vec![]);
        assert_eq!(arrive(&mut s, "c", 3), vec![]);
        assert_eq!(s.finish("a", Finished::Done, 0), vec![deliver("b", 2)]);
        assert!(!s.can_pull(), "c still waits for a slot");
        assert_eq!(s.finish("b", Finished::Done, 0), vec![deliver("c", 3)]);
        assert_eq!(s.finish("c", Finished::Done, 0), vec![]);
        assert!(s.can_pull());
    }

    #[test]
    fn keys_parked_at_start_park_what_arrives_and_retry_when_due() {
        let mut s = S::new(2, 1000);
        s.load_parked("a".into(), 7, 5);
        assert_eq!(
            arrive(&mut s, "a", 9),
            vec![("a".into(), Job::ParkBehind(m("a", 9)))]
        );
        assert_eq!(s.finish("a", Finished::Done, 0), vec![]);
        assert_eq!(s.wake(5), vec![("a".into(), Job::Retry { seq: 7 })]);
    }

    /// Issue 43, item 10: ten failing aggregates, all due, took every slot
    /// and queued ahead of a healthy one, which waited for all of them.
    /// Retries take half the slots at most, and the two queues take turns.
    #[test]
    fn due_retries_leave_the_healthy_aggregates_their_share() {
        let mut s = failing(4, 10);
        let started = s.wake(0);
        assert_eq!(started.len(), 2, "retries take half the slots: {started:?}");
        assert!(s.can_pull(), "the other half is for pulled messages");
        assert_eq!(arrive(&mut s, "h", 1), vec![deliver("h", 1)]);
        assert_eq!(arrive(&mut s, "i", 2), vec![deliver("i", 2)]);
        assert_eq!(arrive(&mut s, "j", 3), vec![], "every slot is busy");
        // A retry ends: the next retry and the waiting delivery take turns.
        let after_retry = s.finish(&started[0].0, Finished::Retried { next: None }, 0);
        let after_h = s.finish("h", Finished::Done, 0);
        let mut next: Vec<_> = after_retry.into_iter().chain(after_h).collect();
        next.sort_by_key(|(k, _)| k.clone());
        assert_eq!(next.len(), 2, "{next:?}");
        assert!(next.iter().any(|(k, _)| k == "j"), "j waited its turn only");
        assert!(s.retries_running() <= 2);
    }

    /// Issue 43, item 10: parked state in memory is bounded. Past the
    /// bound a failing key goes cold: its next message is checked against
    /// the inbox, and it is read back once room frees.
    #[test]
    fn past_the_parked_bound_a_key_goes_cold_and_is_checked_then_read_back() {
        let mut s = capped(1);
        arrive(&mut s, "a", 1);
        arrive(&mut s, "b", 2);
        s.finish("a", Finished::Parked { seq: 1, due: 10 }, 0);
        assert_eq!(s.cold(), None);
        s.finish("b", Finished::Parked { seq: 2, due: 10 }, 0);
        assert_eq!(s.parked_keys(), 1, "b is not held");
        assert!(s.cold().is_some(), "b is cold");
        assert_eq!(
            arrive(&mut s, "b", 3),
            vec![("b".into(), Job::Check(m("b", 3)))],
            "the inbox says whether b is parked"
        );
        assert_eq!(
            arrive(&mut s, "c", 4),
            vec![("c".into(), Job::Check(m("c", 4)))],
            "any key memory does not hold is checked"
        );
        assert_eq!(s.finish("c", Finished::Done, 0), vec![]);
        assert_eq!(
            arrive(&mut s, "c", 5),
            vec![("c".into(), Job::Check(m("c", 5)))]
        );
        // The check found b parked (head 2): memory is full, b stays cold.
        assert_eq!(
            s.finish("b", Finished::Parked { seq: 2, due: 10 }, 0),
            vec![]
        );
        assert_eq!(s.parked_keys(), 1);
        // a is done; the reload reads b back, and no key is cold.
        s.wake(10);
        assert_eq!(s.finish("a", Finished::Retried { next: None }, 10), vec![]);
        assert_eq!(s.parked_room(), 1);
        let cold = s.cold().expect("b is still cold");
        assert!(s.reload_parked("b".into(), 2, 10));
        s.refilled(cold, true);
        assert_eq!(s.cold(), None);
        assert_eq!(s.wake(10), vec![("b".into(), Job::Retry { seq: 2 })]);
    }

    /// A scheduler of `slots` with `n` failing aggregates `f0`…, each
    /// with a parked message due at once.
    fn failing(slots: usize, n: u64) -> S {
        let mut s = S::new(slots, 1000);
        for k in 0..n {
            s.load_parked(format!("f{k}"), 100 + k, 0);
        }
        s
    }

    /// A scheduler of 4 with room in memory for `keys` parked keys.
    fn capped(keys: usize) -> S {
        let mut s = S::new(4, 1000);
        s.set_parked_cap(keys, usize::MAX);
        s
    }

    /// Review: a key that parked while busy (a message waiting behind the
    /// failed one) was let in past the bound and never left memory.
    #[test]
    fn a_key_let_in_past_the_bound_while_busy_leaves_once_idle() {
        let mut s = capped(1);
        s.load_parked("a".into(), 1, 100);
        arrive(&mut s, "b", 2);
        arrive(&mut s, "b", 3);
        // b/2 fails with b/3 waiting: b stays, past the bound, to park b/3.
        let next = s.finish("b", Finished::Parked { seq: 2, due: 100 }, 0);
        assert_eq!(next, vec![("b".into(), Job::ParkBehind(m("b", 3)))]);
        assert_eq!(s.parked_keys(), 2);
        // Parked behind, b holds nothing but its head: it goes cold.
        assert_eq!(s.finish("b", Finished::Done, 0), vec![]);
        assert_eq!(s.parked_keys(), 1);
        assert!(s.cold().is_some());
    }

    /// Review: a reload's head, read before the key's retry went on, took
    /// the place of the key's newer head (and that one then ran at once,
    /// without its backoff).
    #[test]
    fn a_reload_leaves_a_key_memory_holds_as_memory_knows_it() {
        let mut s = capped(1);
        s.load_parked("a".into(), 5, 50);
        assert!(s.reload_parked("a".into(), 3, 0), "a stale head of a");
        assert_eq!(s.wake(0), vec![], "a's head is still 5, due at 50");
        assert_eq!(s.wake(50), vec![("a".into(), Job::Retry { seq: 5 })]);
    }

    #[test]
    fn making_room_sends_the_keys_due_last_to_the_inbox() {
        let mut s = capped(2);
        s.load_parked("late".into(), 1, 100);
        s.load_parked("soon".into(), 2, 10);
        assert_eq!(s.parked_room(), 0);
        s.make_room(1);
        assert_eq!(s.parked_room(), 1);
        assert!(s.cold().is_some());
        assert_eq!(s.wake(10), vec![("soon".into(), Job::Retry { seq: 2 })]);
        assert_eq!(s.wake(100), vec![], "late waits in the inbox");
    }

    #[test]
    fn a_reload_begun_before_a_key_went_cold_leaves_keys_cold() {
        let mut s = capped(1);
        s.load_parked("a".into(), 1, 0);
        assert!(!s.load_parked("b".into(), 2, 0), "no room");
        let before = s.cold().expect("cold");
        arrive(&mut s, "c", 3);
        s.finish("c", Finished::Parked { seq: 3, due: 0 }, 0);
        s.refilled(before, true);
        assert!(s.cold().is_some(), "c went cold after the read began");
    }

    #[test]
    fn with_one_slot_retries_and_deliveries_take_turns() {
        let mut s = failing(1, 3);
        let first = s.wake(0);
        assert_eq!(first.len(), 1);
        assert_eq!(arrive(&mut s, "h", 1), vec![], "the one slot is taken");
        let next = s.finish(&first[0].0, Finished::Retried { next: None }, 0);
        assert_eq!(next, vec![deliver("h", 1)], "the delivery's turn");
        let next = s.finish("h", Finished::Done, 0);
        assert!(
            matches!(next[..], [(_, Job::Retry { .. })]),
            "then a retry's: {next:?}"
        );
    }

    #[test]
    fn shutdown_takes_what_waits() {
        let mut s = S::new(1, 1000);
        arrive(&mut s, "a", 1);
        arrive(&mut s, "a", 2);
        arrive(&mut s, "b", 3);
        let mut taken = s.take_waiting();
        taken.sort();
        assert_eq!(taken, vec![m("a", 2), m("b", 3)]);
        assert_eq!(s.waiting().count(), 0);
        assert!(s.can_pull() || s.running() == 1);
    }

    #[test]
    fn a_parked_key_waiting_for_a_slot_keeps_its_turn_after_take_waiting() {
        let mut s = S::new(1, 1000);
        s.load_parked("a".into(), 7, 0);
        arrive(&mut s, "b", 1);
        assert_eq!(s.wake(1), vec![], "no slot: a waits in the ready queue");
        s.take_waiting();
        assert_eq!(s.finish("b", Finished::Done, 2), vec![]);
        assert_eq!(s.wake(2), vec![("a".into(), Job::Retry { seq: 7 })]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A new message of key k.
        Arrive(u8),
        /// Finish the i-th running job (mod the count); a delivery or
        /// retry fails when the flag says so.
        Finish(usize, bool),
        /// Time passes.
        Tick,
        /// A reset to the ack floor: what waits is dropped and delivered
        /// again, in stream order.
        Reset,
        /// The instance dies (kill -9) and another takes over: a new
        /// scheduler loads the inbox's parked heads, JetStream resets to
        /// its ack floor and delivers everything past it again.
        Crash,
        /// The dispatcher reads cold parked keys back.
        Reload,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..4).prop_map(Op::Arrive),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(i, f)| Op::Finish(i, f)),
            1 => Just(Op::Tick),
            1 => Just(Op::Reset),
            1 => Just(Op::Crash),
            1 => Just(Op::Reload),
        ]
    }

    /// The world around the scheduler: the jobs running and the inbox's
    /// parked rows.
    #[derive(Default)]
    struct World {
        now: u64,
        running: Vec<(String, Job<Msg>)>,
        parked: BTreeMap<String, BTreeSet<u64>>,
        /// Per key, the sequences the handler succeeded on, in order.
        processed: HashMap<String, Vec<u64>>,
        /// The stream: the key of sequence i + 1.
        log: Vec<String>,
        acked: BTreeSet<u64>,
        /// Delivered again after a takeover's reset, in stream order.
        again: VecDeque<u64>,
    }

    impl World {
        /// Jobs that hold a slot (spills run beside them).
        fn main_jobs(&self) -> usize {
            self.running
                .iter()
                .filter(|(_, j)| !matches!(j, Job::Spill(_)))
                .count()
        }

        fn start(&mut self, jobs: Vec<(String, Job<Msg>)>) {
            for (key, job) in jobs {
                if matches!(job, Job::Spill(_)) {
                    self.running.push((key, job));
                    continue;
                }
                assert!(
                    self.running
                        .iter()
                        .all(|(k, j)| *k != key || matches!(j, Job::Spill(_))),
                    "key {key} runs two jobs"
                );
                if let Job::Retry { seq } = job {
                    let rows = self.parked.get(&key);
                    if rows.is_some_and(|r| r.contains(&seq)) {
                        assert_eq!(
                            rows.and_then(|r| r.first()),
                            Some(&seq),
                            "a retry that is not the key's oldest parked message"
                        );
                    } else {
                        // Done with meanwhile (its own message, pulled again
                        // after a reset, was spilled beside its retry): the
                        // retry finds no parked row and does nothing.
                        assert!(
                            self.processed.get(&key).is_some_and(|p| p.contains(&seq)),
                            "a retry of a message never parked"
                        );
                    }
                }
                self.running.push((key, job));
            }
        }

        /// Run the i-th job to its end as the I/O side would.
        fn finish(&mut self, s: &mut S, i: usize, fail: bool) {
            let (key, job) = self.running.remove(i % self.running.len());
            let now = self.now;
            let done = |w: &Self, seq: u64| w.processed.get(&key).is_some_and(|p| p.contains(&seq));
            if let Job::Deliver((_, seq))
            | Job::ParkBehind((_, seq))
            | Job::Spill((_, seq))
            | Job::Check((_, seq)) = &job
            {
                self.acked.insert(*seq);
            }
            let how = match job {
                // The inbox claim: processed already, or parked already.
                Job::Deliver((_, seq)) if done(self, seq) => Finished::Done,
                Job::Deliver((_, seq))
                    if self.parked.get(&key).is_some_and(|p| p.contains(&seq)) =>
                {
                    Finished::Parked { seq, due: now }
                }
                Job::Deliver((_, seq)) if fail => {
                    self.parked.entry(key.clone()).or_default().insert(seq);
                    Finished::Parked { seq, due: now + 2 }
                }
                Job::Deliver((_, seq)) => {
                    self.processed.entry(key.clone()).or_default().push(seq);
                    Finished::Done
                }
                // A key memory may not hold: the inbox says whether it is
                // parked, and the check parks behind and reports its head.
                Job::Check((_, seq)) => match self.parked.get(&key).and_then(|r| r.first()) {
                    Some(&head) => {
                        if !done(self, seq) {
                            self.parked.entry(key.clone()).or_default().insert(seq);
                        }
                        let head = head.min(if done(self, seq) { head } else { seq });
                        Finished::Parked {
                            seq: head,
                            due: now,
                        }
                    }
                    None if done(self, seq) => Finished::Done,
                    None if fail => {
                        self.parked.entry(key.clone()).or_default().insert(seq);
                        Finished::Parked { seq, due: now + 2 }
                    }
                    None => {
                        self.processed.entry(key.clone()).or_default().push(seq);
                        Finished::Done
                    }
                },
                Job::ParkBehind((_, seq)) if done(self, seq) => Finished::Done,
                Job::ParkBehind((_, seq)) => {
                    self.parked.entry(key.clone()).or_default().insert(seq);
                    Finished::Parked { seq, due: now }
                }
                Job::Spill((_, seq)) if done(self, seq) => Finished::Spilled { seq: None },
                Job::Spill((_, seq)) => {
                    self.parked.entry(key.clone()).or_default().insert(seq);
                    Finished::Spilled { seq: Some(seq) }
                }
                Job::Retry { seq } if !self.parked.get(&key).is_some_and(|r| r.contains(&seq)) => {
                    Finished::Retried {
                        next: self.parked.get(&key).and_then(|r| r.first()).copied(),
                    }
                }
                Job::Retry { seq } if fail => Finished::Parked { seq, due: now + 2 },
                Job::Retry { seq } => {
                    let rows = self.parked.get_mut(&key).unwrap();
                    rows.remove(&seq);
                    let next = rows.first().copied();
                    self.processed.entry(key.clone()).or_default().push(seq);
                    Finished::Retried { next }
                }
            };
            let started = s.finish(&key, how, now);
            self.start(started);
        }

        /// Pull the next message: one delivered again, else a new one.
        /// Returns its key and sequence, and whether it is new.
        fn pull(&mut self, new_key: &str) -> (String, u64, bool) {
            match self.again.pop_front() {
                Some(seq) => (self.log[(seq - 1) as usize].clone(), seq, false),
                None => {
                    self.log.push(new_key.to_owned());
                    (new_key.to_owned(), self.log.len() as u64, true)
                }
            }
        }

        fn arrive(&mut self, s: &mut S, key: String, seq: u64) {
            let started = s.passed(seq, self.now);
            self.start(started);
            let started = s.arrive(key.clone(), (key, seq), self.now);
            self.start(started);
        }

        /// The inbox's parked heads, by key.
        fn heads(&self) -> Vec<(String, u64)> {
            self.parked
                .iter()
                .filter_map(|(k, r)| r.first().map(|&h| (k.clone(), h)))
                .collect()
        }

        /// Cold keys are read back from the inbox as the dispatcher does.
        fn reload(&mut self, s: &mut S) {
            let Some(cold) = s.cold() else { return };
            let limit = s.parked_room().saturating_add(s.parked_keys());
            let heads = self.heads();
            let total = heads.len();
            let mut all = true;
            for (key, head) in heads.into_iter().take(limit) {
                all &= s.reload_parked(key, head, self.now);
            }
            s.refilled(cold, all && total <= limit);
            let started = s.wake(self.now);
            self.start(started);
        }

        /// kill -9 and a takeover: running jobs vanish unfinished.
        fn crash(&mut self, s: &mut S, concurrency: usize, high_water: usize, cap: usize) {
            self.running.clear();
            *s = S::new(concurrency, high_water);
            s.set_parked_cap(cap, usize::MAX);
            let heads = self.heads();
            let total = heads.len();
            for (key, head) in heads.into_iter().take(cap) {
                s.load_parked(key, head, self.now);
            }
            if total > cap {
                s.inbox_holds_more();
            }
            let last = self.log.len() as u64;
            let floor = (1..=last)
                .find(|q| !self.acked.contains(q))
                .unwrap_or(last + 1);
            let started = s.rewound(floor, self.now);
            self.start(started);
            self.acked.retain(|&q| q < floor);
            self.again = (floor..=last).collect();
        }
    }

    proptest! {
        // A crash at the one moment that matters is rare among random ops.
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Under any interleaving: the slot bound holds, a key runs one job
        /// at a time, retries take the oldest parked message, each key's
        /// messages succeed in stream order, and once everything succeeds
        /// nothing is left waiting or parked; through crashes and takeovers
        /// too.
        #[test]
        fn invariants_hold(
            concurrency in 1usize..4,
            high_water in 1usize..8,
            cap in prop_oneof![Just(usize::MAX), 1usize..4],
            ops in prop::collection::vec(op(), 1..300),
        ) {
            let mut s = S::new(concurrency, high_water);
            s.set_parked_cap(cap, usize::MAX);
            let mut w = World::default();
            let mut arrived: HashMap<String, Vec<u64>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Arrive(k) => {
                        if !s.can_pull() { continue; }
                        let (key, seq, new) = w.pull(&format!("k{k}"));
                        if new {
                            arrived.entry(key.clone()).or_default().push(seq);
                        }
                        w.arrive(&mut s, key, seq);
                    }
                    Op::Crash => w.crash(&mut s, concurrency, high_water, cap),
                    Op::Reload => w.reload(&mut s),
                    Op::Finish(i, fail) => {
                        if w.running.is_empty() { continue; }
                        w.finish(&mut s, i, fail);
                    }
                    Op::Tick => {
                        w.now += 1;
                        let started = s.wake(w.now);
                        w.start(started);
                    }
                    Op::Reset => {
                        let mut again = s.take_waiting();
                        again.sort_by_key(|(_, seq)| *seq);
                        for (key, seq) in again {
                            let started = s.arrive(key.clone(), (key, seq), w.now);
                            w.start(started);
                        }
                    }
                }
                prop_assert!(s.running() <= concurrency);
                prop_assert_eq!(s.running(), w.main_jobs());
                prop_assert!(s.retries_running() <= (concurrency / 2).max(1));
                // Past the cap only keys with more than a parked head in
                // memory: a running job, waiting or spilled messages.
                let busy = w.running.len() + s.waiting().count();
                prop_assert!(cap == usize::MAX || s.parked_keys() <= cap + busy);
            }
            // Liveness: everything succeeds from here on, time passes.
            for _ in 0..10_000 {
                if !w.again.is_empty() && s.can_pull() {
                    let (key, seq, _) = w.pull("");
                    w.arrive(&mut s, key, seq);
                    continue;
                }
                if w.running.is_empty() && s.cold().is_some() && s.next_wake().is_none() {
                    w.reload(&mut s);
                    if s.next_wake().is_none() && w.running.is_empty() {
                        break;
                    }
                    continue;
                }
                if w.running.is_empty() {
                    match s.next_wake() {
                        Some(t) => {
                            w.now = w.now.max(t);
                            let started = s.wake(w.now);
                            w.start(started);
                        }
                        None => break,
                    }
                    continue;
                }
                w.finish(&mut s, 0, false);
            }
            prop_assert!(w.running.is_empty());
            prop_assert_eq!(s.waiting().count(), 0, "a message was left waiting");
            prop_assert!(w.parked.values().all(BTreeSet::is_empty), "a message was left parked");
            prop_assert_eq!(s.parked_keys(), 0);
            prop_assert!(s.cold().is_none(), "keys left cold");
            for (key, seqs) in &arrived {
                prop_assert_eq!(&w.processed[key], seqs, "key {} out of order or lost", key);
            }
        }
    }
}
