//! The crew's rule, without I/O: who may start a job, when the dispatcher
//! may take a job for lost (and so run it again), and when a helper must
//! stop. Time comes in as an argument, messages as values; the shell in
//! `mod.rs` does the NATS and Postgres work and asks these types what to do.
//!
//! The one rule (see the module above): **a job is run again only once its
//! first run has stopped.** Two halves keep it:
//!
//! - the helper ([`Roster`], [`Standing`]) starts a job only if the request is
//!   from the dispatcher it serves, in that dispatcher's period, before the
//!   request's expiry beat, and while its proof holds; and it makes calls
//!   only while its proof holds (a lapse fences every job it holds: none of
//!   them calls again, even once the proof comes back). The proof ends once
//!   [`FENCE`] has passed since it sent the newest beat the dispatcher
//!   acknowledged *and* [`MEMBER_PROOF`] since its newest good check of its
//!   member lock; and at the latest [`FENCE_LOCKED`] after that beat;
//! - the dispatcher ([`Ledger`]) takes a job for lost only when the helper
//!   cannot be running it any more: Postgres said the helper's lock went
//!   [`GRACE`] ago (its member half ran out [`MEMBER_PROOF`] after its last
//!   good check, before that) *and* it has not heard the helper for
//!   [`SILENT`] (the newest beat it acknowledged was sent before that, so
//!   the other half ran out [`FENCE`] later); or it has not heard the helper
//!   for [`SILENT_LOCKED`], lock or not; both only while it hears itself;
//!   or when a beat past the job's start does not list it (the job ended,
//!   or was never admitted).
//!
//! A pause is not a crash: a process that can still be heard, or that
//! still holds its member lock, keeps its jobs. A helper cut off from
//! Postgres alone (a stalled path, a terminated backend) costs no call: its
//! beats go on being acknowledged; nor does a Postgres restart that the
//! dispatcher's next period outlasts by less than [`FENCE`] (it syncs the
//! helper and acknowledges it again). NATS alone unreachable, or the
//! dispatcher stalled, costs none for [`FENCE_LOCKED`]: the member lock is
//! held. Only a process that can be neither heard nor seen holding its lock
//! (dead, frozen, cut off from both) loses its jobs, once it has stopped
//! them.
//!
//! `tests` drives both halves through random joins, kills, freezes,
//! partitions and late or lost messages, and checks the rule on every step.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// How often every process says what it runs.
pub(crate) const BEAT: Duration = Duration::from_millis(250);
/// A helper whose beats go unacknowledged this long stops its jobs, once
/// it cannot prove its member lock either ([`MEMBER_PROOF`]). Longer than
/// the stalls production has every day (a GC or VM pause, a dispatcher
/// throttled for 2 s), which must not cost a call; and, since a Postgres
/// outage that reaches every process ends the dispatcher's period and its
/// acknowledgements with it, the longest call such an outage does not cut
/// (one started at the outage ends within it, with room for a loaded host:
/// at 3 s, a 3 s call on a busy box was cut and made again).
pub(super) const FENCE: Duration = Duration::from_millis(4500);
/// A helper whose beats go unacknowledged this long stops its jobs, its
/// member lock held or not (NATS alone is gone, or the dispatcher).
pub(super) const FENCE_LOCKED: Duration = Duration::from_secs(5);
/// A helper whose lock went and that the dispatcher has not heard for this
/// long has stopped its jobs (it could not hear itself for [`FENCE`]).
pub(super) const SILENT: Duration = Duration::from_millis(5500);
/// A helper the dispatcher has not heard for this long has stopped its
/// jobs, lock or not (it could not hear itself for [`FENCE_LOCKED`]).
pub(super) const SILENT_LOCKED: Duration = Duration::from_secs(6);
/// How long after a helper's member lock went its jobs may still call: its
/// proof runs [`LEASE_TTL`](super::super::lease::LEASE_TTL) less a margin
/// from its last successful check of the lock, and the lock was held then.
/// A helper that loses its lock's connection (a Postgres restart, a
/// terminated backend) goes on with its calls while it takes the lock back.
pub(crate) const GRACE: Duration = super::super::lease::LEASE_TTL;
/// How often the dispatcher asks Postgres who is alive.
pub(super) const LIVENESS: Duration = Duration::from_millis(500);
/// How long one such question is waited for. Off the loop that reads the
/// beats, so it may take longer than [`LIVENESS`]: on a slow path (400 ms
/// a round trip) the pool's check of an idle connection and the query
/// take two, and an answer never in time left the crew as it stood, a
/// helper that joined since never picked. A lock seen gone ages from when
/// the answer came, and stays gone only up to when the last poll that
/// still found it gone was asked ([`Ledger::liveness`]).
pub(super) const LIVENESS_WAIT: Duration = Duration::from_secs(2);
/// A member-lock check that takes longer has failed.
pub(super) const PING: Duration = Duration::from_millis(500);
/// A helper's proof runs this long from its last good member-lock check:
/// its lock may vanish right after it (a terminated backend, a restart),
/// and the dispatcher waits [`GRACE`] from when it sees that; the check of
/// the proof comes each beat, after at most 2 [`PING`]s of the last one.
pub(super) const MEMBER_PROOF: Duration = Duration::from_millis(1500);

/// How much further Postgres's clock may run than this process's own
/// between two checks of the member lock before this process takes it
/// that its own clock stood still meanwhile (a VM paused with its clock, as
/// QEMU/KVM does on `virsh suspend`): its proof then proves nothing, since
/// the dispatcher, whose clock ran, may have taken its jobs for lost. A
/// slow check accounts for at most a [`PING`] of the difference.
pub(super) const CLOCK_JUMP: Duration = Duration::from_millis(1500);

/// Whether this process's clock stood still between two member-lock checks:
/// each is when it was sent, by this process's clock, and Postgres's clock
/// (seconds since the epoch) as it ran.
pub(super) fn clock_stood_still(before: (Instant, f64), now: (Instant, f64)) -> bool {
    let ours = now.0.saturating_duration_since(before.0).as_secs_f64();
    let theirs = now.1 - before.1;
    theirs - ours > CLOCK_JUMP.as_secs_f64()
}

/// A gap between two of its own beats that this process heard past which
/// it counts itself deaf: beats are [`BEAT`] apart, and a late one or two
/// are the network's jitter, not a path gone.
pub(super) const DEAF: Duration = Duration::from_millis(500);

/// The part of a gap of `gap` between own beats heard in which this
/// process could not hear: none up to [`DEAF`], all but a beat past it.
fn deaf_gap(gap: Duration) -> Duration {
    if gap > DEAF {
        gap - BEAT
    } else {
        Duration::ZERO
    }
}

/// Why a helper refuses a job request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No room for another job, or this process is leaving.
    Full,
    /// From a dispatcher this process does not serve, or from an earlier
    /// period of the one it serves.
    Fenced,
    /// Past the beat the request named as its last.
    Late,
    /// This process cannot prove it is heard (or holds its lock).
    Unheard,
}

impl Refusal {
    /// The word the helper answers with (and the metric's label).
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Full => "full",
            Refusal::Fenced => "fenced",
            Refusal::Late => "late",
            Refusal::Unheard => "unheard",
        }
    }
}

/// A helper's answer to a job request, as it travels: `ok <beat>` (admitted
/// at that beat), or the refusal's word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobReply {
    Admitted {
        beat: u64,
    },
    Refused(Refusal),
    /// `bad` (a request the helper could not read), or a word this version
    /// does not know: refused all the same.
    Other,
}

impl JobReply {
    pub fn encode(self) -> String {
        match self {
            JobReply::Admitted { beat } => format!("ok {beat}"),
            JobReply::Refused(why) => why.as_str().to_owned(),
            JobReply::Other => "bad".to_owned(),
        }
    }

    pub fn read(payload: &[u8]) -> JobReply {
        let text = std::str::from_utf8(payload).unwrap_or_default().trim();
        if let Some(beat) = text.strip_prefix("ok ").and_then(|b| b.trim().parse().ok()) {
            return JobReply::Admitted { beat };
        }
        [
            Refusal::Full,
            Refusal::Fenced,
            Refusal::Late,
            Refusal::Unheard,
        ]
        .into_iter()
        .find(|r| r.as_str() == text)
        .map_or(JobReply::Other, JobReply::Refused)
    }
}

/// What a process runs (by job id, with what the shell keeps of each), and
/// the dispatcher it serves.
#[derive(Debug)]
pub(crate) struct Roster<R> {
    pub jobs: HashMap<u64, R>,
    pub serving: Option<i32>,
    /// The period of `serving` that synced this process: a request sent in
    /// an earlier period of the same process is refused.
    pub period: u64,
    /// The beat at which it first refused a sync since it was last synced
    /// (it could not ask Postgres who holds the lease). A takeover adopts
    /// its jobs from its beats two past that one, so no request may start
    /// here that those beats would not list: one to expire later is
    /// refused, whoever sends it (an old dispatcher thawed from a freeze
    /// included).
    pub refused_sync: Option<u64>,
}

impl<R> Default for Roster<R> {
    fn default() -> Self {
        Roster {
            jobs: HashMap::new(),
            serving: None,
            period: 0,
            refused_sync: None,
        }
    }
}

impl<R> Roster<R> {
    /// Another process dispatches now, or this one in a later period: it
    /// must not start jobs as dispatcher `me` in period `period`.
    pub fn replaced(&self, me: i32, period: u64) -> bool {
        match self.serving {
            Some(s) if s != me => true,
            Some(_) => self.period != period,
            None => false,
        }
    }

    /// A sync from the dispatcher that holds the lease now: from here on
    /// only it is served.
    pub fn serve(&mut self, from: i32, period: u64) {
        self.serving = Some(from);
        self.period = period;
        self.refused_sync = None;
    }

    /// A sync refused at beat `beat` (see [`Roster::refused_sync`]).
    pub fn refuse_sync(&mut self, beat: u64) {
        self.refused_sync.get_or_insert(beat);
    }

    /// Whether a job request from dispatcher `from` in its period `period`,
    /// to expire after beat `until`, may start here at beat `beat`, `proven`
    /// saying whether this process's proof holds and `room` whether it
    /// takes another job; admitted, it is listed.
    pub fn admit(
        &mut self,
        request: (i32, u64, u64),
        (beat, proven, room): (u64, bool, bool),
        id: u64,
        job: R,
    ) -> std::result::Result<(), Refusal> {
        let (from, period, until) = request;
        if !room {
            Err(Refusal::Full)
        } else if !proven {
            Err(Refusal::Unheard)
        } else if self.serving != Some(from)
            || self.period != period
            || self
                .refused_sync
                .is_some_and(|n| until > n.saturating_add(1))
        {
            Err(Refusal::Fenced)
        } else if beat > until {
            Err(Refusal::Late)
        } else {
            self.jobs.insert(id, job);
            Ok(())
        }
    }
}

/// A helper's own account of whether it may act for the dispatcher: the
/// beats it sent, the newest one acknowledged, its newest good lock check.
#[derive(Debug)]
pub(super) struct Standing {
    beat: u64,
    /// When each recent beat was sent, to date the dispatcher's answers.
    sent: VecDeque<(u64, Instant)>,
    acked: Instant,
    member_proven: Instant,
}

impl Standing {
    /// Joined at `now`: the membership was just proven.
    pub fn new(now: Instant) -> Standing {
        Standing {
            beat: 0,
            sent: VecDeque::new(),
            acked: now,
            member_proven: now,
        }
    }

    /// Until when this process may start a call for the dispatcher: while
    /// it is heard or holds its lock, and never past [`FENCE_LOCKED`]
    /// unheard.
    pub fn ends(&self) -> Instant {
        let either = (self.acked + FENCE).max(self.member_proven + MEMBER_PROOF);
        either.min(self.acked + FENCE_LOCKED)
    }

    pub fn holds(&self, now: Instant) -> bool {
        now < self.ends()
    }

    /// The number of the beat sent now.
    pub fn beat(&mut self, now: Instant) -> u64 {
        self.beat += 1;
        self.sent.push_back((self.beat, now));
        if self.sent.len() > 64 {
            self.sent.pop_front();
        }
        self.beat
    }

    /// The newest beat sent.
    pub fn last_beat(&self) -> u64 {
        self.beat
    }

    /// The dispatcher heard beat `named`: the proof runs from when that
    /// beat was sent, not from when the answer came (after a freeze, say).
    /// `None`: an answer that names no beat (an older dispatcher) proves
    /// nothing: it may have queued through a freeze, and which beat it
    /// answers, so since when the dispatcher has not heard this process,
    /// it cannot say (a helper of such a dispatcher holds on its member
    /// lock alone). True when the proof moved.
    pub fn acknowledged(&mut self, named: Option<u64>) -> bool {
        let at = named.and_then(|b| self.sent.iter().find(|(n, _)| *n == b).map(|(_, t)| *t));
        match at {
            Some(at) if at > self.acked => {
                self.acked = at;
                true
            }
            _ => false,
        }
    }

    /// The member lock was held when the check was sent, at `pinged`.
    pub fn lock_held(&mut self, pinged: Instant) {
        self.member_proven = self.member_proven.max(pinged);
    }
}

/// A beat from a process, as the dispatcher reads it.
#[derive(Debug, Clone)]
pub(super) struct Heard {
    pub member: i32,
    pub beat: u64,
    /// The jobs it takes at once; `None` while it leaves (shutting down).
    pub offer: Option<usize>,
    pub running: HashSet<u64>,
    /// The dispatcher it serves, and that dispatcher's period.
    pub serving: Option<(i32, u64)>,
    /// It refused a sync since ([`Roster::refused_sync`]): it takes only
    /// requests that expire soon until synced again.
    pub fenced: bool,
}

/// What the dispatcher knows of a process from its beats.
#[derive(Debug)]
pub(super) struct Helper {
    pub capacity: usize,
    pub leaving: bool,
    pub beat: u64,
    pub heard: Instant,
    /// The dispatcher's own deafness so far when it heard this helper:
    /// time it could not hear anyone does not count as the helper's
    /// silence.
    deaf_then: Duration,
    pub running: usize,
    pub serving: Option<i32>,
}

/// A job handed to a helper, and what the shell needs to end it (`T`).
#[derive(Debug)]
pub(super) struct Waiter<T> {
    pub member: i32,
    /// Beats after this one must list the job while it runs.
    since_beat: u64,
    pub end: T,
}

/// What a beat asks of the dispatcher.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Answer {
    /// Acknowledge this beat of this member (it serves this dispatcher).
    pub ack: Option<(i32, u64)>,
    /// Sync this member first (it serves no one, or another dispatcher).
    pub sync: bool,
}

/// The dispatcher's account of the crew for one period: who is alive, who
/// serves it, which jobs each runs for it. Jobs it takes for lost come
/// back out of it, with their `T`, for the shell to end.
#[derive(Debug)]
pub(super) struct Ledger<T> {
    me: i32,
    period: u64,
    pub helpers: HashMap<i32, Helper>,
    pub alive: HashSet<i32>,
    /// Members heard of whose lock is gone: when a successful poll first
    /// found it gone, and when one last did.
    gone: HashMap<i32, (Instant, Instant)>,
    reserved: HashMap<i32, usize>,
    waiting: HashMap<u64, Waiter<T>>,
    /// When this process last heard its own beat: silence from others
    /// means something only while it does.
    self_heard: Option<Instant>,
    /// How long, in all, this process could not hear its own beats (gaps
    /// between them past [`DEAF`], less the beat): a NATS path that flaps
    /// (down 3 s, up a moment, down again) must not age a helper's
    /// silence through time nobody could have heard it.
    deaf: Duration,
    syncing: HashSet<i32>,
    /// Processes whose jobs the takeover adopted from their beats
    /// ([`Takeover::adopts_from`]).
    from_beats: HashSet<i32>,
    /// Jobs whose end was heard while nobody waited for them (newest
    /// last, bounded): a takeover's sync answer may list a job whose end
    /// overtakes the answer, and adopted after it, the job would wait for
    /// an end already gone, then be taken for lost.
    early: VecDeque<u64>,
}

/// How many unwaited ends a ledger remembers: more than a crew runs at once.
const EARLY_ENDS: usize = 4096;

/// Jobs taken for lost: the shell ends each (the inbox decides, and a reset
/// to the ack floor brings back what is unacked).
pub(super) type Lost<T> = Vec<(u64, Waiter<T>)>;

impl<T> Ledger<T> {
    pub fn new(me: i32, period: u64) -> Ledger<T> {
        Ledger {
            me,
            period,
            helpers: HashMap::new(),
            alive: HashSet::new(),
            gone: HashMap::new(),
            reserved: HashMap::new(),
            waiting: HashMap::new(),
            self_heard: None,
            deaf: Duration::ZERO,
            syncing: HashSet::new(),
            from_beats: HashSet::new(),
            early: VecDeque::new(),
        }
    }

    fn take_where(&mut self, lost: impl Fn(u64, &Waiter<T>) -> bool) -> Lost<T> {
        let ids: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(id, w)| lost(**id, w))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.waiting.remove(&id).map(|w| (id, w)))
            .collect()
    }

    /// How long this process has been deaf until `now`, the gap since its
    /// last own beat included.
    fn deaf_at(&self, now: Instant) -> Duration {
        let open = self.self_heard.map_or(Duration::ZERO, |t| {
            deaf_gap(now.saturating_duration_since(t))
        });
        self.deaf + open
    }

    /// How long `h` has been silent while this process could hear.
    fn silence(&self, h: &Helper, now: Instant) -> Duration {
        let deaf = self.deaf_at(now).saturating_sub(h.deaf_then);
        now.saturating_duration_since(h.heard).saturating_sub(deaf)
    }

    pub fn hears_itself(&self, now: Instant) -> bool {
        self.self_heard
            .is_some_and(|t| now.saturating_duration_since(t) < FENCE)
    }

    /// The helper has stopped whatever it ran: this process hears itself
    /// (silence means something), has not heard the helper for [`SILENT`],
    /// and Postgres found its lock gone, and still gone [`GRACE`] later
    /// (every poll between answered: one that did not proves nothing, the
    /// helper may have taken its lock back meanwhile); or it has not heard
    /// the helper for [`SILENT_LOCKED`]. A helper still heard keeps its
    /// jobs, its lock gone or not: cut off from Postgres alone, it finishes
    /// them and records their outcome when Postgres answers again.
    pub fn stopped(&self, member: i32, now: Instant) -> bool {
        let Some(h) = self.helpers.get(&member) else {
            return false;
        };
        let silent = self.silence(h, now);
        let gone = self
            .gone
            .get(&member)
            .is_some_and(|(first, last)| last.saturating_duration_since(*first) >= GRACE);
        self.hears_itself(now) && ((gone && silent >= SILENT) || silent >= SILENT_LOCKED)
    }

    /// A process's beat, heard at `now`; `own` is this process's member
    /// id. A beat past a job's start that does not list it ends the wait
    /// for it (its end was reported first, or it never started).
    pub fn heard(&mut self, h: Heard, own: i32, now: Instant) -> (Answer, Lost<T>) {
        if h.member == own {
            self.deaf = self.deaf_at(now);
            self.self_heard = Some(now);
        }
        let deaf_then = self.deaf_at(now);
        let (member, beat) = (h.member, h.beat);
        let lost = self.take_where(|id, w| {
            w.member == member && beat > w.since_beat && !h.running.contains(&id)
        });
        let ours = h.serving == Some((self.me, self.period));
        let leaving = h.offer.is_none();
        // Adopted from its beats and still fenced since: whatever it runs
        // is this period's to wait for, and it starts nothing its beats
        // did not list, so its proof may rest on this dispatcher (its calls
        // go on, its lock unprovable).
        let vouched = h.fenced && self.from_beats.contains(&member);
        let answer = Answer {
            sync: (!ours || h.fenced) && !leaving && self.syncing.insert(member),
            ack: (ours || vouched).then_some((member, beat)),
        };
        self.helpers.insert(
            member,
            Helper {
                capacity: h.offer.unwrap_or(0),
                leaving,
                beat,
                heard: now,
                deaf_then,
                running: h.running.len(),
                serving: h
                    .serving
                    .filter(|(_, period)| *period == self.period)
                    .map(|(s, _)| s),
            },
        );
        (answer, lost)
    }

    /// A sync of `member` ended (answered or not): it may be synced again.
    pub fn synced(&mut self, member: i32) {
        self.syncing.remove(&member);
    }

    /// Postgres's word on who is alive, asked at `asked` and answered at
    /// `now` (`None`: no answer, so only silence counts, and no lock ages
    /// as gone: a lock is gone only for as long as every poll said so).
    /// A lock first found gone counts as gone from `now` (it went before
    /// the answer, maybe just before); and as still gone only at `asked`
    /// (it was gone when Postgres answered, maybe just after the question),
    /// so however slow the answers, [`GRACE`] of gone is never less.
    pub fn liveness(
        &mut self,
        alive: Option<HashSet<i32>>,
        asked: Instant,
        now: Instant,
    ) -> Lost<T> {
        if alive.is_none() {
            self.gone.clear();
        }
        if let Some(alive) = alive {
            let known: Vec<i32> = self
                .helpers
                .keys()
                .copied()
                .chain(self.waiting.values().map(|w| w.member))
                .collect();
            for id in known {
                if alive.contains(&id) {
                    self.gone.remove(&id);
                } else {
                    let (first, last) = self.gone.entry(id).or_insert((now, now));
                    *last = (*last).max(asked).max(*first);
                }
            }
            self.alive = alive;
        }
        let stopped: HashSet<i32> = self
            .waiting
            .values()
            .map(|w| w.member)
            .filter(|m| self.stopped(*m, now))
            .collect();
        let lost = self.take_where(|_, w| stopped.contains(&w.member));
        // Forget who is gone for good, once nothing waits on it.
        let waited: HashSet<i32> = self.waiting.values().map(|w| w.member).collect();
        let forget: Vec<i32> = self
            .gone
            .iter()
            .filter(|(id, (first, _))| {
                // A takeover may still account for it: not before the rule
                // says it stopped, whatever its lock (its silence would
                // start over with its lock's absence).
                now.saturating_duration_since(*first) >= SILENT
                    && !waited.contains(id)
                    && self
                        .helpers
                        .get(id)
                        .is_none_or(|h| self.silence(h, now) >= SILENT_LOCKED)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in forget {
            self.gone.remove(&id);
            self.helpers.remove(&id);
        }
        lost
    }

    fn pickable(&self, id: i32, h: &Helper, own: i32, now: Instant) -> bool {
        id != self.me
            && id != own
            && !h.leaving
            && h.serving == Some(self.me)
            && self.alive.contains(&id)
            && now.saturating_duration_since(h.heard) < SILENT
    }

    /// Jobs the other processes can take at once.
    pub fn capacity(&self, own: i32, now: Instant) -> usize {
        self.helpers
            .iter()
            .filter(|(id, h)| self.pickable(**id, h, own, now))
            .map(|(_, h)| h.capacity)
            .sum()
    }

    /// Other live processes of the crew.
    pub fn helper_count(&self, own: i32, now: Instant) -> usize {
        self.helpers
            .iter()
            .filter(|(id, h)| self.pickable(**id, h, own, now))
            .count()
    }

    /// The helper with the most room, which keeps a place for the job.
    pub fn pick(&mut self, own: i32, now: Instant) -> Option<i32> {
        let best = self
            .helpers
            .iter()
            .filter(|(id, h)| self.pickable(**id, h, own, now))
            .map(|(id, h)| {
                (
                    *id,
                    h.capacity
                        .saturating_sub(*self.reserved.get(id).unwrap_or(&0)),
                )
            })
            .filter(|(_, free)| *free > 0)
            .max_by_key(|(_, free)| *free)
            .map(|(id, _)| id)?;
        *self.reserved.entry(best).or_default() += 1;
        Some(best)
    }

    /// The job's place at `member` is free again.
    pub fn unreserve(&mut self, member: i32) {
        if let Some(n) = self.reserved.get_mut(&member) {
            *n = n.saturating_sub(1);
        }
    }

    /// Job `id` is about to be asked of `member`: waited for before the
    /// request goes (its end may come before the answer does). Returns the
    /// request's expiry: one beat after the last one heard, so a beat past
    /// it that does not list the job says it never started.
    pub fn expect(&mut self, id: u64, member: i32, end: T) -> u64 {
        let until = self.helpers.get(&member).map_or(0, |h| h.beat) + 1;
        self.waiting.insert(
            id,
            Waiter {
                member,
                since_beat: u64::MAX,
                end,
            },
        );
        until
    }

    /// The helper admitted job `id` at its beat `beat`.
    pub fn accepted(&mut self, id: u64, beat: u64) {
        if let Some(w) = self.waiting.get_mut(&id) {
            w.since_beat = beat;
        }
    }

    /// No answer to the request for job `id` (it may have been admitted):
    /// a beat past its expiry `until` tells.
    pub fn unanswered(&mut self, id: u64, until: u64) {
        if let Some(w) = self.waiting.get_mut(&id) {
            w.since_beat = until;
        }
    }

    /// Job `id` ended (its end was heard), or was refused: no longer waited.
    pub fn ended(&mut self, id: u64) -> Option<Waiter<T>> {
        let waiter = self.waiting.remove(&id);
        if waiter.is_none() {
            if self.early.len() == EARLY_ENDS {
                self.early.pop_front();
            }
            self.early.push_back(id);
        }
        waiter
    }

    /// A job `member` listed as running when this dispatcher synced it at
    /// its beat `beat` (its answer heard at `now`): waited for like one
    /// sent. False, and not waited for, when its end came first.
    pub fn adopt(&mut self, id: u64, member: i32, beat: u64, end: T, now: Instant) -> bool {
        if self.early.contains(&id) {
            return false;
        }
        let deaf_then = self.deaf_at(now);
        self.helpers.entry(member).or_insert(Helper {
            capacity: 0,
            leaving: false,
            beat,
            heard: now,
            deaf_then,
            running: 0,
            serving: None,
        });
        self.waiting.insert(
            id,
            Waiter {
                member,
                since_beat: beat,
                end,
            },
        );
        true
    }

    /// The takeover adopted `member`'s jobs from its beats.
    pub fn adopted_from_beats(&mut self, member: i32) {
        self.from_beats.insert(member);
    }

    /// This process heard `member` beat while it ran jobs, at `at`, before
    /// this period heard from it: its silence counts from then.
    pub fn overheard(&mut self, member: i32, at: Instant) {
        let deaf_then = self.deaf_at(at);
        let h = self.helpers.entry(member).or_insert(Helper {
            capacity: 0,
            leaving: false,
            beat: 0,
            heard: at,
            deaf_then,
            running: 1,
            serving: None,
        });
        if h.heard < at {
            h.heard = at;
            h.deaf_then = deaf_then;
        }
    }

    /// Jobs waited for.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_waited(&self, id: u64) -> bool {
        self.waiting.contains_key(&id)
    }

    /// Processes heard running jobs since `started`: a takeover accounts
    /// for each (its lock may be gone while it runs them, cut off from
    /// Postgres alone).
    pub fn heard_running(&self, started: Instant) -> impl Iterator<Item = i32> + '_ {
        self.helpers
            .iter()
            .filter(move |(_, h)| h.running > 0 && h.heard > started)
            .map(|(id, _)| *id)
    }

    /// Whether a takeover that began at `started` may go on without an
    /// answer from `member`: it has stopped its jobs by the rule
    /// ([`stopped`](Self::stopped)), or, never heard, could not have been
    /// acknowledged since `started` for [`SILENT_LOCKED`] of the time this
    /// process could hear (`deaf_then`: its deafness at `started`, from
    /// [`deafness`](Self::deafness)).
    pub fn accounted(
        &self,
        member: i32,
        (started, deaf_then): (Instant, Duration),
        now: Instant,
    ) -> bool {
        match self.helpers.contains_key(&member) {
            true => self.stopped(member, now),
            false => {
                let deaf = self.deaf_at(now).saturating_sub(deaf_then);
                let heard_for = now.saturating_duration_since(started).saturating_sub(deaf);
                self.hears_itself(now) && heard_for >= SILENT_LOCKED
            }
        }
    }

    /// How long this process could not hear its own beats, until `now`.
    pub fn deafness(&self, now: Instant) -> Duration {
        self.deaf_at(now)
    }

    /// The period ended: nobody waits for these any more.
    pub fn clear(&mut self) {
        self.waiting.clear();
    }
}

/// How long a helper heard (or asked to run a job) stays part of the crew
/// a takeover accounts for, its member lock held or not: past this,
/// silent, it has stopped its jobs by the rule whatever its lock
/// ([`SILENT_LOCKED`]).
pub(super) const OVERHEARD: Duration = SILENT_LOCKED;

/// A new period's account of the crew it takes over: whom it must hear
/// from before it resets the durable to its ack floor (which runs again
/// whatever it has not adopted), and when it may go on without an answer.
#[derive(Debug)]
pub(super) struct Takeover {
    /// When it began, and how deaf the period's ledger was then.
    began: (Instant, Duration),
    /// The processes that answered its sync (their jobs adopted).
    pub answered: HashSet<i32>,
    /// The processes that refused it, and the beat each had sent by then:
    /// cut off from Postgres, a process cannot tell who holds the lease.
    refused: HashMap<i32, u64>,
}

impl Takeover {
    pub fn new<T>(ledger: &Ledger<T>, now: Instant) -> Takeover {
        Takeover {
            began: (now, ledger.deafness(now)),
            answered: HashSet::new(),
            refused: HashMap::new(),
        }
    }

    /// `member` refused the sync at its beat `beat`.
    pub fn refused(&mut self, member: i32, beat: u64) {
        self.refused.entry(member).or_insert(beat);
    }

    /// Whether `member`'s beat `beat`, which lists what it runs, stands for
    /// the answer it cannot give: its jobs are adopted from it. Having
    /// refused at beat `n`, the process admits no request that expires
    /// after beat `n + 1` until it is synced again
    /// ([`Roster::refused_sync`]), so every job it may start for anyone is
    /// listed from beat `n + 2` on, with those it ran before.
    pub fn adopts_from(&self, member: i32, beat: u64) -> bool {
        !self.answered.contains(&member)
            && self
                .refused
                .get(&member)
                .is_some_and(|n| beat >= n.saturating_add(2))
    }

    pub fn started(&self) -> Instant {
        self.began.0
    }

    /// Every live process (Postgres's word), every one this period heard
    /// running jobs, and every one this process heard (or asked to run a
    /// job) lately (`overheard`: who, and when its last beat was), which
    /// `ledger` learns of as heard then (its proof runs from a beat, idle
    /// or not): a process whose lock is gone (every one's,
    /// after a Postgres stall past the lock's timeout; or one cut off from
    /// both) may run them still, and is waited for until it answers or the
    /// rule says it has stopped them.
    pub fn targets<T>(
        &self,
        ledger: &mut Ledger<T>,
        live: &HashSet<i32>,
        overheard: impl IntoIterator<Item = (i32, Instant)>,
    ) -> HashSet<i32> {
        let mut targets: HashSet<i32> = live
            .iter()
            .copied()
            .chain(ledger.heard_running(self.began.0))
            .collect();
        for (member, at) in overheard {
            ledger.overheard(member, at);
            targets.insert(member);
        }
        targets
    }

    /// Those of `targets` that have not answered.
    pub fn unanswered(&self, targets: &HashSet<i32>) -> Vec<i32> {
        let mut ids: Vec<i32> = targets
            .iter()
            .filter(|m| !self.answered.contains(m))
            .copied()
            .collect();
        ids.sort();
        ids
    }

    /// Whether every one of `targets` answered, or has stopped its jobs by
    /// the rule ([`Ledger::accounted`]).
    pub fn complete<T>(&self, ledger: &Ledger<T>, targets: &HashSet<i32>, now: Instant) -> bool {
        self.unanswered(targets)
            .iter()
            .all(|m| ledger.accounted(*m, self.began, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review N7: a VM paused with its clock leaves a helper's proof
    /// looking fresh; Postgres's clock, which ran, tells.
    #[test]
    fn a_clock_that_stood_still_is_told_by_postgres() {
        let t0 = Instant::now();
        let srv = 1_800_000_000.0;
        let checks = |ours: u64, theirs: f64| {
            clock_stood_still((t0, srv), (t0 + Duration::from_millis(ours), srv + theirs))
        };
        assert!(!checks(250, 0.25), "a beat apart");
        assert!(!checks(250, 0.75), "a slow check");
        assert!(!checks(10_000, 10.2), "a long gap both clocks saw");
        assert!(!checks(250, -3.0), "Postgres's clock stepped back");
        assert!(checks(250, 10.0), "10 s that this process did not see");
        assert!(checks(0, 2.0), "a check sent at once after the last");
    }
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    /// Review of the crew, finding 5: a request that timed out at the
    /// dispatcher could still start at the helper after the dispatcher had
    /// taken it for lost. It now names the helper's last beat at which it
    /// may start; and an old dispatcher's requests are refused once a new
    /// one has synced the helper.
    #[test]
    fn a_job_request_is_refused_once_late_or_from_a_replaced_dispatcher() {
        let mut r = Roster::<()>::default();
        let ok = (5, true, true);
        assert_eq!(
            r.admit((7, 1, 5), (1, true, true), 1, ()),
            Err(Refusal::Fenced),
            "serves no one yet"
        );
        r.serve(7, 1);
        assert_eq!(r.admit((7, 1, 5), ok, 1, ()), Ok(()));
        assert_eq!(
            r.admit((7, 1, 5), (6, true, true), 2, ()),
            Err(Refusal::Late)
        );
        assert_eq!(
            r.admit((7, 1, 5), (5, false, true), 2, ()),
            Err(Refusal::Unheard)
        );
        assert_eq!(
            r.admit((7, 1, 5), (5, true, false), 2, ()),
            Err(Refusal::Full)
        );
        assert_eq!(
            r.admit((8, 1, 9), (1, true, true), 2, ()),
            Err(Refusal::Fenced),
            "not the dispatcher it serves"
        );
        assert!(r.replaced(8, 1));
        assert!(!r.replaced(7, 1));
        assert!(r.replaced(7, 2), "a later period of the same process");
        assert!(
            !Roster::<()>::default().replaced(7, 1),
            "nobody synced it yet"
        );
        assert_eq!(r.jobs.len(), 1, "only the admitted job is listed");
    }

    /// Issue 56, item 11: a process that refused a sync at beat 5 starts no
    /// job its beat 7 would not list (a takeover adopts from that one),
    /// whoever asks: an old dispatcher thawed from a freeze may still send
    /// requests that expire later.
    #[test]
    fn a_process_that_refused_a_sync_admits_only_requests_its_next_beats_list() {
        let mut r = Roster::<()>::default();
        r.serve(7, 1);
        r.refuse_sync(5);
        r.refuse_sync(6);
        assert_eq!(r.refused_sync, Some(5), "the first refusal counts");
        assert_eq!(r.admit((7, 1, 6), (5, true, true), 1, ()), Ok(()));
        assert_eq!(
            r.admit((7, 1, 7), (5, true, true), 2, ()),
            Err(Refusal::Fenced),
            "expires after beat 6: beat 7 may not list it"
        );
        r.serve(8, 2);
        assert_eq!(r.refused_sync, None, "synced again");
        assert_eq!(r.admit((8, 2, 9), (8, true, true), 3, ()), Ok(()));
    }

    /// The same process dispatches again (it lost its lease and took it
    /// back). A request its previous period sent, still on its way, came
    /// with the same member id and was admitted after the new period's
    /// sync: a job the new period knew nothing of.
    #[test]
    fn a_request_from_a_previous_period_of_the_same_dispatcher_is_refused() {
        let mut r = Roster::<()>::default();
        r.serve(7, 1);
        assert_eq!(r.admit((7, 1, 5), (5, true, true), 1, ()), Ok(()));
        r.serve(7, 2);
        assert_eq!(
            r.admit((7, 1, 5), (5, true, true), 2, ()),
            Err(Refusal::Fenced),
            "the old period's request"
        );
        assert_eq!(r.admit((7, 2, 5), (5, true, true), 3, ()), Ok(()));
    }

    #[test]
    fn a_job_reply_reads_back_as_it_was_sent() {
        for reply in [
            JobReply::Admitted { beat: 42 },
            JobReply::Refused(Refusal::Full),
            JobReply::Refused(Refusal::Fenced),
            JobReply::Refused(Refusal::Late),
            JobReply::Refused(Refusal::Unheard),
            JobReply::Other,
        ] {
            assert_eq!(JobReply::read(reply.encode().as_bytes()), reply);
        }
        assert_eq!(JobReply::read(b"ok x"), JobReply::Other);
        assert_eq!(JobReply::read(b"\xff"), JobReply::Other);
    }

    #[test]
    fn the_proof_runs_from_the_acknowledged_beats_sending_and_the_lock_check() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut p = Standing::new(t0);
        assert_eq!(p.ends(), t0 + FENCE.max(MEMBER_PROOF));
        let b1 = p.beat(t0 + ms(100));
        p.lock_held(t0 + ms(100));
        // Acknowledged late (after a freeze): dated by the beat's sending.
        assert!(p.acknowledged(Some(b1)));
        assert_eq!(p.ends(), t0 + ms(100) + FENCE.max(MEMBER_PROOF));
        assert!(!p.acknowledged(Some(b1)), "not twice");
        assert!(
            !p.acknowledged(Some(99)),
            "a beat never sent proves nothing"
        );
        assert!(p.holds(t0 + ms(100) + FENCE - ms(1)));
        assert!(!p.holds(t0 + ms(100) + FENCE));
    }

    /// Review N10: an acknowledgement that names no beat (a dispatcher of
    /// an older version) was dated when it arrived, so one queued through
    /// a freeze renewed a helper the dispatcher had meanwhile taken for
    /// lost. It cannot say which beat was heard: it proves nothing.
    #[test]
    fn an_acknowledgement_naming_no_beat_proves_nothing() {
        let t0 = Instant::now();
        let mut p = Standing::new(t0);
        p.beat(t0);
        let thawed = t0 + Duration::from_secs(20);
        assert!(!p.acknowledged(None), "the proof moved");
        assert!(!p.holds(thawed));
    }

    /// Issue 56: a pause is not a crash. The proof held only while the
    /// helper was both heard and proved its lock, so a Postgres restart
    /// (1.5 s) or a dispatcher stalled 2 s cut every call in flight.
    #[test]
    fn the_proof_survives_postgres_alone_or_the_dispatcher_alone_going_quiet() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // Postgres gone for a minute: every beat still acknowledged.
        let mut p = Standing::new(t0);
        for t in (0..60_000).step_by(250) {
            let b = p.beat(t0 + ms(t));
            p.acknowledged(Some(b));
            assert!(
                p.holds(t0 + ms(t + 249)),
                "lapsed at {t} ms, Postgres alone gone"
            );
        }
        // The dispatcher silent 2.2 s (and NATS up to FENCE_LOCKED): the
        // lock is checked every beat.
        let mut p = Standing::new(t0);
        let b = p.beat(t0);
        p.acknowledged(Some(b));
        for t in (250..4_750).step_by(250) {
            p.beat(t0 + ms(t));
            p.lock_held(t0 + ms(t));
            assert!(
                p.holds(t0 + ms(t + 249)),
                "lapsed at {t} ms, unheard but locked"
            );
        }
        assert!(!p.holds(t0 + FENCE_LOCKED), "unheard for FENCE_LOCKED");
        // Both gone (a freeze, a host cut off): the later of the two ends.
        let mut p = Standing::new(t0);
        let b = p.beat(t0);
        p.acknowledged(Some(b));
        p.lock_held(t0);
        assert!(p.holds(t0 + ms(2_500)), "a 2.5 s freeze costs nothing");
        assert!(!p.holds(t0 + FENCE.max(MEMBER_PROOF)));
    }

    /// The dispatcher's half of the same rule: a helper still heard keeps
    /// its jobs with its lock gone (cut off from Postgres alone); one with
    /// its lock gone and silent for SILENT, or silent for SILENT_LOCKED
    /// with its lock held, has stopped them.
    #[test]
    fn a_job_is_taken_for_lost_only_from_a_helper_neither_heard_nor_locked() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let heard = |member, beat, running: &[u64]| Heard {
            member,
            beat,
            offer: Some(4),
            running: running.iter().copied().collect(),
            serving: Some((D, PERIOD)),
            fenced: false,
        };
        let mut l: Ledger<()> = Ledger::new(D, PERIOD);
        l.heard(heard(D, 1, &[]), D, t0);
        l.heard(heard(1, 1, &[]), D, t0);
        l.liveness(Some([D, 1].into()), t0, t0);
        let until = l.expect(7, 1, ());
        l.accepted(7, until);
        // Its lock gone for a minute, its beats still heard listing job 7.
        for t in (250..60_000).step_by(250) {
            let now = t0 + ms(t);
            l.heard(heard(D, t, &[]), D, now);
            let (_, lost) = l.heard(heard(1, t, &[7]), D, now);
            assert!(lost.is_empty());
            assert!(
                l.liveness(Some([D].into()), now, now).is_empty(),
                "lost at {t} ms while heard"
            );
        }
        // Then silent too: lost SILENT after the last beat, not before.
        let last = t0 + ms(59_750);
        let mut at = None;
        for t in (60_000..70_000).step_by(250) {
            let now = t0 + ms(t);
            l.heard(heard(D, t, &[]), D, now);
            if !l.liveness(Some([D].into()), now, now).is_empty() {
                at = Some(now);
                break;
            }
        }
        let at = at.expect("a helper gone from both is taken for lost");
        assert!(
            at >= last + SILENT,
            "lost {:?} after its last beat",
            at - last
        );
        // Its lock held, silent: lost after SILENT_LOCKED only.
        let mut l: Ledger<()> = Ledger::new(D, PERIOD);
        l.heard(heard(D, 1, &[]), D, t0);
        l.heard(heard(1, 1, &[7]), D, t0);
        l.adopt(7, 1, 1, (), t0);
        let mut at = None;
        for t in (250..10_000).step_by(250) {
            let now = t0 + ms(t);
            l.heard(heard(D, t, &[]), D, now);
            if !l.liveness(Some([D, 1].into()), now, now).is_empty() {
                at = Some(now);
                break;
            }
        }
        assert_eq!(at.map(|a| a - t0), Some(SILENT_LOCKED));
    }

    /// Seen on a loaded run of a whole-crew Postgres stall: a helper's
    /// answer to the takeover's sync listed a job, the job ended, and its
    /// end reached the dispatcher before the answer was adopted (the
    /// takeover waits for every process's answer first). Adopted after its
    /// end, the job waited for an end already gone, and the helper's next
    /// beat made it lost (a needless reset, and a warning).
    #[test]
    fn a_job_whose_end_overtakes_its_adoption_is_not_waited_for() {
        let t0 = Instant::now();
        let mut l: Ledger<()> = Ledger::new(D, PERIOD);
        l.heard(
            Heard {
                member: D,
                beat: 1,
                offer: Some(0),
                running: HashSet::new(),
                serving: Some((D, PERIOD)),
                fenced: false,
            },
            D,
            t0,
        );
        assert!(l.ended(7).is_none(), "nobody waited for it yet");
        assert!(!l.adopt(7, 1, 3, (), t0), "its end came first");
        assert!(l.adopt(8, 1, 3, (), t0));
        let (_, lost) = l.heard(
            Heard {
                member: 1,
                beat: 4,
                offer: Some(4),
                running: [8].into(),
                serving: Some((D, PERIOD)),
                fenced: false,
            },
            D,
            t0 + Duration::from_millis(250),
        );
        assert!(
            lost.is_empty(),
            "taken for lost: {:?}",
            lost.iter().map(|(id, _)| id).collect::<Vec<_>>()
        );
        assert_eq!(l.waiting(), 1);
    }

    /// Review N6, the directed sequence: a lock seen gone, polls that go
    /// unanswered while the helper takes its lock back unseen, then gone
    /// again. The first sighting must not age across the gap.
    #[test]
    fn a_lock_gone_ages_only_across_answered_polls() {
        let mut events = vec![Event::Advance(100), Event::Join, Event::Advance(1000)];
        events.extend(std::iter::repeat_n(Event::Send, 16));
        events.extend([
            Event::Advance(300),
            Event::DropLock(3),
            Event::Advance(150),
            Event::DispatcherBlind(4000),
            Event::Advance(4350),
            Event::DropLock(3),
            Event::Advance(300),
        ]);
        for seed in 0..64 {
            run_world(seed, &events);
        }
    }

    // ------------------------------------------------------------------
    // The crew in a simulated world: one dispatcher (member 0) and three
    // helpers, a network that delays, reorders (except one subscription's
    // own order) and drops, Postgres's locks that end after LEASE_TTL of a
    // session's silence, processes that freeze, are cut off or die.

    const LEASE_TTL: Duration = super::super::super::lease::LEASE_TTL;
    const D: i32 = 0;
    const PERIOD: u64 = 1;
    const HELPERS: i32 = 3;
    /// How long a helper may still be in a call after its proof lapsed:
    /// a task of its own cuts the calls when the proof's end comes (the
    /// helper's loop may be busy for several PINGs), so only the timer's
    /// and the scheduler's latency.
    const CUT: Duration = Duration::from_millis(50);
    const SEND_TIMEOUT_MS: u64 = 500;

    #[derive(Debug, Clone)]
    enum Event {
        Advance(u64),
        Send,
        Finish(usize, usize),
        /// A helper's call returned 200: the job is past its call, its
        /// completion to record (a cut no longer stops it; `Finish` ends
        /// it, here or through another process that records it).
        Succeed(usize, usize),
        Kill(usize),
        /// A new process joins the crew (a restart comes back as one).
        Join,
        Freeze(usize, u64),
        Partition(usize, u64),
        CutPostgres(usize, u64),
        /// Postgres ends the member lock's session at once (a terminated
        /// backend, a restart): the helper takes the lock back when it can.
        DropLock(usize),
        DispatcherCut(u64),
        DispatcherBlind(u64),
        /// The dispatcher's lease lapsed (a Postgres stall, a slow ping)
        /// and it takes it back: a new period, whose takeover syncs the
        /// crew, adopts what each process runs, and resets the durable to
        /// its ack floor (what it did not adopt runs again).
        Retake,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            8 => (1u64..400).prop_map(Event::Advance),
            5 => Just(Event::Send),
            4 => (0usize..8, 0usize..4).prop_map(|(h, k)| Event::Finish(h, k)),
            2 => (0usize..8, 0usize..4).prop_map(|(h, k)| Event::Succeed(h, k)),
            1 => (0usize..8).prop_map(Event::Kill),
            1 => Just(Event::Join),
            1 => (0usize..8, 100u64..9000).prop_map(|(h, d)| Event::Freeze(h, d)),
            1 => (0usize..8, 100u64..9000).prop_map(|(h, d)| Event::Partition(h, d)),
            1 => (0usize..8, 100u64..9000).prop_map(|(h, d)| Event::CutPostgres(h, d)),
            1 => (0usize..8).prop_map(Event::DropLock),
            1 => (100u64..9000).prop_map(Event::DispatcherCut),
            1 => (100u64..9000).prop_map(Event::DispatcherBlind),
            1 => Just(Event::Retake),
        ]
    }

    #[derive(Debug, Clone)]
    enum Msg {
        /// helper → dispatcher, on the one `.s.*` subscription (ordered).
        Hello(Heard),
        Done(u64),
        /// dispatcher → helper.
        Ack(u64),
        Sync {
            period: u64,
        },
        /// helper → dispatcher: a sync refused (it cannot ask Postgres who
        /// holds the lease), and the helper's beat then.
        SyncRefused {
            period: u64,
            beat: u64,
        },
        /// helper → dispatcher: a sync's answer, what the helper lists.
        SyncAnswer {
            period: u64,
            beat: u64,
            running: Vec<u64>,
        },
        Request {
            id: u64,
            until: u64,
            period: u64,
        },
        /// helper → dispatcher, the request's answer: Some(beat) admitted.
        Answer {
            id: u64,
            admitted: Option<u64>,
        },
    }

    struct HelperSim {
        id: i32,
        dead: bool,
        frozen_until: u64,
        cut_until: u64,
        pg_cut_until: u64,
        roster: Roster<()>,
        standing: Standing,
        next_beat: u64,
        /// Postgres: when its session last spoke (the lock ends LEASE_TTL
        /// later), and whether the lock is held.
        pg_spoke: u64,
        locked: bool,
        /// Requests it has read while frozen, to handle on thawing.
        inbox: Vec<Msg>,
        /// Jobs whose call succeeded, their completion still to record.
        past: HashSet<u64>,
        /// The last millisecond it was frozen or cut off from NATS.
        unreachable_at: Option<u64>,
    }

    impl HelperSim {
        fn new(id: i32, t0: Instant, now: u64) -> HelperSim {
            HelperSim {
                id,
                dead: false,
                frozen_until: 0,
                cut_until: 0,
                pg_cut_until: 0,
                roster: Roster::default(),
                standing: Standing::new(t0 + Duration::from_millis(now)),
                next_beat: now,
                pg_spoke: now,
                locked: true,
                inbox: Vec::new(),
                past: HashSet::new(),
                unreachable_at: None,
            }
        }

        /// The jobs still in their call (not past it), in id order.
        fn in_call(&self) -> Vec<u64> {
            let mut ids: Vec<u64> = self
                .roster
                .jobs
                .keys()
                .filter(|id| !self.past.contains(id))
                .copied()
                .collect();
            ids.sort();
            ids
        }
    }

    struct World {
        t0: Instant,
        now: u64,
        rng: StdRng,
        ledger: Ledger<()>,
        helpers: Vec<HelperSim>,
        /// (deliver at, to: -1 the dispatcher, else the helper index), msg.
        net: Vec<(u64, i32, i32, Msg)>,
        /// The last delivery time on each helper's `.s.*` stream.
        ordered: BTreeMap<i32, u64>,
        d_cut_until: u64,
        d_blind_until: u64,
        d_next_beat: u64,
        d_next_liveness: u64,
        /// Requests awaiting their answer, and when the dispatcher stops
        /// waiting: (id, member, until, deadline).
        asked: Vec<(u64, i32, u64, u64)>,
        next_id: u64,
        /// Jobs the dispatcher took for lost (it runs them again), and when.
        lost: HashMap<u64, u64>,
        /// Jobs it knows ended, or were refused.
        ended: HashSet<u64>,
        sent: HashSet<u64>,
        admitted: usize,
        /// The dispatcher's period, and its takeover while one runs.
        period: u64,
        takeover: Option<Takeover>,
        next_poll: u64,
        /// Syncs the takeover waits an answer for, and until when.
        syncing: HashMap<i32, u64>,
        /// Whom the dispatcher's process heard running jobs, and when (the
        /// shell's `overhear`).
        overheard: HashMap<i32, u64>,
        /// The newest beat heard of each process, and the jobs it listed.
        last_hello: HashMap<i32, (u64, Vec<u64>)>,
        /// Jobs a helper finished (recorded and acked: a reset does not
        /// bring them back).
        finished: HashSet<u64>,
        takeovers: usize,
    }

    impl World {
        fn new(seed: u64) -> World {
            let t0 = Instant::now();
            let mut rng = StdRng::seed_from_u64(seed);
            // Each helper beats in its own phase, as processes started
            // apart do: a lock drop between a beat and the poll is seen.
            let helpers = (1..=HELPERS)
                .map(|id| {
                    let mut h = HelperSim::new(id, t0, 0);
                    h.next_beat = rng.gen_range(0..250);
                    h
                })
                .collect();
            World {
                t0,
                now: 0,
                rng,
                ledger: Ledger::new(D, PERIOD),
                helpers,
                net: Vec::new(),
                ordered: BTreeMap::new(),
                d_cut_until: 0,
                d_blind_until: 0,
                d_next_beat: 0,
                d_next_liveness: 0,
                asked: Vec::new(),
                next_id: 1,
                lost: HashMap::new(),
                ended: HashSet::new(),
                sent: HashSet::new(),
                admitted: 0,
                period: PERIOD,
                takeover: None,
                next_poll: 0,
                syncing: HashMap::new(),
                last_hello: HashMap::new(),
                overheard: HashMap::new(),
                finished: HashSet::new(),
                takeovers: 0,
            }
        }

        fn at(&self, ms: u64) -> Instant {
            self.t0 + Duration::from_millis(ms)
        }

        /// Mostly prompt; now and then late (a beat's stream holds up
        /// every later beat, so its delays are rarer).
        fn latency(&mut self, ordered: bool) -> u64 {
            if ordered && self.rng.gen_ratio(1, 200) {
                self.rng.gen_range(100..1000)
            } else if !ordered && self.rng.gen_ratio(1, 8) {
                self.rng.gen_range(200..3000)
            } else {
                self.rng.gen_range(0..40)
            }
        }

        /// Send from `from` (-1: the dispatcher) to `to`; dropped when
        /// either end is cut off now.
        fn send(&mut self, from: i32, to: i32, msg: Msg) {
            let cut = |w: &World, p: i32| {
                if p < 0 {
                    w.now < w.d_cut_until
                } else {
                    w.now < w.helpers[p as usize].cut_until
                }
            };
            if cut(self, from) || cut(self, to) {
                return;
            }
            let ordered = to < 0 && matches!(msg, Msg::Hello(_) | Msg::Done(_));
            let mut at = self.now + self.latency(ordered);
            if ordered {
                let last = self.ordered.entry(from).or_insert(0);
                at = at.max(*last);
                *last = at;
            }
            self.net.push((at, from, to, msg));
        }

        fn declare_lost(&mut self, lost: Lost<()>) {
            for (id, w) in lost {
                self.ledger.unreserve(w.member);
                self.run_again(id, w.member - 1);
            }
        }

        /// Job `id` runs again (taken for lost, or brought back by a
        /// takeover's reset): helper `h` may not be running it still.
        fn run_again(&mut self, id: u64, h: i32) {
            self.lost.insert(id, self.now);
            self.check(h);
            // A job whose call succeeded, at a helper that could be heard
            // all along, is run again: a successful call made twice by a
            // pause, not a crash.
            let hs = &self.helpers[h as usize];
            let reachable = hs
                .unreachable_at
                .is_none_or(|t| self.now.saturating_sub(t) > SILENT_LOCKED.as_millis() as u64);
            assert!(
                hs.dead || !hs.past.contains(&id) || !reachable,
                "job {id} succeeded at helper {}, which could be heard, and was run again at {}ms: its call is made again",
                hs.id,
                self.now
            );
        }

        /// The takeover's reset to the ack floor: every job not finished,
        /// not adopted and not run again already runs again now.
        fn reset(&mut self) {
            let mut ids: Vec<u64> = self
                .sent
                .iter()
                .filter(|id| {
                    !self.finished.contains(id)
                        && !self.lost.contains_key(id)
                        && !self.ledger.is_waited(**id)
                })
                .copied()
                .collect();
            ids.sort();
            for id in ids {
                self.lost.insert(id, self.now);
                for h in 0..self.helpers.len() {
                    if self.helpers[h].roster.jobs.contains_key(&id) {
                        self.run_again(id, h as i32);
                    }
                }
            }
        }

        /// A step of the takeover (the shell's `adopt` loop, every fifth
        /// of a beat): ask whom it must hear from, and end it once each
        /// answered or has stopped its jobs by the rule.
        fn take_over(&mut self) {
            let now = self.now;
            if self.takeover.is_none() || now < self.next_poll {
                return;
            }
            self.next_poll = now + BEAT.as_millis() as u64 / 5;
            if now < self.d_blind_until {
                return;
            }
            let live: HashSet<i32> = self
                .helpers
                .iter()
                .filter(|h| h.locked)
                .map(|h| h.id)
                .chain([D])
                .collect();
            let overheard: Vec<(i32, Instant)> = self
                .overheard
                .iter()
                .filter(|(_, t)| now.saturating_sub(**t) < OVERHEARD.as_millis() as u64)
                .map(|(m, t)| (*m, self.at(*t)))
                .collect();
            let Some(t) = self.takeover.as_mut() else {
                return;
            };
            // Its own process answers itself, through NATS.
            if now >= self.d_cut_until {
                t.answered.insert(D);
            }
            let targets = t.targets(&mut self.ledger, &live, overheard);
            let started = t.started();
            let ask: Vec<i32> = t
                .unanswered(&targets)
                .into_iter()
                .filter(|m| *m != D && self.syncing.get(m).is_none_or(|until| *until <= now))
                .collect();
            for m in ask {
                self.syncing.insert(m, now + SEND_TIMEOUT_MS);
                let period = self.period;
                self.send(-1, m - 1, Msg::Sync { period });
            }
            // One that cannot answer is adopted from its beats, once they
            // list whatever an earlier period may have started there.
            let Some(t) = self.takeover.as_mut() else {
                return;
            };
            for m in t.unanswered(&targets) {
                let Some((beat, running)) = self.last_hello.get(&m) else {
                    continue;
                };
                if m == D || !t.adopts_from(m, *beat) {
                    continue;
                }
                t.answered.insert(m);
                self.syncing.remove(&m);
                self.ledger.adopted_from_beats(m);
                for id in running {
                    self.ledger
                        .adopt(*id, m, *beat, (), self.t0 + Duration::from_millis(now));
                }
            }
            let Some(t) = self.takeover.as_ref() else {
                return;
            };
            if !t.answered.contains(&D) && self.at(now) >= started + FENCE {
                // Cannot reach itself: it gives the lease up and asks again.
                self.takeover = None;
                self.step(&Event::Retake);
                return;
            }
            if t.complete(&self.ledger, &targets, self.at(now)) {
                self.takeover = None;
                self.takeovers += 1;
                self.reset();
            }
        }

        /// The rule, at helper `h`: a job the dispatcher took for lost (and
        /// runs again) may be listed there only by a helper whose proof
        /// lapsed long enough before that for its next beat to have cut
        /// the call; and its proof may not come back while it lists it.
        fn check(&self, h: i32) {
            let hs = &self.helpers[h as usize];
            if hs.dead {
                return;
            }
            // A job past its call makes no call again: only calls can overlap.
            for id in hs.roster.jobs.keys().filter(|id| !hs.past.contains(id)) {
                if let Some(&at) = self.lost.get(id) {
                    assert!(
                        hs.standing.ends() + CUT <= self.at(at),
                        "job {id} taken for lost at {at}ms while helper {} runs it with its proof until {}ms (now {}ms)",
                        hs.id,
                        hs.standing.ends().duration_since(self.t0).as_millis(),
                        self.now
                    );
                }
            }
        }

        fn step(&mut self, e: &Event) {
            let n = self.helpers.len();
            let pick = move |h: usize| h % n;
            match *e {
                Event::Join => {
                    if self.helpers.len() < 8 {
                        let id = self.helpers.len() as i32 + 1;
                        let mut h = HelperSim::new(id, self.t0, self.now);
                        h.next_beat = self.now + self.rng.gen_range(0..250);
                        self.helpers.push(h);
                    }
                }
                Event::Advance(ms) => {
                    for _ in 0..ms {
                        self.now += 1;
                        self.tick();
                    }
                }
                Event::Send => {
                    if self.takeover.is_some() {
                        return;
                    }
                    if let Some(h) = self.ledger.pick(D, self.at(self.now)) {
                        let id = self.next_id;
                        self.next_id += 1;
                        let until = self.ledger.expect(id, h, ());
                        self.overheard.insert(h, self.now);
                        self.sent.insert(id);
                        self.asked.push((id, h, until, self.now + SEND_TIMEOUT_MS));
                        let period = self.period;
                        self.send(-1, h - 1, Msg::Request { id, until, period });
                    }
                }
                Event::Finish(h, k) => {
                    let h = pick(h);
                    let hs = &mut self.helpers[h];
                    if hs.dead || self.now < hs.frozen_until {
                        return;
                    }
                    let mut ids: Vec<u64> = hs.roster.jobs.keys().copied().collect();
                    ids.sort();
                    if let Some(&id) = ids.get(k) {
                        hs.roster.jobs.remove(&id);
                        hs.past.remove(&id);
                        self.finished.insert(id);
                        self.send(h as i32, -1, Msg::Done(id));
                    }
                }
                Event::Succeed(h, k) => {
                    let h = pick(h);
                    let now = self.at(self.now);
                    let hs = &mut self.helpers[h];
                    if hs.dead || self.now < hs.frozen_until || !hs.standing.holds(now) {
                        return;
                    }
                    if let Some(&id) = hs.in_call().get(k) {
                        hs.past.insert(id);
                    }
                }
                Event::Kill(h) => {
                    let hs = &mut self.helpers[pick(h)];
                    hs.dead = true;
                    hs.locked = false;
                    hs.roster.jobs.clear();
                    hs.past.clear();
                }
                Event::Freeze(h, d) => self.helpers[pick(h)].frozen_until = self.now + d,
                Event::Partition(h, d) => self.helpers[pick(h)].cut_until = self.now + d,
                Event::CutPostgres(h, d) => self.helpers[pick(h)].pg_cut_until = self.now + d,
                Event::DropLock(h) => self.helpers[pick(h)].locked = false,
                Event::DispatcherCut(d) => self.d_cut_until = self.now + d,
                Event::DispatcherBlind(d) => self.d_blind_until = self.now + d,
                Event::Retake => {
                    if self.takeover.is_none() {
                        self.period += 1;
                        self.ledger = Ledger::new(D, self.period);
                        self.asked.clear();
                        self.syncing.clear();
                        self.takeover = Some(Takeover::new(&self.ledger, self.at(self.now)));
                        self.next_poll = self.now;
                    }
                }
            }
        }

        /// One millisecond of the world.
        fn tick(&mut self) {
            let now = self.now;
            // Postgres ends a session silent for LEASE_TTL.
            for h in &mut self.helpers {
                if now < h.frozen_until || now < h.cut_until {
                    h.unreachable_at = Some(now);
                }
                let silent = now < h.frozen_until || now < h.pg_cut_until;
                if !silent {
                    h.pg_spoke = now;
                }
                if h.locked && now.saturating_sub(h.pg_spoke) >= LEASE_TTL.as_millis() as u64 {
                    h.locked = false;
                }
            }
            // Deliveries due.
            let mut due = Vec::new();
            self.net.retain(|m| {
                if m.0 <= now {
                    due.push(m.clone());
                    false
                } else {
                    true
                }
            });
            due.sort_by_key(|m| m.0);
            for (_, from, to, msg) in due {
                if to < 0 {
                    self.dispatcher_reads(from, msg);
                } else {
                    let h = to as usize;
                    if self.helpers[h].dead {
                        continue;
                    }
                    self.helpers[h].inbox.push(msg);
                }
            }
            // Requests that went unanswered.
            let timed_out: Vec<(u64, i32, u64, u64)> =
                self.asked.iter().filter(|a| a.3 <= now).copied().collect();
            self.asked.retain(|a| a.3 > now);
            for (id, _, until, _) in timed_out {
                self.ledger.unanswered(id, until);
            }
            for h in 0..self.helpers.len() {
                self.helper_runs(h);
            }
            // The dispatcher's own beat, and its liveness poll.
            if now >= self.d_next_beat {
                self.d_next_beat = now + BEAT.as_millis() as u64;
                if now >= self.d_cut_until {
                    let heard = Heard {
                        member: D,
                        beat: now,
                        offer: Some(0),
                        running: HashSet::new(),
                        serving: Some((D, self.period)),
                        fenced: false,
                    };
                    let (_, lost) = self.ledger.heard(heard, D, self.at(now));
                    self.declare_lost(lost);
                }
            }
            if now >= self.d_next_liveness {
                self.d_next_liveness = now + LIVENESS.as_millis() as u64;
                let alive = (now >= self.d_blind_until).then(|| {
                    self.helpers
                        .iter()
                        .filter(|h| h.locked)
                        .map(|h| h.id)
                        .chain([D])
                        .collect()
                });
                let lost = self.ledger.liveness(alive, self.at(now), self.at(now));
                self.declare_lost(lost);
            }
            self.take_over();
        }

        /// Job `id` ended at helper `from` (or it refused the job).
        fn end(&mut self, id: u64, from: i32) {
            if self.ledger.ended(id).is_some() {
                self.ended.insert(id);
                self.ledger.unreserve(from + 1);
            }
        }

        fn dispatcher_reads(&mut self, from: i32, msg: Msg) {
            let now = self.at(self.now);
            match msg {
                Msg::Hello(h) => {
                    let member = h.member;
                    self.overheard.insert(member, self.now);
                    let mut running: Vec<u64> = h.running.iter().copied().collect();
                    running.sort();
                    self.last_hello.insert(member, (h.beat, running));
                    let (answer, lost) = self.ledger.heard(h, D, now);
                    self.declare_lost(lost);
                    if let Some((m, beat)) = answer.ack {
                        self.send(-1, m - 1, Msg::Ack(beat));
                    }
                    if answer.sync {
                        let period = self.period;
                        self.send(-1, member - 1, Msg::Sync { period });
                        self.ledger.synced(member);
                    }
                }
                Msg::SyncAnswer {
                    period,
                    beat,
                    running,
                } => {
                    let member = from + 1;
                    let Some(t) = self.takeover.as_mut() else {
                        return;
                    };
                    if period != self.period || t.answered.contains(&member) {
                        return;
                    }
                    t.answered.insert(member);
                    self.syncing.remove(&member);
                    for id in running {
                        self.ledger.adopt(id, member, beat, (), now);
                    }
                }
                Msg::SyncRefused { period, beat } => {
                    let member = from + 1;
                    if let Some(t) = self.takeover.as_mut() {
                        if period == self.period {
                            t.refused(member, beat);
                        }
                    }
                }
                Msg::Done(id) => self.end(id, from),
                Msg::Answer { id, admitted } => {
                    // Only while the dispatcher still waits for the answer.
                    let Some(pos) = self.asked.iter().position(|a| a.0 == id) else {
                        return;
                    };
                    self.asked.remove(pos);
                    match admitted {
                        Some(beat) => self.ledger.accepted(id, beat),
                        None => self.end(id, from),
                    }
                }
                _ => {}
            }
        }

        fn helper_runs(&mut self, h: usize) {
            let now_ms = self.now;
            let now = self.at(now_ms);
            {
                let hs = &self.helpers[h];
                if hs.dead || now_ms < hs.frozen_until {
                    return;
                }
            }
            // The cut at the proof's end: `cut_at_lapse` in the shell.
            if !self.helpers[h].standing.holds(now) {
                self.cut(h);
            }
            let inbox = std::mem::take(&mut self.helpers[h].inbox);
            for msg in inbox {
                match msg {
                    Msg::Ack(beat) => {
                        self.helpers[h].standing.acknowledged(Some(beat));
                    }
                    Msg::Sync { period } => {
                        // Only from the lease's holder: asked of Postgres.
                        if now_ms < self.helpers[h].pg_cut_until {
                            let beat = self.helpers[h].standing.last_beat();
                            self.helpers[h].roster.refuse_sync(beat);
                            self.send(h as i32, -1, Msg::SyncRefused { period, beat });
                            continue;
                        }
                        let hs = &mut self.helpers[h];
                        hs.roster.serve(D, period);
                        let mut running: Vec<u64> = hs.roster.jobs.keys().copied().collect();
                        running.sort();
                        let beat = hs.standing.last_beat();
                        self.send(
                            h as i32,
                            -1,
                            Msg::SyncAnswer {
                                period,
                                beat,
                                running,
                            },
                        );
                    }
                    Msg::Request { id, until, period } => {
                        let hs = &mut self.helpers[h];
                        let beat = hs.standing.last_beat();
                        let proven = hs.standing.holds(now);
                        let room = hs.roster.jobs.len() < 4;
                        let admitted =
                            hs.roster
                                .admit((D, period, until), (beat, proven, room), id, ());
                        if admitted.is_ok() {
                            self.admitted += 1;
                            assert!(
                                !self.lost.contains_key(&id),
                                "job {id} started at helper {} at {}ms after the dispatcher took it for lost",
                                h + 1,
                                now_ms
                            );
                        }
                        let answer = Msg::Answer {
                            id,
                            admitted: admitted.ok().map(|_| beat),
                        };
                        self.send(h as i32, -1, answer);
                    }
                    _ => {}
                }
            }
            self.check(h as i32);
            if now_ms < self.helpers[h].next_beat {
                return;
            }
            self.helpers[h].next_beat = now_ms + BEAT.as_millis() as u64;
            // Its proof lapsed: it cuts its calls and reports them.
            if !self.helpers[h].standing.holds(now) {
                self.cut(h);
            }
            let hs = &mut self.helpers[h];
            let beat = hs.standing.beat(now);
            let heard = Heard {
                member: hs.id,
                beat,
                offer: Some(4),
                running: hs.roster.jobs.keys().copied().collect(),
                serving: hs.roster.serving.map(|s| (s, hs.roster.period)),
                fenced: hs.roster.refused_sync.is_some(),
            };
            self.send(h as i32, -1, Msg::Hello(heard));
            // Its member lock: checked, or taken back under the same id.
            let hs = &mut self.helpers[h];
            if now_ms >= hs.pg_cut_until {
                if !hs.locked {
                    hs.locked = true;
                }
                hs.standing.lock_held(now);
            }
        }

        /// Helper `h` cuts the calls it makes, and says so; a job past its
        /// call stays, to record its outcome (as `stop_jobs` in the shell).
        fn cut(&mut self, h: usize) {
            for id in self.helpers[h].in_call() {
                self.helpers[h].roster.jobs.remove(&id);
                self.send(h as i32, -1, Msg::Done(id));
            }
        }

        /// Helper `h` ends every job it runs, and says so.
        fn end_all(&mut self, h: usize) {
            self.helpers[h].past.clear();
            let ids: Vec<u64> = self.helpers[h]
                .roster
                .jobs
                .drain()
                .map(|(id, _)| id)
                .collect();
            for id in ids {
                self.finished.insert(id);
                self.send(h as i32, -1, Msg::Done(id));
            }
        }

        /// Everything heals; time runs until every job is accounted for.
        fn settle(&mut self) {
            self.d_cut_until = 0;
            self.d_blind_until = 0;
            for h in &mut self.helpers {
                h.frozen_until = h.frozen_until.min(self.now);
                h.cut_until = 0;
                h.pg_cut_until = 0;
            }
            for _ in 0..20 {
                for h in 0..self.helpers.len() {
                    if !self.helpers[h].dead {
                        self.end_all(h);
                    }
                }
                self.step(&Event::Advance(1000));
            }
        }
    }

    fn run_world(seed: u64, events: &[Event]) -> World {
        let mut w = World::new(seed);
        // Every helper joins and is synced before the story starts.
        w.step(&Event::Advance(1000));
        for e in events {
            w.step(e);
        }
        w.settle();
        w
    }

    proptest! {
        // CREW_CASES=20000 for a deeper search than CI's.
        #![proptest_config(ProptestConfig {
            cases: std::env::var("CREW_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
            ..ProptestConfig::default()
        })]

        /// Never two runs of one job at once (checked at every step), and
        /// never a lost one: once the world heals, every job handed to a
        /// helper has ended or been taken for lost.
        #[test]
        fn the_crew_never_runs_a_job_twice_at_once_nor_loses_one(
            seed in any::<u64>(),
            events in proptest::collection::vec(event(), 1..160),
        ) {
            let w = run_world(seed, &events);
            prop_assert!(w.takeover.is_none(), "a takeover still runs after the world healed");
            prop_assert_eq!(w.ledger.waiting(), 0, "jobs still waited for after the world healed");
            for id in &w.sent {
                prop_assert!(
                    w.ended.contains(id) || w.lost.contains_key(id) || w.finished.contains(id),
                    "job {} neither ended nor lost", id
                );
            }
        }
    }

    /// Found by the random search above on CI (seed and shrunk events as
    /// proptest printed them): the dispatcher's NATS path went for 3.5 s,
    /// came back for 70 ms, went again; 2.5 s later it took a job for lost
    /// from a helper it had not heard for 6.4 s, though it had itself been
    /// deaf for all but 70 ms of them. The helper had made the call and
    /// was recording its success: the call would have been made again.
    /// Silence now counts only while the dispatcher can hear.
    #[test]
    fn a_dispatcher_whose_path_flaps_takes_no_job_for_lost_through_its_own_deafness() {
        run_world(
            1338578777330553450,
            &[
                Event::Advance(378),
                Event::Join,
                Event::Advance(34),
                Event::DispatcherBlind(3647),
                Event::Advance(148),
                Event::Finish(7, 1),
                Event::Succeed(0, 3),
                Event::Succeed(4, 0),
                Event::Join,
                Event::Advance(380),
                Event::Send,
                Event::Join,
                Event::Advance(159),
                Event::Partition(6, 5216),
                Event::DispatcherCut(235),
                Event::Send,
                Event::DispatcherBlind(1315),
                Event::Send,
                Event::Advance(355),
                Event::DropLock(5),
                Event::Partition(0, 2874),
                Event::Send,
                Event::DispatcherCut(4343),
                Event::DropLock(7),
                Event::Succeed(0, 0),
                Event::Finish(0, 1),
                Event::Send,
                Event::Advance(115),
                Event::Freeze(2, 8803),
                Event::Kill(6),
                Event::Advance(302),
                Event::Advance(326),
                Event::Finish(3, 1),
                Event::Advance(131),
                Event::Advance(277),
                Event::Send,
                Event::Kill(5),
                Event::Succeed(2, 1),
                Event::Finish(2, 2),
                Event::Partition(4, 5353),
                Event::Send,
                Event::Finish(5, 2),
                Event::Send,
                Event::Advance(347),
                Event::Finish(5, 1),
                Event::Advance(175),
                Event::DropLock(3),
                Event::Finish(5, 1),
                Event::Advance(87),
                Event::Advance(75),
                Event::Advance(17),
                Event::Finish(2, 1),
                Event::Send,
                Event::Send,
                Event::DispatcherCut(1626),
                Event::Advance(60),
                Event::CutPostgres(5, 6581),
                Event::Finish(4, 0),
                Event::Send,
                Event::Advance(209),
                Event::Freeze(0, 5219),
                Event::Advance(107),
                Event::DropLock(1),
                Event::Finish(4, 1),
                Event::Advance(109),
                Event::Finish(2, 1),
                Event::Succeed(1, 0),
                Event::Advance(349),
                Event::Advance(168),
                Event::Advance(319),
                Event::Advance(4),
                Event::Join,
                Event::Advance(371),
                Event::Finish(1, 1),
                Event::DispatcherCut(8942),
                Event::Advance(303),
                Event::DispatcherBlind(2050),
                Event::Freeze(4, 4804),
                Event::Advance(14),
                Event::Advance(283),
                Event::Send,
                Event::Send,
                Event::Succeed(0, 3),
                Event::Advance(142),
                Event::Freeze(4, 5964),
                Event::Finish(0, 2),
                Event::Advance(289),
                Event::Send,
                Event::Advance(47),
                Event::Partition(0, 1223),
                Event::Advance(383),
                Event::Freeze(6, 5265),
                Event::Kill(7),
                Event::Advance(242),
                Event::Advance(232),
                Event::Send,
                Event::DispatcherCut(4473),
                Event::Send,
                Event::Send,
                Event::Succeed(4, 0),
                Event::Succeed(1, 0),
                Event::Send,
                Event::DropLock(3),
                Event::Finish(1, 1),
                Event::Send,
                Event::DispatcherCut(641),
                Event::Send,
                Event::Advance(64),
                Event::Send,
                Event::Advance(91),
                Event::Send,
                Event::Advance(347),
                Event::Succeed(0, 3),
                Event::Join,
                Event::Partition(0, 1573),
                Event::Send,
                Event::Send,
                Event::Finish(4, 2),
                Event::Send,
                Event::Advance(85),
                Event::Advance(316),
                Event::Send,
                Event::Join,
                Event::Kill(0),
                Event::Finish(3, 2),
                Event::Send,
                Event::Advance(260),
                Event::DispatcherCut(672),
                Event::Kill(5),
                Event::DispatcherCut(5886),
                Event::Finish(0, 1),
                Event::DispatcherCut(258),
                Event::Succeed(1, 0),
                Event::Send,
                Event::Send,
                Event::Send,
                Event::Advance(380),
                Event::Kill(2),
                Event::Join,
                Event::Send,
                Event::Advance(31),
                Event::Advance(172),
                Event::Send,
                Event::Join,
                Event::Succeed(2, 1),
                Event::Succeed(1, 1),
                Event::Advance(232),
                Event::Advance(258),
                Event::Send,
                Event::Join,
                Event::Partition(4, 4815),
                Event::CutPostgres(7, 632),
            ],
        );
    }

    /// A lock drop the dispatcher saw once, then Postgres not answering its
    /// polls: the drop must not age into "its jobs have stopped" while the
    /// helper took its lock back and goes on with them.
    #[test]
    fn a_lock_seen_gone_once_does_not_age_while_postgres_does_not_answer() {
        let mut events = vec![Event::Advance(100), Event::Join, Event::Advance(500)];
        events.extend(std::iter::repeat_n(Event::Send, 16));
        events.extend([
            Event::Advance(300),
            Event::DropLock(3),
            Event::Advance(150),
            Event::DispatcherBlind(5000),
            Event::Advance(4000),
        ]);
        for seed in 0..64 {
            run_world(seed, &events);
        }
    }

    /// Issue 56, items 1 and 2: a helper whose call succeeded and whose
    /// Postgres is then cut off (its lock goes, its completion waits) while
    /// NATS carries its beats: its job is never taken for lost. The old
    /// rule took it 3 s after the lock went, and ran the call again.
    #[test]
    fn a_success_at_a_helper_cut_off_from_postgres_alone_is_never_run_again() {
        let mut events = vec![Event::Advance(100), Event::Join, Event::Advance(1000)];
        events.extend(std::iter::repeat_n(Event::Send, 12));
        events.push(Event::Advance(200));
        for h in 0..4 {
            events.push(Event::Succeed(h, 0));
        }
        events.extend([
            Event::CutPostgres(0, 9000),
            Event::CutPostgres(1, 9000),
            Event::CutPostgres(2, 9000),
            Event::CutPostgres(3, 9000),
            Event::Advance(9500),
        ]);
        for seed in 0..64 {
            run_world(seed, &events);
        }
    }

    /// The simulation does exercise the paths it guards: jobs are handed
    /// out, end, and are taken for lost.
    #[test]
    fn the_simulated_world_hands_out_ends_and_loses_jobs() {
        let mut events = vec![Event::Advance(1000)];
        for _ in 0..10 {
            events.push(Event::Send);
            events.push(Event::Advance(50));
        }
        events.push(Event::Finish(0, 0));
        events.push(Event::Freeze(1, 8000));
        events.push(Event::Advance(300));
        events.push(Event::Kill(2));
        events.push(Event::Advance(9000));
        let w = run_world(7, &events);
        assert!(w.sent.len() >= 5, "sent {}", w.sent.len());
        assert!(w.admitted >= 5, "admitted {}", w.admitted);
        assert!(!w.ended.is_empty());
        assert!(!w.lost.is_empty());
    }

    /// Issue 56: every process's path to Postgres stalls 4 s; the member
    /// locks go at 3 s, the dispatcher's lease with them, and it takes the
    /// lease back (a new period) while no lock is back yet. Its takeover
    /// must adopt what the helpers run, not take the crew for the live
    /// processes alone (none) and run every job again (a loaded run of the
    /// shell repeated 7 of 144 calls this way).
    #[test]
    fn a_takeover_after_a_crew_wide_postgres_stall_adopts_what_the_helpers_run() {
        let mut events = vec![Event::Advance(1000)];
        for _ in 0..9 {
            events.push(Event::Send);
            events.push(Event::Advance(30));
        }
        events.push(Event::Succeed(0, 0));
        events.push(Event::Succeed(1, 0));
        for h in 0..3 {
            events.push(Event::CutPostgres(h, 4000));
        }
        events.push(Event::Advance(3300));
        events.push(Event::Retake);
        events.push(Event::Advance(3000));
        for seed in 0..32 {
            let w = run_world(seed, &events);
            assert!(w.takeovers >= 1, "seed {seed}: no takeover ended");
            assert!(w.admitted >= 3, "seed {seed}: admitted {}", w.admitted);
        }
    }

    /// Issue 56, item 11: a helper cut off from Postgres alone, its
    /// successful call's completion waiting to be recorded, when the
    /// dispatcher takes its lease back. It cannot answer the sync (it
    /// cannot ask who holds the lease) and lists the job beat after beat:
    /// the takeover waited for it until its 30 s limit, gave the lease up,
    /// and again (the shell's `a_process_that_stops_dispatching_…` test).
    /// Its refusal names its beat; two beats later its beats list all it
    /// may run for an earlier period, and the takeover adopts the jobs
    /// from them: done long before Postgres is back, the job not run again.
    #[test]
    fn a_takeover_adopts_from_its_beats_a_helper_cut_off_from_postgres() {
        let mut events = vec![Event::Advance(1000)];
        for _ in 0..9 {
            events.push(Event::Send);
            events.push(Event::Advance(30));
        }
        events.extend([
            Event::Succeed(0, 0),
            Event::CutPostgres(0, 60_000),
            Event::Advance(100),
            Event::Retake,
        ]);
        for seed in 0..32 {
            let mut w = World::new(seed);
            w.step(&Event::Advance(1000));
            for e in &events {
                w.step(e);
            }
            let retaken = w.now;
            let calling = w.helpers[0].in_call();
            while w.takeovers == 0 && w.now < retaken + 10_000 {
                w.step(&Event::Advance(50));
            }
            assert!(
                w.takeovers >= 1,
                "seed {seed}: no takeover ended within 10 s while the helper's Postgres is cut"
            );
            // The new period vouches for it: its calls go on.
            w.step(&Event::Advance(6000));
            assert_eq!(
                w.helpers[0].in_call(),
                calling,
                "seed {seed}: the helper cut off from Postgres alone cut its calls"
            );
            w.settle();
        }
    }

    /// The same process takes its lease back while a helper is frozen:
    /// the takeover waits for it (it was heard running jobs a moment ago)
    /// until the rule says it has stopped them, then runs them again.
    #[test]
    fn a_takeover_waits_for_a_frozen_helper_it_heard_lately() {
        let mut events = vec![Event::Advance(1000)];
        for _ in 0..9 {
            events.push(Event::Send);
            events.push(Event::Advance(30));
        }
        events.extend([
            Event::Freeze(0, 9000),
            Event::Advance(100),
            Event::Retake,
            Event::Advance(12000),
        ]);
        for seed in 0..32 {
            let w = run_world(seed, &events);
            assert!(w.takeovers >= 1, "seed {seed}: no takeover ended");
        }
    }
}
